"""The checks: configs (every command of both plans through the config loader) and data for
`setup`; for `run` the throughput runs (synthetic input, the loader at 8 workers, the torch
prefetcher off, train.compile off and on, the Paddle batch ring on and off), AMP steps, the smoke
trainings with checkpoint, --resume and a straight run, the PP-OCRv4 fine-tune and export, and
two gloo ranks on the one GPU. Each returns its JSON entry.
"""

from __future__ import annotations

import json
import math
import socket
import statistics
from pathlib import Path

from .commands import (
    all_train_commands,
    amp_args,
    bench_args,
    bench_overrides,
    compile_args,
    dist_args,
    finetune_args,
    ring_args,
    smoke_args,
)
from .context import MODULE, Context, RunResult
from .plan import DRY_PLAN, GPU_PLAN, LOADER_WORKERS, ROOT, Plan
from .runs import (
    CPU_AMP_WARNING,
    RESUMED,
    latest_checkpoint,
    on_expected_device,
    run_device,
    train_log,
    train_records,
    window_problems,
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
    """The synthetic data, written once per size: a later call with the same sizes (a second
    `setup`, or `run` after it) reuses it."""
    plan = ctx.plan
    sizes = {
        "ocr_lines": plan.ocr_lines,
        "images_train": plan.images_train,
        "images_val": plan.images_val,
        "classes": plan.classes,
    }
    stamp = ctx.work / "data" / "sizes.json"
    if read_json(stamp) == sizes:
        return {"status": "ok", **sizes, "written": "reused"}
    args = ["_data", "--out", str(ctx.work / "data")]
    for key, value in sizes.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    result = ctx.helper("data", "torch", args, timeout_s=300)
    if not result.ok or not result.stats:
        return {"status": "error", "error": result.failure(), "log": str(result.log_path)}
    stamp.write_text(json.dumps(sizes))
    return {
        "status": "ok",
        **result.stats,
        "written": "now",
        "elapsed_s": round(result.elapsed_s, 1),
    }


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


def _resolved(run_dir: Path) -> str:
    path = run_dir / "config.resolved.yaml"
    return path.read_text(encoding="utf-8") if path.is_file() else ""


# --- throughput ---------------------------------------------------------------------------------


def check_synthetic(ctx: Context) -> dict:
    """ResNet-50 steps through the torch backend on random device tensors: no loader at all,
    the GPU's ceiling for this step."""
    plan = ctx.plan
    args = [
        "_synthetic",
        "--config",
        "configs/resnet50/single_gpu.yaml",
        "--classes",
        str(plan.classes),
        "--warmup",
        str(plan.warmup_steps),
        "--steps",
        str(plan.measure_steps),
        *sets(*bench_overrides(plan, ctx.work)),
    ]
    run = ctx.helper("throughput.synthetic", "torch", args, stats=True, sample_gpu=True)
    if not run.ok or not run.stats.get("images_per_s"):
        return failed(run, nvml=run.nvml)
    device = run.stats.get("device")
    problems = [] if on_expected_device(plan, device) else [f"ran on {device}"]
    result = {
        **{k: rounded(v, 1) for k, v in run.stats.items()},
        "warmup_steps": plan.warmup_steps,
        "measured_steps": run.stats.get("steps"),
        "nvml": run.nvml,
        "elapsed_s": round(run.elapsed_s, 1),
    }
    return verdict(result, problems)


def _throughput(ctx: Context, name: str, framework: str, args: list[str], **fields) -> dict:
    """One throughput run: samples/s and the data-wait share over the measured windows (after
    the warm-up window, inside one epoch), the GPU sampler's figures, the problems."""
    run = ctx.train(name, framework, args)
    if not run.ok:
        return failed(run, nvml=run.nvml, **fields)
    run_dir = ctx.work / "runs" / name
    records = train_records(run_dir)
    device = run_device(train_log(run_dir)) or run.stats.get("device")
    stats = window_stats(records, ctx.plan.warmup_steps)
    result = {
        "device": device,
        **fields,
        **{
            k: rounded(v, 1 if k.endswith("_per_s") else 4) if isinstance(v, float) else v
            for k, v in stats.items()
        },
        "nvml": run.nvml,
        "peak_mem_mb": peak(run),
        "elapsed_s": round(run.elapsed_s, 1),
    }
    problems = window_problems(stats, ctx.plan.measure_steps)
    if not on_expected_device(ctx.plan, device):
        problems.append(f"ran on {device}, expected {ctx.plan.device}")
    return verdict(result, problems)


def _knob_reached(result: dict, run_dir: Path, said: str, knob: str) -> dict:
    """``result``, failed when the run's resolved config does not say ``said`` (the knob the
    check turns did not reach the run); a run that failed outright stays as it is."""
    if "log_tail" in result or said in _resolved(run_dir):
        return result
    problems = [*filter(None, [result.get("error")]), f"{knob} did not reach the run"]
    return verdict({k: v for k, v in result.items() if k not in ("status", "error")}, problems)


def check_loader(ctx: Context, no_prefetch: bool = False) -> dict:
    """single_gpu.yaml (ResNet-50, bf16, prefetch 4, persistent workers) fed by our loader at
    LOADER_WORKERS workers; ``no_prefetch``: with the torch side-stream prefetcher off."""
    name = "prefetcher.off" if no_prefetch else f"throughput.loader.w{LOADER_WORKERS}"
    args = bench_args(ctx.plan, ctx.work, name, prefetch=not no_prefetch)
    fields = {"workers": LOADER_WORKERS, "batch": ctx.plan.bench_batch}
    result = _throughput(ctx, name, "torch", args, **fields)
    said = f"device_prefetch: {'false' if no_prefetch else 'true'}"
    result = _knob_reached(result, ctx.work / "runs" / name, said, "loader.device_prefetch")
    result["prefetch_engaged"] = ctx.plan.gpu and not no_prefetch
    return result


def check_ring(ctx: Context, leg: str) -> dict:
    """The Paddle OCR run (single_gpu.yaml: CRNN, shared-memory workers) with loader.batch_ring
    on or off: what the ring buys over Paddle's own hand-over."""
    name = f"throughput.paddle.ocr.ring_{leg}"
    fields = {
        "batch_ring": leg == "on",
        "workers": ctx.plan.ocr_bench_workers,
        "batch": ctx.plan.ocr_bench_batch,
    }
    result = _throughput(ctx, name, "paddle", ring_args(ctx.plan, ctx.work, leg), **fields)
    said = f"batch_ring: {'true' if leg == 'on' else 'false'}"
    return _knob_reached(result, ctx.work / "runs" / name, said, "loader.batch_ring")


PREFETCH_NOTE = (
    "loader.device_prefetch: on CUDA, TorchBatches.device_batches copies and normalizes the next "
    "batch on a side stream while the step runs; 'off' is the same training run with "
    "loader.device_prefetch=false, a plain copy per batch on the compute stream. On the CPU "
    "the prefetcher never runs, so both runs take the same path there."
)


# --- train.compile ------------------------------------------------------------------------------


def toolchain(ctx: Context) -> dict:
    """What torch.compile needs on this host, asked of the torch interpreter: a C++ compiler
    (inductor's CPU kernels), a C compiler (Triton's CUDA launcher) and Python.h."""
    run = ctx.helper("compile.toolchain", "torch", ["_toolchain"], timeout_s=60)
    return run.stats or {"missing": [f"the toolchain probe failed: {run.failure()}"]}


def step_compute_s(records: list[dict]) -> list[float]:
    """Each logged step's time without its wait for data (``batch_cost_s - reader_cost_s``,
    every step logged): what compiling can change. A step's whole time would read the loader's
    rate wherever the loader is the limit, the same with or without compile."""
    return [
        max(r["batch_cost_s"] - r.get("reader_cost_s", 0.0), 0.0)
        for r in records
        if "batch_cost_s" in r
    ]


def check_compile(ctx: Context, framework: str, task: str) -> dict:
    """train.compile off, then on, the same run otherwise: the first step's time (which pays the
    compile when on), the median of the steps after the warm-up ones (their time without the
    wait for data: step_compute_s), and whether the compiled run's config said so. torch's leg
    first checks the compilers and Python's headers; without them it is skipped, with what to
    install."""
    plan = ctx.plan
    env = plan.compile_env.get(framework)
    extra: dict = {}
    if framework == "torch":
        found = toolchain(ctx)
        extra["toolchain"] = found
        if found.get("missing") and not env:  # env: the dry-run's leg, which compiles nothing
            return {
                "status": "skipped",
                "reason": "torch.compile needs "
                + " and ".join(found["missing"])
                + ": install them (Debian/Ubuntu: apt-get install gcc g++ python3-dev, for "
                "the Python of --python), then run again",
                **extra,
            }
    figures: dict[str, dict] = {}
    device = None
    problems = []
    for compiled in (False, True):
        leg = "on" if compiled else "off"
        name = f"compile.{framework}.{task}.{leg}"
        args = compile_args(plan, ctx.work, framework, task, compiled)
        run = ctx.train(name, framework, args, env=env if compiled else None)
        if not run.ok:
            return failed(run, leg=leg, **extra)
        run_dir = ctx.work / "runs" / name
        records = train_records(run_dir)
        costs = step_compute_s(records)
        later = costs[plan.warmup_steps :]
        device = run_device(train_log(run_dir)) or run.stats.get("device")
        figures[leg] = {
            "first_step_s": rounded(costs[0]) if costs else None,
            "step_s": rounded(statistics.median(later)) if later else None,
            "measured_steps": len(later),
            "epochs": sorted({r.get("epoch") for r in records}),
            "nvml": run.nvml,
            "peak_mem_mb": peak(run),
            "elapsed_s": round(run.elapsed_s, 1),
        }
        if f"compile: {'true' if compiled else 'false'}" not in _resolved(run_dir):
            problems.append(f"train.compile={compiled} did not reach the run")
        if len(later) < plan.measure_steps:
            problems.append(
                f"{leg}: {len(later)} steps after the warm-up, expected {plan.measure_steps}"
            )
        if len(figures[leg]["epochs"]) > 1:
            problems.append(f"{leg}: the run crossed an epoch end")
    off, on = figures["off"], figures["on"]
    result = {
        "device": device,
        "engaged": not env,  # False: the dry-run's torch leg, with TORCHDYNAMO_DISABLE
        **extra,
        "off": off,
        "on": on,
        "compile_s": rounded(on["first_step_s"] - off["first_step_s"])
        if on["first_step_s"] is not None and off["first_step_s"] is not None
        else None,
        "step_off_over_on": rounded(off["step_s"] / on["step_s"], 3)
        if on["step_s"] and off["step_s"]
        else None,
        "nvml": on["nvml"],
        "peak_mem_mb": on["peak_mem_mb"],
    }
    if not on_expected_device(plan, device):
        problems.append(f"ran on {device}, expected {plan.device}")
    return verdict(result, problems)


# --- AMP ----------------------------------------------------------------------------------------


def loss_scale_of(records: list[dict], stats: dict) -> dict | None:
    """The fp16 loss scale over the run: from the run's metrics.jsonl when its records carry
    ``loss_scale``, else what the ``_train`` helper saw after each GradScaler.update; None
    when no enabled scaler ran (bf16, the CPU)."""
    logged = [(r["step"], r["loss_scale"]) for r in records if r.get("loss_scale") is not None]
    if logged:
        return {"source": "metrics.jsonl", "by_step": [[s, rounded(v)] for s, v in logged]}
    return stats.get("loss_scale")


def check_amp(ctx: Context, framework: str, task: str, dtype: str) -> dict:
    """Steps (and an evaluation) with train.amp=fp16|bf16. On the CPU the backends train in
    float32 (and say so: ``float32_warning``), so the dry-run checks the run, not AMP."""
    plan = ctx.plan
    name = f"amp.{framework}.{task}.{dtype}"
    run_dir = ctx.work / "runs" / name
    steps = plan.amp_steps
    env = {"GPU_CHECK_LOSS_SCALE": "1"} if dtype == "fp16" else None
    run = ctx.train(name, framework, amp_args(plan, ctx.work, framework, task, dtype), env=env)
    if not run.ok:
        return failed(run, loss_scale=None, nvml=run.nvml)
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
        "loss_scale": loss_scale_of(records, run.stats) if dtype == "fp16" else None,
        **{k: rounded(v) for k, v in summary.items() if k.startswith("val_")},
        "nvml": run.nvml,
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
    if plan.gpu and dtype == "fp16" and result["loss_scale"] is None:
        problems.append("fp16 ran without an enabled loss scaler")
    return verdict(result, problems)


# --- smoke: checkpoint, --resume, and the same steps straight -----------------------------------


def check_smoke(ctx: Context, framework: str, task: str) -> dict:
    """The task's smoke config on the device: loss falls, checkpoints, --resume continues; then
    the same steps straight from scratch, whose final loss the resumed run's is compared with."""
    plan = ctx.plan
    name = f"smoke.{framework}.{task}"
    run_dir = ctx.work / "runs" / name
    one = ctx.train(f"{name}.1", framework, smoke_args(plan, ctx.work, framework, task, 1))
    if not one.ok:
        return failed(one, leg="first run", resume_loss=None, nvml=one.nvml)
    checkpoint_first = latest_checkpoint(run_dir)
    records_first = len(train_records(run_dir))
    two = ctx.train(f"{name}.2", framework, smoke_args(plan, ctx.work, framework, task, 2))
    if not two.ok:
        return failed(
            two, leg="--resume", checkpoint_first=checkpoint_first, resume_loss=None, nvml=one.nvml
        )
    result = _smoke_result(plan, run_dir, records_first, checkpoint_first, one, two)
    problems = _smoke_problems(plan, result)
    straight = ctx.train(
        f"{name}.straight", framework, smoke_args(plan, ctx.work, framework, task, 0)
    )
    result["resume_loss"] = _resume_loss(ctx.work / "runs" / f"{name}.straight", run_dir)
    if not straight.ok:
        problems.append(f"the straight run failed: {straight.failure()}")
    return verdict(result, problems)


def _resume_loss(straight_dir: Path, resumed_dir: Path) -> dict | None:
    """The final logged loss of the resumed run and of the straight one (same seed, same steps):
    equal up to the device's nondeterminism when the checkpoint carried everything."""
    resumed = train_records(resumed_dir)
    straight = train_records(straight_dir)
    if not resumed or not straight or resumed[-1]["step"] != straight[-1]["step"]:
        return None
    a, b = resumed[-1]["loss"], straight[-1]["loss"]
    return {
        "step": resumed[-1]["step"],
        "resumed": rounded(a, 6),
        "straight": rounded(b, 6),
        "abs_diff": rounded(abs(a - b), 6),
        "rel_diff": rounded(abs(a - b) / max(abs(b), 1e-12), 6),
        # Bit-equal on the CPU; on a GPU nondeterministic kernels may move the last digits.
        "matches": abs(a - b) <= 1e-3 * max(abs(b), 1e-12),
    }


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
        "nvml": one.nvml,
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


# --- PP-OCRv4 fine-tune and export ---------------------------------------------------------------

RELEASED_WEIGHTS = ROOT / ".cache" / "ppocrv4" / "ppocrv4_rec.pdparams"


def check_finetune(ctx: Context) -> dict:
    """finetune_ppocrv4.yaml (PP-OCRv4's recognizer, 48 x 320) for a few steps on the digit
    lines, then ``python -m train.export --format paddle-inference`` of its checkpoint. From the
    released weights when scripts/convert_weights.py has written them (the head re-initialized
    for the digit dictionary), else from scratch: the GPU path is the same."""
    plan = ctx.plan
    name = "finetune.paddle.ppocrv4"
    run_dir = ctx.work / "runs" / name
    init_from = str(RELEASED_WEIGHTS) if RELEASED_WEIGHTS.is_file() else None
    run = ctx.train(name, "paddle", finetune_args(plan, ctx.work, init_from))
    fields = {"init_from": init_from or "none (released weights not converted: from scratch)"}
    if not run.ok:
        return failed(run, **fields, nvml=run.nvml)
    records = train_records(run_dir)
    summary = read_json(run_dir / "summary.json")
    losses = [r["loss"] for r in records]
    device = run_device(train_log(run_dir)) or run.stats.get("device")
    out = ctx.work / "export" / "ppocrv4"
    export = ctx.spawn(
        f"{name}.export",
        [
            ctx.python["paddle"],
            "-m",
            "train.export",
            "--run",
            str(run_dir),
            "--format",
            "paddle-inference",
            "--out",
            str(out),
        ],
        env=ctx.env["paddle"],
        timeout_s=240,
    )
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    result = {
        "device": device,
        **fields,
        "steps": summary.get("steps"),
        "losses": [rounded(x) for x in losses],
        "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
        **{k: rounded(v) for k, v in summary.items() if k.startswith("val_")},
        "export_ok": export.ok,
        "export_files": files,
        "export_s": round(export.elapsed_s, 1),
        "nvml": run.nvml,
        "peak_mem_mb": peak(run),
        "elapsed_s": round(run.elapsed_s + export.elapsed_s, 1),
    }
    problems = []
    if not on_expected_device(plan, device):
        problems.append(f"trained on {device}, expected {plan.device}")
    if summary.get("steps") != plan.finetune_steps:
        problems.append(f"ran {summary.get('steps')} steps, expected {plan.finetune_steps}")
    if not result["loss_finite"]:
        problems.append(f"loss not finite: {result['losses']}")
    if not export.ok:
        problems.append(f"export failed: {export.failure()} (log {export.log_path})")
    elif not any(f.endswith(".pdmodel") for f in files):
        problems.append(f"the export wrote no .pdmodel: {files}")
    return verdict(result, problems)


# --- two gloo ranks on the one GPU ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_dist(ctx: Context) -> dict:
    """Two torchrun ranks on the one GPU over gloo: DistributedDataParallel with BatchNorm and
    Adam on CUDA tensors, each rank on different batches; they must end with equal parameters.
    The project's backend takes NCCL and one GPU per rank on CUDA, so two ranks cannot share
    this GPU through ``python -m train``; this runs the same collectives (gradient all-reduce,
    buffer broadcast) over gloo on the device."""
    plan = ctx.plan
    name = "dist.torch.gloo2"
    stats = ctx.work / "stats" / f"{name}.json"
    stats.unlink(missing_ok=True)
    cmd = [
        ctx.python["torch"],
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",  # torchrun: the script is a module, run from the repository root
        MODULE,
        "_ranks",
        "--stats",
        str(stats),
        *dist_args(plan),
    ]
    run = ctx.spawn(name, cmd, env=ctx.env["torch"], timeout_s=180, sample_gpu=True)
    facts = read_json(stats)
    if not run.ok or not facts:
        return failed(run, nvml=run.nvml)
    result = {**{k: rounded(v, 6) for k, v in facts.items()}, "nvml": run.nvml}
    result["elapsed_s"] = round(run.elapsed_s, 1)
    problems = []
    if not on_expected_device(plan, facts.get("device")):
        problems.append(f"ran on {facts.get('device')}, expected {plan.device}")
    if facts.get("world_size") != 2:
        problems.append(f"world size {facts.get('world_size')}, expected 2")
    if facts.get("param_max_diff") is None or facts["param_max_diff"] > 0:
        problems.append(f"the ranks' parameters differ by {facts.get('param_max_diff')}")
    if not facts.get("loss_fell"):
        problems.append(f"loss did not fall: {facts.get('loss_first')} -> {facts.get('loss_last')}")
    return verdict(result, problems)
