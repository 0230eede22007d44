"""The checks, each returning its JSON entry (docs/first_gpu_run.md: what each runs, when it is
ok). What a training run left comes from the ``_train`` helper (its stats' ``run``)."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from datasets.safe_files import write_atomic

from .commands import FINETUNE_INIT, LOADER_WORKERS
from .context import Context, RunResult, read_json, rounded, tail

WHEELHOUSE_HINT = (
    "bring them: `make gpu-wheelhouse PY=<the host's Python, e.g. 3.12>` on a machine with a "
    "package index, carry .cache/gpu-wheelhouse/py<PY>/ along, and pass --wheelhouse DIR"
)
BUILD_FACTS = "version compiled_with_cuda cuda cudnn cudnn_runtime device_name capability".split()
NO_RUN = {"device": None, "records": [], "summary": {}, "checkpoint": None, "resolved": ""}


def failed(result: RunResult, **fields) -> dict:
    log = {"log": str(result.log_path), "log_tail": tail(result.output)}
    return {"status": "error", "error": result.failure(), **log, **fields}


def verdict(result: dict, problems: list[str]) -> dict:
    """``status`` first, then what was measured, then ``error`` (the problems) if any."""
    error = {"error": "; ".join(problems)} if problems else {}
    return {"status": "error" if problems else "ok", **result, **error}


def ran(*runs: RunResult) -> dict:
    """What every training check reports: the first run's GPU sampler, peak memory, seconds."""
    peaks = [r.stats.get("peak_mem_mb") for r in runs]
    peaks = [v for v in peaks if isinstance(v, (int, float))]
    seconds = round(sum(r.elapsed_s for r in runs), 1)
    peak = round(max(peaks), 1) if peaks else None
    return {"nvml": runs[0].nvml, "peak_mem_mb": peak, "elapsed_s": seconds}


def wrong_device(ctx: Context, device: str | None) -> list[str]:
    if device is not None and device.startswith("cpu") != ctx.plan.gpu:
        return []
    return [f"ran on {device}, expected {ctx.plan.device}"]


def trained(ctx: Context, name: str, framework: str, env: dict | None = None):
    """Training run ``name`` of the plan, and what it left (NO_RUN's keys and more)."""
    run = ctx.train(name, framework, env)
    return run, {**NO_RUN, "device": run.stats.get("device"), **(run.stats.get("run") or {})}


def losses(facts: dict, steps: int) -> tuple[dict, list[str]]:
    """The losses and evaluation of a short run, and what is wrong with them."""
    values = [r["loss"] for r in facts["records"]]
    summary = facts["summary"]
    found = {"steps": summary.get("steps"), "losses": [rounded(x) for x in values]}
    found["loss_finite"] = bool(values) and all(math.isfinite(x) for x in values)
    found.update({k: rounded(v) for k, v in summary.items() if k.startswith("val_")})
    problems = [] if found["steps"] == steps else [f"ran {found['steps']} steps, expected {steps}"]
    if not found["loss_finite"]:
        problems.append(f"loss not finite: {found['losses']}")
    return found, problems


def install_wheelhouse(ctx: Context, python: str, wheelhouse: Path) -> dict:
    """The wheels into WORK/site (pip --no-index), first on the PYTHONPATH of its children."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"no *.whl in the wheelhouse {wheelhouse}: {WHEELHOUSE_HINT}")
    target = ctx.work / "site"
    cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--disable-pip-version-check", "--no-input", "--upgrade", "--target", str(target)]
    result = ctx.spawn("setup.wheelhouse", [*cmd, *map(str, wheels)], timeout_s=120)
    if not result.ok:
        raise RuntimeError(f"installing the wheelhouse failed: {result.failure()}")
    pythonpath = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    for framework in ctx.python:
        if ctx.python[framework] == python:
            ctx.env[framework]["PYTHONPATH"] = pythonpath
    found = {"dir": str(wheelhouse), "wheels": [w.name for w in wheels]}
    found["bytes"] = sum(w.stat().st_size for w in wheels)
    return {**found, "target": str(target), "elapsed_s": round(result.elapsed_s, 1)}


def probe(ctx: Context, name: str, framework: str) -> tuple[RunResult, dict]:
    args = ["_probe", "--framework", framework, "--device", ctx.plan.device]
    result = ctx.helper(name, framework, args, timeout_s=240)
    return result, result.stats


def setup_torch(ctx: Context) -> dict:
    """--python's torch probed on the device, and asked for the project's other imports."""
    if ctx.setup_error.get("torch"):  # the wheelhouse could not be installed
        return {"status": "error", "error": ctx.setup_error["torch"]}
    result, facts = probe(ctx, "setup.torch", "torch")
    ctx.toolchain = facts.get("toolchain") or {}
    if facts.get("missing_imports"):
        missing = ", ".join(facts["missing_imports"])
        error = f"{ctx.python['torch']} cannot import {missing}: {WHEELHOUSE_HINT}"
        return {**facts, "status": "error", "error": error}
    return _probed(ctx, "torch", result, facts)


def setup_paddle(ctx: Context) -> dict:
    """Skipped without a Paddle (GPU) build; an error for one that cannot run on this GPU."""
    result, facts = probe(ctx, "setup.paddle", "paddle")
    python, blocker = ctx.python["paddle"], facts.get("arch_problem") or {}
    if facts.get("import_error"):
        reason = f"no Paddle in {python} ({facts['import_error']}): the Paddle checks need a "
        reason += "Paddle GPU build; give its interpreter with --paddle-python (Paddle's GPU "
        reason += "wheels are too large to carry to a host without a package index)"
        return {"status": "skipped", "reason": reason}
    if ctx.plan.gpu and facts.get("compiled_with_cuda") is False:
        reason = f"{python} has Paddle's CPU build ({facts.get('version')}): no GPU to check"
        return {"status": "skipped", "reason": reason}
    if blocker.get("fatal"):
        facts.update(ok=False, error=f"{blocker['reason']}; fix: {blocker['fix']}")
    return _probed(ctx, "paddle", result, facts)


def _probed(ctx: Context, framework: str, result: RunResult, facts: dict) -> dict:
    """The probe's facts as the setup's entry: ok, or an error naming what failed."""
    info = {k: v for k, v in facts.items() if k not in ("ok", "error")}
    if not facts:
        return {"status": "error", "error": f"the probe gave no answer ({result.failure()})"}
    if not facts.get("ok"):
        return {**info, "status": "error", "error": facts.get("error") or "an op failed"}
    seconds = round(result.elapsed_s, 1)
    return {"status": "ok", **info, "elapsed_s": seconds, "python": ctx.python[framework]}


def check_configs(ctx: Context) -> dict:
    """Every training command of both plans, the GPU one included, through the config loader."""
    run = ctx.helper("configs", "torch", ["_configs", "--work", str(ctx.work)], timeout_s=120)
    if not run.ok or not run.stats:
        return failed(run)
    errors = run.stats.get("errors", {})
    result = {"validated": run.stats.get("validated"), "plans": ["gpu", "dry-run"]}
    if errors:
        return {"status": "error", **result, "errors": errors, "error": next(iter(errors.values()))}
    return {"status": "ok", **result, "elapsed_s": round(run.elapsed_s, 1)}


def check_data(ctx: Context) -> dict:
    """The synthetic data, written once per size (data/sizes.json): a later call reuses it."""
    sizes = {k: getattr(ctx.plan, k) for k in ("ocr_lines", "images_train", "images_val")}
    sizes["classes"] = ctx.plan.classes
    stamp = ctx.work / "data" / "sizes.json"
    if read_json(stamp) == sizes:
        return {"status": "ok", **sizes, "written": "reused"}
    args = ["_data", "--out", str(ctx.work / "data")]
    args += [f"--{key.replace('_', '-')}={value}" for key, value in sizes.items()]
    result = ctx.helper("data", "torch", args, timeout_s=300)
    if not result.ok or not result.stats:
        return {"status": "error", "error": result.failure(), "log": str(result.log_path)}
    write_atomic(stamp, json.dumps(sizes))
    seconds = round(result.elapsed_s, 1)
    return {"status": "ok", **result.stats, "written": "now", "elapsed_s": seconds}


def check_synthetic(ctx: Context) -> dict:
    plan = ctx.plan
    args = ["_synthetic", f"--classes={plan.classes}", f"--warmup={plan.warmup_steps}"]
    args += [f"--steps={plan.measure_steps}", *ctx.commands["throughput.synthetic"]]
    run = ctx.helper("throughput.synthetic", "torch", args, sample_gpu=True)
    if not run.ok or not run.stats.get("images_per_s"):
        return failed(run, nvml=run.nvml)
    result = {k: rounded(v, 1) for k, v in run.stats.items()}
    result.update(warmup_steps=plan.warmup_steps, measured_steps=run.stats.get("steps"))
    result.update(nvml=run.nvml, elapsed_s=round(run.elapsed_s, 1))
    return verdict(result, wrong_device(ctx, run.stats.get("device")))


def window_stats(records: list[dict], warmup_steps: int) -> dict:
    """samples/s and data-wait share over the logging windows after the warm-up, weighted by
    each window's wall time as the run's summary does; the steps measured, the epochs seen."""
    used = [r for r in records if r["step"] > warmup_steps]
    wall = wait = samples = 0.0
    previous = warmup_steps
    for record in used:
        steps, previous = max(1, record["step"] - previous), record["step"]
        wall += record["batch_cost_s"] * steps
        wait += record["reader_cost_s"] * steps
        samples += record["samples_per_s"] * record["batch_cost_s"] * steps
    return {
        "samples_per_s": samples / wall if wall else None,
        "data_wait_fraction": min(1.0, wait / wall) if wall else None,
        "windows": len(used),
        "measured_steps": (used[-1]["step"] - warmup_steps) if used else 0,
        "warmup_steps": warmup_steps,
        "epochs": sorted({r.get("epoch") for r in records if r.get("epoch") is not None}),
    }


def check_throughput(ctx: Context, name: str) -> dict:
    """A loader run: ResNet-50 with the prefetcher on or off, Paddle OCR with the ring on or off."""
    plan = ctx.plan
    if name.startswith("throughput.paddle"):
        framework, knob, value = "paddle", "batch_ring", name.endswith("_on")
        fields = {"batch_ring": value, "workers": plan.ocr_bench_workers}
        fields["batch"] = plan.ocr_bench_batch
    else:
        framework, knob, value = "torch", "device_prefetch", name != "prefetcher.off"
        fields = {"workers": LOADER_WORKERS, "batch": plan.bench_batch}
    run, facts = trained(ctx, name, framework)
    if not run.ok:
        return failed(run, nvml=run.nvml, **fields)
    stats = window_stats(facts["records"], plan.warmup_steps)
    found = {k: rounded(v, 1 if k.endswith("_per_s") else 4) for k, v in stats.items()}
    measured, said = stats["measured_steps"], f"{knob}: {'true' if value else 'false'}"
    problems = wrong_device(ctx, facts["device"])
    if not stats["samples_per_s"]:
        problems.append("no logging window to measure")
    elif measured < plan.measure_steps:
        problems.append(f"measured over {measured} steps, the plan says {plan.measure_steps}")
    if len(stats["epochs"]) > 1:
        problems.append(f"the run crossed an epoch end (epochs {stats['epochs']}): more data")
    if said not in facts["resolved"]:
        problems.append(f"loader.{knob} did not reach the run")
    return verdict({"device": facts["device"], **fields, **found, **ran(run)}, problems)


def step_compute_s(records: list[dict]) -> list[float]:
    """Each logged step's time without its wait for data: what compiling can change."""
    timed = [r for r in records if "batch_cost_s" in r]
    return [max(r["batch_cost_s"] - r.get("reader_cost_s", 0.0), 0.0) for r in timed]


def check_compile(ctx: Context, framework: str, task: str) -> dict:
    """train.compile off, then on; torch's is skipped without a compiler (setup.torch looked)."""
    plan = ctx.plan
    env = plan.compile_env.get(framework)  # the dry-run's torch leg, which compiles nothing
    extra = {"toolchain": ctx.toolchain} if framework == "torch" else {}
    missing = extra and ctx.toolchain.get("missing")
    if missing and not env:
        reason = f"torch.compile needs {' and '.join(missing)}: install them (Debian/Ubuntu: "
        reason += "apt-get install gcc g++ python3-dev, for the Python of --python), then run again"
        return {"status": "skipped", "reason": reason, **extra}
    legs: dict[str, dict] = {}
    problems: list[str] = []
    on = {"off": "false", "on": "true"}
    for leg in ("off", "on"):
        name = f"compile.{framework}.{task}.{leg}"
        run, facts = trained(ctx, name, framework, env if leg == "on" else None)
        if not run.ok:
            return failed(run, leg=leg, **extra)
        costs = step_compute_s(facts["records"])
        later = costs[plan.warmup_steps :]
        epochs = sorted({r.get("epoch") for r in facts["records"]})
        legs[leg] = {
            "first_step_s": rounded(costs[0]) if costs else None,
            "step_s": rounded(statistics.median(later)) if later else None,
            "measured_steps": len(later),
            "epochs": epochs,
            **ran(run),
        }
        if f"compile: {on[leg]}" not in facts["resolved"]:
            problems.append(f"train.compile={on[leg]} did not reach the run")
        if len(later) < plan.measure_steps:
            problems.append(
                f"{leg}: {len(later)} steps after the warm-up, not {plan.measure_steps}"
            )
        if len(epochs) > 1:
            problems.append(f"{leg}: the run crossed an epoch end")
    off, on = legs["off"], legs["on"]
    firsts = on["first_step_s"] is not None and off["first_step_s"] is not None
    compile_s = rounded(on["first_step_s"] - off["first_step_s"]) if firsts else None
    result = {"device": facts["device"], "engaged": not env, **extra, "off": off, "on": on}
    result["compile_s"] = compile_s
    steps = on["step_s"] and off["step_s"]
    result["step_off_over_on"] = rounded(off["step_s"] / on["step_s"], 3) if steps else None
    result.update(nvml=on["nvml"], peak_mem_mb=on["peak_mem_mb"])
    return verdict(result, problems + wrong_device(ctx, facts["device"]))


def check_amp(ctx: Context, framework: str, task: str, dtype: str) -> dict:
    """fp16's loss scale: metrics.jsonl's when its records carry it, else the ``_train``
    helper's. On the CPU the backends train in float32 and say so (``float32_warning``)."""
    plan, fp16 = ctx.plan, dtype == "fp16"
    env = {"GPU_CHECK_LOSS_SCALE": "1"} if fp16 else None
    run, facts = trained(ctx, f"amp.{framework}.{task}.{dtype}", framework, env)
    if not run.ok:
        return failed(run, loss_scale=None, nvml=run.nvml)
    found, problems = losses(facts, plan.amp_steps)
    problems = wrong_device(ctx, facts["device"]) + problems
    warned = bool(facts.get("float32_warning"))
    scale = run.stats.get("loss_scale")
    logged = [
        [r["step"], rounded(r["loss_scale"])]
        for r in facts["records"]
        if r.get("loss_scale") is not None
    ]
    scale = {"source": "metrics.jsonl", "by_step": logged} if logged else scale
    active = plan.gpu and not wrong_device(ctx, facts["device"]) and not warned
    result = {"device": facts["device"], "amp_active": active, "float32_warning": warned, **found}
    result.update(loss_scale=scale if fp16 else None, **ran(run))
    if plan.gpu and not active:
        problems.append("AMP was not active on the GPU")
    if plan.gpu and fp16 and result["loss_scale"] is None:
        problems.append("fp16 ran without an enabled loss scaler")
    return verdict(result, problems)


def check_smoke(ctx: Context, framework: str, task: str) -> dict:
    """Checkpoint, --resume, the loss falling; the same steps straight must end the same."""
    name, (first, total) = f"smoke.{framework}.{task}", ctx.plan.smoke_steps
    one, facts_one = trained(ctx, f"{name}.1", framework)
    if not one.ok:
        return failed(one, leg="first run", resume_loss=None, nvml=one.nvml)
    checkpoint_first = facts_one["checkpoint"]
    two, facts = trained(ctx, f"{name}.2", framework)
    if not two.ok:
        fields = {"checkpoint_first": checkpoint_first, "resume_loss": None, "nvml": one.nvml}
        return failed(two, leg="--resume", **fields)
    records = facts["records"]  # metrics.jsonl: the first leg's records, then the resumed leg's
    after = [r["step"] for r in records[len(facts_one["records"]) :]]
    values = [r["loss"] for r in records]
    third = max(1, len(values) // 3)  # the mean of the first and of the last third of them
    loss_first = sum(values[:third]) / third if values else None
    loss_last = sum(values[-third:]) / third if values else None
    summary, resumed = facts["summary"], facts.get("resumed_from_step")
    result = {"device": facts["device"], "steps": [first, total]}
    result.update(checkpoint_first=checkpoint_first, checkpoint_final=facts["checkpoint"])
    result.update(resumed_from_step=resumed, first_step_after_resume=after[0] if after else None)
    result.update(final_step=summary.get("steps"), loss_first=rounded(loss_first))
    result.update(loss_last=rounded(loss_last), loss_fell=bool(values) and loss_last < loss_first)
    result.update(samples_per_s=rounded(summary.get("samples_per_s"), 1))
    result.update(data_wait_fraction=rounded(summary.get("data_wait_fraction")))
    result.update({k: rounded(v) for k, v in summary.items() if k.startswith("val_")})
    result.update(ran(one, two))
    where = resumed if resumed is not None else after[:1]
    ended = result["final_step"]
    problems = wrong_device(ctx, facts["device"])
    if checkpoint_first != f"step-{first:08d}":
        problems.append(f"after the first run the latest checkpoint is {checkpoint_first}")
    if not after or after[0] <= first or resumed not in (None, first):
        problems.append(f"--resume did not continue from step {first} (from {where})")
    if facts["checkpoint"] != f"step-{total:08d}" or ended != total:
        problems.append(f"the resumed run ended at {ended}, expected {total}")
    if not result["loss_fell"]:
        problems.append(f"loss did not fall: {result['loss_first']} -> {result['loss_last']}")
    straight, facts_straight = trained(ctx, f"{name}.straight", framework)
    result["resume_loss"] = resume_loss(records, facts_straight["records"])
    if not straight.ok:
        problems.append(f"the straight run failed: {straight.failure()}")
    return verdict(result, problems)


def resume_loss(resumed: list[dict], straight: list[dict]) -> dict | None:
    """The final losses of the resumed and the straight run: bit-equal on the CPU; on a GPU
    nondeterministic kernels may move the last digits."""
    if not resumed or not straight or resumed[-1]["step"] != straight[-1]["step"]:
        return None
    a, b = resumed[-1]["loss"], straight[-1]["loss"]
    found = {"step": resumed[-1]["step"], "resumed": rounded(a, 6), "straight": rounded(b, 6)}
    found.update(
        abs_diff=rounded(abs(a - b), 6), rel_diff=rounded(abs(a - b) / max(abs(b), 1e-12), 6)
    )
    return {**found, "matches": abs(a - b) <= 1e-3 * max(abs(b), 1e-12)}


def check_finetune(ctx: Context) -> dict:
    """finetune_ppocrv4.yaml on the digit lines, then its paddle-inference export."""
    name, init_from = "finetune.paddle.ppocrv4", FINETUNE_INIT
    fields = {"init_from": init_from or "none (released weights not converted: from scratch)"}
    run, facts = trained(ctx, name, "paddle")
    if not run.ok:
        return failed(run, **fields, nvml=run.nvml)
    found, problems = losses(facts, ctx.plan.finetune_steps)
    out = ctx.work / "export" / "ppocrv4"
    cmd = [ctx.python["paddle"], "-m", "train.export", "--run", str(ctx.work / "runs" / name)]
    cmd += ["--format", "paddle-inference", "--out", str(out)]
    export = ctx.spawn(f"{name}.export", cmd, env=ctx.env["paddle"], timeout_s=240)
    written = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    result = {"device": facts["device"], **fields, **found, "export_ok": export.ok}
    result.update(export_files=written, export_s=round(export.elapsed_s, 1), **ran(run, export))
    problems = wrong_device(ctx, facts["device"]) + problems
    if not export.ok:
        problems.append(f"export failed: {export.failure()} (log {export.log_path})")
    elif not any(f.endswith(".pdmodel") for f in written):
        problems.append(f"the export wrote no .pdmodel: {written}")
    return verdict(result, problems)


def check_dist(ctx: Context) -> dict:
    """Two torchrun ranks over gloo on the one GPU (``_ranks``: outside python -m train, whose
    backend takes NCCL and one GPU per rank on CUDA)."""
    args = ["_ranks", f"--steps={ctx.plan.dist_steps}", f"--device={ctx.plan.device}"]
    run = ctx.helper("dist.torch.gloo2", "torch", args, timeout_s=180, sample_gpu=True, ranks=2)
    if not run.ok or not (facts := run.stats):
        return failed(run, nvml=run.nvml)
    result = {**{k: rounded(v, 6) for k, v in facts.items()}, "nvml": run.nvml}
    result["elapsed_s"] = round(run.elapsed_s, 1)
    diff, world = facts.get("param_max_diff"), facts.get("world_size")
    problems = wrong_device(ctx, facts.get("device"))
    if world != 2:
        problems.append(f"world size {world}, expected 2")
    if diff is None or diff > 0:
        problems.append(f"the ranks' parameters differ by {diff}")
    if not facts.get("loss_fell"):
        problems.append(f"loss did not fall: {facts.get('loss_first')} -> {facts.get('loss_last')}")
    return verdict(result, problems)
