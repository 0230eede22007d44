#!/usr/bin/env python
r"""Input-pipeline benchmark: ours against torchvision's recipe, a full-decode ceiling and
PaddleOCR's LMDBDataSet; loader knobs, cold start, IPC bytes, data stall.

  .venv-torch/bin/python -m scripts.bench_loader --preset quick \
      --out bench/results/quick-torch.json
  .venv-paddle/bin/python -m scripts.bench_loader --preset quick \
      --out bench/results/quick-paddle.json
  .venv-torch/bin/python -m scripts.bench_loader --merge bench/results/quick-torch.json \
      bench/results/quick-paddle.json --out bench/results/quick.json

Each venv runs the parts its framework can (torch: ResNet-50 pipelines and the torch loader;
paddle: OCR pipelines and the paddle loader); --merge joins them and writes the Markdown table
and PNG plots next to the JSON. Datasets are generated once under bench/data/ and reused.
Every comparison is interleaved (A B C, C B A, ...) in one run and reported as medians.
Keys are documented in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from scripts import _cli

PRESETS = {
    "tiny": {  # schema check for tests/test_bench.py: seconds, not a measurement
        "images": 16,
        "ocr_lines": 64,
        "workers": [0, 1],
        "reps": 1,
        "resnet": {"batch_size": 4, "batches": 3, "warmup": 1},
        "ocr": {"batch_size": 8, "batches": 3, "warmup": 1},
        "stall_step_s": 0.02,
        "stall_batches": 4,
        "parts": ["compare", "stall"],
    },
    "quick": {  # make bench-quick: < 3 minutes on 2 cores, data generation included
        "images": 256,
        "ocr_lines": 768,
        "workers": [0, 1, 2],
        "reps": 4,
        "resnet": {"batch_size": 32, "batches": 20, "warmup": 4},
        "ocr": {"batch_size": 64, "batches": 64, "warmup": 8},
        "stall_step_s": 0.1,
        "stall_batches": 8,
        "parts": ["compare", "stall"],
    },
    "full": {  # make bench
        "images": 1024,
        "ocr_lines": 4096,
        "workers": [0, 1, 2],
        "reps": 5,
        "resnet": {"batch_size": 32, "batches": 40, "warmup": 5},
        "ocr": {"batch_size": 128, "batches": 48, "warmup": 6},
        "stall_step_s": 0.1,
        "stall_batches": 20,
        "stall_reps": 3,
        "recaug": True,
        "knob_prefetch": [2, 4],
        "knob_reps": 2,
        "parts": ["compare", "stall", "knobs", "cold", "uss"],
    },
}


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        platform.processor(),
    )
    from bench.runner import package_versions

    versions = package_versions()

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
    }


def detect_framework() -> str:
    for name in ("torch", "paddle"):
        if importlib.util.find_spec(name):
            return name
    raise SystemExit(
        "neither torch nor paddle is importable: run under .venv-torch or .venv-paddle"
    )


def run_parts(preset: dict, framework: str, log) -> dict:
    from bench import parts
    from bench.data import image_data, ocr_data
    from bench.runner import Runner

    runner = Runner()
    results: dict = {}
    try:
        if framework == "torch":
            data = {"image": image_data(preset["images"])}
            results["resnet50"] = parts.resnet_compare(runner, preset, data, log)
        else:
            data = {"ocr": {**ocr_data(preset["ocr_lines"]), "num": preset["ocr_lines"]}}
            results["ocr"] = parts.ocr_compare(runner, preset, data, log)
            data["ocr_lmdb"] = results["ocr"]["settings"]["lmdb"]
        results["ipc"] = parts.ipc_bytes(results)
        task = "resnet50" if framework == "torch" else "ocr"
        if "stall" in preset["parts"]:
            speeds = results[task]["ours"]["samples_per_s"]
            stall = parts.stall(runner, preset, data, framework, speeds, log)
            results["stall"] = {framework: stall}
        if "knobs" in preset["parts"]:
            results["knobs"] = {framework: parts.knob_matrix(runner, preset, data, framework, log)}
        if "cold" in preset["parts"]:
            results["cold_start"] = {
                framework: parts.cold_start(runner, preset, data, framework, log)
            }
        if "uss" in preset["parts"] and framework == "torch":
            results["uss_index"] = parts.uss_index(log)
    finally:
        runner.close()
    return results


def deep_merge(into: dict, other: dict) -> dict:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = value
    return into


def write_outputs(results: dict, out: Path) -> None:
    from bench.report import markdown, plots

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=False))
    tmp.replace(out)
    out.with_suffix(".md").write_text(markdown(results))
    try:
        results_plots = plots(results, out.with_suffix(""))
    except ImportError:  # matplotlib missing: the JSON and table still stand
        results_plots = []
    print(f"wrote {out}, {out.with_suffix('.md')}" + "".join(f", {p}" for p in results_plots))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--framework", choices=("auto", "torch", "paddle"), default="auto")
    parser.add_argument("--workers", help="comma-separated worker counts, e.g. 0,1,2,4,8,16")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default: preset)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge per-venv results")
    parser.add_argument(
        "--out", type=Path, help="results JSON (default bench/results/PRESET-FW.json)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    if args.merge:
        merged: dict = {"machines": {}}
        for path in args.merge:
            part = json.loads(Path(path).read_text())
            merged["machines"][part["framework"]] = part.pop("machine")
            merged["commands"] = merged.get("commands", []) + part.pop("commands")
            deep_merge(merged, part)
        out = args.out or Path("bench/results/merged.json")
        merged.update(framework="merged", name=out.stem)
        write_outputs(merged, out)
        return 0
    framework = detect_framework() if args.framework == "auto" else args.framework
    preset = dict(PRESETS[args.preset])
    if args.workers:
        preset["workers"] = [int(w) for w in args.workers.split(",")]
    if args.reps:
        preset["reps"] = args.reps
    out = args.out or Path(f"bench/results/{args.preset}-{framework}.json")
    results = {
        "schema_version": 1,
        "name": out.stem,
        "preset": args.preset,
        "framework": framework,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "commands": [" ".join([Path(sys.executable).name, *sys.argv])],
    }

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    results.update(run_parts(preset, framework, log))
    results["wall_s"] = round(time.perf_counter() - started, 1)
    write_outputs(results, out)
    return 0


if __name__ == "__main__":
    _cli.run(main)
