"""The checks after set-up: configs (every command of both plans through the config loader), data,
the smoke trainings with checkpoint and --resume, AMP steps, and the throughput runs (synthetic
input, the loader at 1/2/4/8 workers, the torch prefetcher off). Each returns its JSON entry.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .commands import (
    all_train_commands,
    amp_args,
    bench_args,
    bench_overrides,
    compile_args,
    smoke_args,
)
from .context import Context, RunResult
from .plan import DRY_PLAN, GPU_PLAN, Plan
from .runs import (
    CPU_AMP_WARNING,
    RESUMED,
    latest_checkpoint,
    on_expected_device,
    run_device,
    train_log,
    train_records,
    window_stats,
)
from .util import read_json, rounded, sets, tail


def check_configs(ctx: Context) -> dict:
    """Every training command of BOTH plans, the GPU one included, through the project's own
    config loader: a GPU-plan command that no longer fits the configs fails here, in the
    dry-run that make test runs, not first on the GPU."""
    commands = {
        f"{label}:{name}": args
        for label, plan in (("gpu", GPU_PLAN), ("dry-run", DRY_PLAN))
        for name, args in all_train_commands(plan, ctx.work).items()
    }
    path = ctx.work / "stats" / "configs.commands.json"
    path.write_text(json.dumps(commands))
    run = ctx.helper("configs", "torch", ["_configs", "--commands", str(path)], timeout_s=120)
    if not run.ok or not run.stats:
        return failed(run)
    errors = run.stats.get("errors", {})
    result = {"validated": run.stats.get("validated"), "plans": ["gpu", "dry-run"]}
    if errors:
        return {"status": "error", **result, "errors": errors, "error": next(iter(errors.values()))}
    return {"status": "ok", **result, "elapsed_s": round(run.elapsed_s, 1)}


def check_data(ctx: Context) -> dict:
    plan = ctx.plan
    args = [
        "_data",
        "--out",
        str(ctx.work / "data"),
        "--ocr-lines",
        str(plan.ocr_lines),
        "--images-train",
        str(plan.images_train),
        "--images-val",
        str(plan.images_val),
        "--classes",
        str(plan.classes),
    ]
    result = ctx.helper("data", "torch", args, timeout_s=300)
    if not result.ok or not result.stats:
        return {"status": "error", "error": result.failure(), "log": str(result.log_path)}
    return {"status": "ok", **result.stats, "elapsed_s": round(result.elapsed_s, 1)}


def peak(*results: RunResult) -> float | None:
    values = [r.stats.get("peak_mem_mb") for r in results]
    values = [v for v in values if isinstance(v, (int, float))]
    return round(max(values), 1) if values else None


def failed(result: RunResult, **fields) -> dict:
    return {
        "status": "error",
        "error": result.failure(),
        "log": str(result.log_path),
        "log_tail": tail(result.output),
        **fields,
    }


def verdict(result: dict, problems: list[str]) -> dict:
    """A check's entry: ``status`` first, then what it measured, then ``error`` (the problems)
    when there are any."""
    return {
        "status": "error" if problems else "ok",
        **result,
        **({"error": "; ".join(problems)} if problems else {}),
    }


def check_smoke(ctx: Context, framework: str, task: str) -> dict:
    """The task's smoke config on the device: loss falls, checkpoints, --resume continues."""
    plan = ctx.plan
    name = f"smoke.{framework}.{task}"
    run_dir = ctx.work / "runs" / name
    one = ctx.train(f"{name}.1", framework, smoke_args(plan, ctx.work, framework, task, 1))
    if not one.ok:
        return failed(one, leg="first run")
    checkpoint_first = latest_checkpoint(run_dir)
    records_first = len(train_records(run_dir))
    two = ctx.train(f"{name}.2", framework, smoke_args(plan, ctx.work, framework, task, 2))
    if not two.ok:
        return failed(two, leg="--resume", checkpoint_first=checkpoint_first)
    result = _smoke_result(plan, run_dir, records_first, checkpoint_first, one, two)
    return verdict(result, _smoke_problems(plan, result))


def _smoke_result(
    plan: Plan,
    run_dir: Path,
    records_first: int,
    checkpoint_first: str | None,
    one: RunResult,
    two: RunResult,
) -> dict:
    """What the two legs left in the run directory: checkpoints, where the resumed leg started,
    the loss over both legs, the final summary."""
    records = train_records(run_dir)  # metrics.jsonl: the first run's records, then the resumed
    resumed_records = records[records_first:]
    log = train_log(run_dir)
    resumed = RESUMED.findall(log)  # train.log's "resumed from ..." line, when it says so
    after = [r["step"] for r in resumed_records]
    summary = read_json(run_dir / "summary.json")
    losses = [r["loss"] for r in records]
    third = max(1, len(losses) // 3)  # mean of the first and the last third of the windows
    loss_first = sum(losses[:third]) / third if losses else None
    loss_last = sum(losses[-third:]) / third if losses else None
    return {
        "device": run_device(log) or two.stats.get("device"),
        "steps": list(plan.smoke_steps),
        "checkpoint_first": checkpoint_first,
        "checkpoint_final": latest_checkpoint(run_dir),
        "resumed_from_step": int(resumed[-1][2]) if resumed else None,
        "first_step_after_resume": after[0] if after else None,
        "final_step": summary.get("steps"),
        "loss_first": rounded(loss_first),
        "loss_last": rounded(loss_last),
        "loss_fell": bool(losses) and loss_last < loss_first,
        "samples_per_s": rounded(summary.get("samples_per_s"), 1),
        "data_wait_fraction": rounded(summary.get("data_wait_fraction")),
        **{k: rounded(v) for k, v in summary.items() if k.startswith("val_")},
        "peak_mem_mb": peak(one, two),
        "elapsed_s": round(one.elapsed_s + two.elapsed_s, 1),
    }


def _smoke_problems(plan: Plan, result: dict) -> list[str]:
    first, total = plan.smoke_steps
    device, checkpoint_first = result["device"], result["checkpoint_first"]
    resumed_step, after = result["resumed_from_step"], result["first_step_after_resume"]
    problems = []
    if not on_expected_device(plan, device):
        problems.append(f"trained on {device}, expected {plan.device}")
    if checkpoint_first != f"step-{first:08d}":
        problems.append(f"after the first run the latest checkpoint is {checkpoint_first}")
    if after is None or after <= first or (resumed_step is not None and resumed_step != first):
        started = resumed_step if resumed_step is not None else [] if after is None else [after]
        problems.append(f"--resume did not continue from step {first} (from {started})")
    if result["checkpoint_final"] != f"step-{total:08d}" or result["final_step"] != total:
        problems.append(f"the resumed run ended at {result['final_step']}, expected {total}")
    if not result["loss_fell"]:
        problems.append(f"loss did not fall: {result['loss_first']} -> {result['loss_last']}")
    return problems


def check_amp(ctx: Context, framework: str, task: str, dtype: str) -> dict:
    """A few steps (and an evaluation) with train.amp=fp16|bf16. On the CPU the backends train in
    float32 (and say so: ``float32_warning``), so the dry-run checks the run, not AMP."""
    plan = ctx.plan
    name = f"amp.{framework}.{task}.{dtype}"
    run_dir = ctx.work / "runs" / name
    steps = plan.amp_steps
    run = ctx.train(name, framework, amp_args(plan, ctx.work, framework, task, dtype))
    if not run.ok:
        return failed(run)
    log = train_log(run_dir)
    records = train_records(run_dir)
    summary = read_json(run_dir / "summary.json")
    losses = [r["loss"] for r in records]
    device = run_device(log) or run.stats.get("device")
    amp_active = on_expected_device(plan, device) and plan.gpu and CPU_AMP_WARNING not in log
    result = {
        "device": device,
        "amp_active": amp_active,
        "float32_warning": CPU_AMP_WARNING in log,
        "steps": summary.get("steps"),
        "losses": [rounded(x) for x in losses],
        "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
        **{k: rounded(v) for k, v in summary.items() if k.startswith("val_")},
        "peak_mem_mb": peak(run),
        "elapsed_s": round(run.elapsed_s, 1),
    }
    problems = []
    if not on_expected_device(plan, device):
        problems.append(f"trained on {device}, expected {plan.device}")
    if summary.get("steps") != steps:
        problems.append(f"ran {summary.get('steps')} steps, expected {steps}")
    if not result["loss_finite"]:
        problems.append(f"loss not finite: {result['losses']}")
    if plan.gpu and not amp_active:
        problems.append("AMP was not active on the GPU")
    return verdict(result, problems)


def check_loader(ctx: Context, workers: int, no_prefetch: bool = False) -> dict:
    """single_gpu.yaml (ResNet-50, bf16, prefetch 4, persistent workers) fed by our loader."""
    name = "prefetcher.off" if no_prefetch else f"throughput.loader.w{workers}"
    run_dir = ctx.work / "runs" / name
    args = bench_args(ctx.plan, ctx.work, name, workers, prefetch=not no_prefetch)
    run = ctx.train(name, "torch", args)
    if not run.ok:
        return failed(run, workers=workers)
    records = train_records(run_dir)
    device = run_device(train_log(run_dir)) or run.stats.get("device")
    stats = window_stats(records)
    result = {
        "device": device,
        "workers": workers,
        "batch": ctx.plan.bench_batch,
        "steps": records[-1]["step"] if records else None,
        **{k: rounded(v, 1 if k.endswith("_per_s") else 4) for k, v in stats.items()},
        "peak_mem_mb": peak(run),
        "elapsed_s": round(run.elapsed_s, 1),
    }
    problems = []
    if not on_expected_device(ctx.plan, device):
        problems.append(f"ran on {device}, expected {ctx.plan.device}")
    if not stats["samples_per_s"]:
        problems.append("no logging window to measure")
    resolved = run_dir / "config.resolved.yaml"
    said = resolved.read_text(encoding="utf-8") if resolved.is_file() else ""
    if f"device_prefetch: {'false' if no_prefetch else 'true'}" not in said:
        problems.append(f"loader.device_prefetch did not reach the run ({resolved})")
    return verdict(result, problems)


def check_synthetic(ctx: Context) -> dict:
    """ResNet-50 steps through the torch backend on random device tensors: no loader at all."""
    plan = ctx.plan
    warmup, steps = plan.synthetic_steps
    overrides = bench_overrides(plan, ctx.work)
    args = [
        "_synthetic",
        "--config",
        "configs/resnet50/single_gpu.yaml",
        "--classes",
        str(plan.classes),
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
        *sets(*overrides),
    ]
    run = ctx.helper("throughput.synthetic", "torch", args, stats=True)
    if not run.ok or not run.stats.get("images_per_s"):
        return failed(run)
    device = run.stats.get("device")
    problems = [] if on_expected_device(plan, device) else [f"ran on {device}"]
    result = {
        **{k: rounded(v, 1) for k, v in run.stats.items()},
        "elapsed_s": round(run.elapsed_s, 1),
    }
    return verdict(result, problems)


PREFETCH_NOTE = (
    "loader.device_prefetch: on CUDA, TorchBackend.device_batches copies and normalizes the next "
    "batch on a side stream while the step runs (_cuda_prefetch); 'off' is the same training run "
    "with loader.device_prefetch=false, a plain copy per batch on the compute stream. On the CPU "
    "the prefetcher never runs, so both runs take the same path there."
)


def check_compile(ctx: Context, framework: str, task: str) -> dict:
    """train.compile off, then on, the same run otherwise: the first step's time (which pays the
    compile when on), the median of the later steps' (``batch_cost_s``, every step logged), and
    whether the compiled run's config said so."""
    plan = ctx.plan
    env = plan.compile_env.get(framework)
    figures: dict[str, dict] = {}
    device = None
    problems = []
    for compiled in (False, True):
        leg = "on" if compiled else "off"
        name = f"compile.{framework}.{task}.{leg}"
        args = compile_args(plan, ctx.work, framework, task, compiled)
        run = ctx.train(name, framework, args, env=env if compiled else None)
        if not run.ok:
            return failed(run, leg=leg)
        run_dir = ctx.work / "runs" / name
        costs = [r["batch_cost_s"] for r in train_records(run_dir) if "batch_cost_s" in r]
        device = run_device(train_log(run_dir)) or run.stats.get("device")
        figures[leg] = {
            "first_step_s": rounded(costs[0]) if costs else None,
            "step_s": rounded(statistics.median(costs[1:])) if len(costs) > 1 else None,
            "steps": len(costs),
            "peak_mem_mb": peak(run),
            "elapsed_s": round(run.elapsed_s, 1),
        }
        resolved = run_dir / "config.resolved.yaml"
        said = resolved.read_text(encoding="utf-8") if resolved.is_file() else ""
        if f"compile: {'true' if compiled else 'false'}" not in said:
            problems.append(f"train.compile={compiled} did not reach the run ({resolved})")
        if len(costs) < 2:
            problems.append(f"{leg}: fewer than 2 steps logged")
    off, on = figures["off"], figures["on"]
    result = {
        "device": device,
        "engaged": not env,  # False: the dry-run's torch leg, with TORCHDYNAMO_DISABLE
        "off": off,
        "on": on,
        "compile_s": rounded(on["first_step_s"] - off["first_step_s"])
        if on["first_step_s"] is not None and off["first_step_s"] is not None
        else None,
        "step_off_over_on": rounded(off["step_s"] / on["step_s"], 3)
        if on["step_s"] and off["step_s"]
        else None,
        "peak_mem_mb": on["peak_mem_mb"],
    }
    if not on_expected_device(plan, device):
        problems.append(f"ran on {device}, expected {plan.device}")
    return verdict(result, problems)
