"""The benchmark parts. Each takes (runner, preset, data paths, log) and returns a JSON-ready
dict. Comparisons run every arm inside one call, interleaved, and report medians."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.runner import ROOT, aggregate, interleaved
from train.config.schema import DEFAULT_PREFETCH_FACTOR

# The configuration docs/benchmarks.md recommends: one worker per core, default prefetch.
RECOMMENDED = {"prefetch": DEFAULT_PREFETCH_FACTOR, "persistent": True}


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _compare(runner, arms: dict[str, str], base: dict, preset: dict, log) -> dict:
    """{arm: {"samples_per_s": {workers: median}, "detail": {workers: aggregate},
    "rounds": {workers: [samples/s of each round, None where the trial failed]}}}."""
    out = {arm: {"samples_per_s": {}, "detail": {}, "rounds": {}} for arm in arms}
    for workers in preset["workers"]:
        log(f" workers={workers}")
        spec = {**base, "workers": workers}
        trials = interleaved(runner, [(a, p, spec) for a, p in arms.items()], preset["reps"], log)
        for arm, results in trials.items():
            summary = aggregate(results)
            out[arm]["samples_per_s"][str(workers)] = summary["samples_per_s"]
            out[arm]["detail"][str(workers)] = summary
            out[arm]["rounds"][str(workers)] = [
                t.get("samples_per_s") if t.get("ok") else None for t in results
            ]
    return out


def _ratio_table(
    figures: dict, ours: str, peers: list[str], workers: list[int], higher_is_better: bool
) -> dict:
    """{f"{ours}_vs_{peer}": {workers: ratio}} of a per-arm figure ({arm: {workers: value}}):
    ours over the peer where higher is better (speed), the peer over ours where lower is (CPU)."""
    table = {}
    for peer in peers:
        better, worse = (ours, peer) if higher_is_better else (peer, ours)
        table[f"{ours}_vs_{peer}"] = {
            str(w): _ratio(figures[better][str(w)], figures[worse][str(w)]) for w in workers
        }
    return table


def _paired_ratios(out: dict, ours: str, peers: list[str], workers: list[int]) -> dict:
    """Median over the rounds of ours / peer within the round. The two trials of a round run
    back to back (interleaved: ours then the peer, then the peer then ours), so a slow spell of
    the shared host, which moves one arm's speed by 30-40% between rounds here, mostly cancels
    in the round's own ratio; the ratio of the medians keeps it when the spells fall unevenly."""
    paired = {}
    for peer in peers:
        by_workers = {}
        for w in workers:
            rounds = zip(out[ours]["rounds"][str(w)], out[peer]["rounds"][str(w)])
            ratios = [a / b for a, b in rounds if a and b]
            by_workers[str(w)] = round(statistics.median(ratios), 3) if ratios else None
        paired[f"{ours}_vs_{peer}"] = by_workers
    return paired


def _all_ratios(out: dict, ours: str, peers: list[str], workers: list[int]) -> dict:
    """ "ratios": of the median speeds; "paired_ratios": see _paired_ratios; "cpu_ratios": the
    peer's CPU time per sample (trainer plus loader workers, in the steady window) over ours."""
    arms = (ours, *peers)
    speeds = {arm: out[arm]["samples_per_s"] for arm in arms}
    cpu = {
        arm: {w: d.get("cpu_us_per_sample") for w, d in out[arm]["detail"].items()} for arm in arms
    }
    return {
        "ratios": _ratio_table(speeds, ours, peers, workers, higher_is_better=True),
        "paired_ratios": _paired_ratios(out, ours, peers, workers),
        "cpu_ratios": _ratio_table(cpu, ours, peers, workers, higher_is_better=False),
    }


def resnet_compare(runner, preset: dict, data: dict, log) -> dict:
    log("resnet50: ours vs torchvision recipe vs full decode")
    base = {**data["image"], **preset["resnet"]}
    arms = {
        "ours": "resnet50.ours",
        "torchvision_ref": "resnet50.torchvision_ref",
        "decode_only": "resnet50.decode_only",
    }
    out = _compare(runner, arms, base, preset, log)
    out.update(_all_ratios(out, "ours", ["torchvision_ref", "decode_only"], preset["workers"]))
    out["settings"] = {**base, "workers": preset["workers"], "reps": preset["reps"]}
    return out


def png_probe(runner, data: dict, log) -> dict:
    """Can PaddleOCR's LMDBDataSet read our mixed JPEG/PNG LMDB in this env, in the main
    process and in a loader worker (the reported segfault is in zlib's inflateReset2)?"""
    spec = {"lmdb": data["ocr"]["mixed"], "charset": data["ocr"]["charset"]}
    spec.update(batch_size=32, batches=4, warmup=0)
    verdicts, errors = {}, []
    for workers in (0, 1):
        result = runner.trial("ocr.paddleocr", {**spec, "workers": workers})
        ok = result.get("ok")
        verdicts[str(workers)] = "ok" if ok else ("crashed" if result.get("crashed") else "error")
        errors += [] if ok else [result.get("error", "")[:1500]]
    verdict = "ok" if set(verdicts.values()) == {"ok"} else "failed"
    log(f"ocr: PaddleOCR LMDBDataSet on the JPEG+PNG LMDB (by workers): {verdicts}")
    return {"result": verdict, "by_workers": verdicts, "errors": errors}


def ocr_compare(runner, preset: dict, data: dict, log) -> dict:
    from bench.data import ocr_jpeg_only

    probe = png_probe(runner, data, log)
    lmdb = data["ocr"]["mixed"]
    if probe["result"] != "ok":
        lmdb = ocr_jpeg_only(data["ocr"]["num"])
    base = {"lmdb": lmdb, "charset": data["ocr"]["charset"], **preset["ocr"]}
    rows = {"ours": "ocr.ours", "paddleocr": "ocr.paddleocr"}
    log(f"ocr: ours vs PaddleOCR LMDBDataSet on {Path(lmdb).name} records")
    out = _compare(runner, rows, base, preset, log)
    out.update(_all_ratios(out, "ours", ["paddleocr"], preset["workers"]))
    if preset.get("recaug"):
        log("ocr: with RecAug on both sides")
        aug = _compare(runner, rows, {**base, "augment": True}, preset, log)
        out["ours_recaug"], out["paddleocr_recaug"] = aug["ours"], aug["paddleocr"]
        arms = {"ours_recaug": aug["ours"], "paddleocr_recaug": aug["paddleocr"]}
        for kind, ratios in _all_ratios(
            arms, "ours_recaug", ["paddleocr_recaug"], preset["workers"]
        ).items():
            out[kind].update(ratios)
    out["png_probe"] = probe
    out["records"] = "jpeg+png" if lmdb == data["ocr"]["mixed"] else "jpeg-only"
    out["settings"] = {**base, "workers": preset["workers"], "reps": preset["reps"]}
    return out


def ipc_bytes(results: dict) -> dict:
    """Bytes per batch through worker IPC: our uint8 batches vs the peers' float32 ones."""
    out = {}
    for task, ours, peer in (
        ("resnet50", "ours", "torchvision_ref"),
        ("ocr", "ours", "paddleocr"),
    ):
        if task not in results:
            continue
        detail = {arm: next(iter(results[task][arm]["detail"].values())) for arm in (ours, peer)}
        ours_b, peer_b = detail[ours]["batch_bytes"], detail[peer]["batch_bytes"]
        out[task] = {
            "ours_bytes": ours_b,
            "ours_dtype": detail[ours].get("image_dtype"),
            "peer_bytes": peer_b,
            "peer_dtype": detail[peer].get("image_dtype"),
            "ratio": _ratio(ours_b, peer_b),
        }
    return out


def stall(runner, preset: dict, data: dict, framework: str, speeds: dict, log) -> dict:
    """Fraction of wall time blocked on data when each step 'computes' (sleeps) for a fixed
    time. The step is set so that demand is 70% of what our loader delivered at the most
    workers in the comparison (never shorter than the preset's step): the question is whether
    a loader that is fast enough also hides its latency."""
    cores = max(preset["workers"])
    if framework == "torch":
        base = {**data["image"], **preset["resnet"]}
        ours, peer = "resnet50.ours", "resnet50.torchvision_ref"
    else:
        base = {"lmdb": data["ocr_lmdb"], "charset": data["ocr"]["charset"], **preset["ocr"]}
        ours, peer = "ocr.ours", "ocr.paddleocr"
    delivered = speeds.get(str(cores)) or 1.0
    step = round(max(preset["stall_step_s"], base["batch_size"] / (0.7 * delivered)), 3)
    # No memory sampling here: reading /proc/*/smaps would add to the step, not to the wait.
    batches = preset["stall_batches"]
    # The throughput warm-up can be as long as the whole stall trial (quick OCR: 8 of 8), which
    # left no steady part to measure: warm up for half the trial at most.
    warmup = min(base.get("warmup", 2), batches // 2)
    base = {**base, "step_s": step, "batches": batches, "warmup": warmup, "memory_every_s": 0}
    arms = [
        (f"ours_w{cores}", ours, {**base, "workers": cores, **RECOMMENDED}),
        (f"peer_w{cores}", peer, {**base, "workers": cores, **RECOMMENDED}),
        ("ours_w0", ours, {**base, "workers": 0}),
    ]
    log(f"stall ({framework}): {step}s simulated step")
    trials = interleaved(runner, arms, preset.get("stall_reps", 1), log)
    rows = {}
    for label, results in trials.items():
        summary = aggregate(results)
        rows[label] = {
            "wait_fraction": summary["wait_fraction"],
            "samples_per_s": summary["samples_per_s"],
            "demand_samples_per_s": round(base["batch_size"] / step, 1),
        }
    return {"step_s": step, "batch_size": base["batch_size"], "configs": rows}


def knob_matrix(runner, preset: dict, data: dict, framework: str, log) -> list[dict]:
    """num_workers x prefetch_factor x persistent_workers x pin_memory/use_shared_memory."""
    if framework == "torch":
        base, pipeline, flag = {**data["image"], **preset["resnet"]}, "resnet50.ours", "pin"
    else:
        base = {"lmdb": data["ocr_lmdb"], "charset": data["ocr"]["charset"], **preset["ocr"]}
        pipeline, flag = "ocr.ours", "shm"
    arms = [("w0", pipeline, {**base, "workers": 0})]
    for workers in [w for w in preset["workers"] if w > 0]:
        for prefetch in preset["knob_prefetch"]:
            for persistent in (False, True):
                # paddle with shared memory: our batch ring, and Paddle's own hand-over
                variants = [{flag: False}, {flag: True}]
                if flag == "shm":
                    variants.insert(1, {flag: True, "ring": False})
                for variant in variants:
                    life = "pers" if persistent else "fresh"
                    label = f"w{workers}_p{prefetch}_{life}_{flag}{int(variant[flag])}"
                    label += "_ring0" if variant.get("ring") is False else ""
                    spec = {"workers": workers, "prefetch": prefetch, "persistent": persistent}
                    arms.append((label, pipeline, {**base, **spec, **variant}))
    log(f"knob matrix ({framework}): {len(arms)} configs")
    trials = interleaved(runner, arms, preset["knob_reps"], log)
    rows = []
    for label, _, spec in arms:
        summary = aggregate(trials[label])
        prefetch = spec.get("prefetch", DEFAULT_PREFETCH_FACTOR) if spec["workers"] else 0
        rows.append(
            {
                "config": label,
                "framework": framework,
                "num_workers": spec["workers"],
                "prefetch_factor": prefetch,
                "persistent_workers": spec.get("persistent", False),
                flag: spec.get(flag, flag == "shm"),
                "samples_per_s": summary["samples_per_s"],
                "shm_estimate_bytes": (summary["batch_bytes"] or 0) * prefetch * spec["workers"],
                "shm_peak_delta_bytes": summary["shm_peak_delta_bytes"],
                "peak_worker_rss_mb": summary["peak_worker_rss_mb"],
                "peak_worker_uss_mb": summary["peak_worker_uss_mb"],
                "first_batch_s": (summary.get("first_batch_s") or [None])[0],
                "copies_per_batch": summary.get("copies_per_batch"),
                "handover_share": summary.get("handover_share"),
            }
        )
    return rows


def cold_start(runner, preset: dict, data: dict, framework: str, log) -> list[dict]:
    """Epoch 1 vs epoch 2 (whole epochs, persistent workers) for each cache mode."""
    if framework == "torch":
        base, pipeline = {**data["image"], **preset["resnet"]}, "resnet50.ours"
    else:
        base = {"lmdb": data["ocr_lmdb"], "charset": data["ocr"]["charset"], **preset["ocr"]}
        pipeline = "ocr.ours"
    workers = max(preset["workers"])
    base = {**base, "workers": workers, "epochs": 2, "batches": None, **RECOMMENDED}
    arms = []
    for mode in ("none", "memory", "disk"):
        # A fresh cache folder per run: a disk cache left by an earlier trial would make
        # epoch 1 warm.
        cache_dir = tempfile.mkdtemp(prefix=f"bench-cache-{mode}-", dir=ROOT / "bench" / "data")
        arms.append((mode, pipeline, {**base, "cache": mode, "cache_dir": cache_dir}))
    log(f"cold start ({framework}): epoch 1 vs 2, cache none/memory/disk")
    trials = interleaved(runner, arms, 1, log)
    for _, _, spec in arms:
        shutil.rmtree(spec["cache_dir"], ignore_errors=True)
    rows = []
    for mode, _, _ in arms:
        summary = aggregate(trials[mode])
        rows.append(
            {
                "cache": mode,
                "framework": framework,
                "num_workers": workers,
                "epoch_s": summary.get("epoch_s"),
                "first_batch_s": summary.get("first_batch_s"),
            }
        )
    return rows


def uss_index(log) -> dict:
    """Worker USS growth over an epoch with a 1M-entry index (bench/uss_probe.py)."""
    import numpy as np

    from datasets.synthetic import encode_image, imagenet_like

    folder = Path(tempfile.mkdtemp(prefix="bench-uss-"))
    rng = np.random.default_rng(0)
    for label in range(2):
        (folder / f"c{label}").mkdir()
        for i in range(4):
            image = imagenet_like(label, rng)[:64, :64]
            (folder / f"c{label}" / f"{i}.png").write_bytes(encode_image(image, "png"))
    log("uss: 1M-entry index, numpy (ours) vs Python lists (control)")
    out = {}
    for kind in ("numpy", "list"):
        proc = subprocess.run(
            [sys.executable, "-m", "bench.uss_probe", str(folder), kind],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        last = proc.stdout.strip().splitlines()[-1:] or ["{}"]
        out[kind] = (
            __import__("json").loads(last[0])
            if proc.returncode == 0
            else {"error": proc.stderr[-500:]}
        )
    return out
