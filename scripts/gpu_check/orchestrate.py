"""The order of the checks. ``setup``: both venvs (installed, probed on the device), every
command line through the config loader, the data; what it found is kept in a state file that
``run`` reads. ``run``: the timed checks one at a time, most important first (synthetic ceiling,
the loader at 8 workers, the prefetcher off, train.compile, the Paddle batch ring), then the
correctness runs several at once (AMP, smoke with resume, PP-OCRv4 fine-tune and export, two
gloo ranks). ``run_check`` turns whatever a check raises into its JSON entry and has the report
written after every check; a check whose prerequisite failed is marked an error.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import fnmatch
import json
import threading
import traceback
from pathlib import Path

from .checks import (
    check_amp,
    check_compile,
    check_configs,
    check_data,
    check_dist,
    check_finetune,
    check_loader,
    check_ring,
    check_smoke,
    check_synthetic,
)
from .context import Context, OutOfTime
from .plan import (
    AMP_DTYPES,
    COMPILE_RUNS,
    FRAMEWORKS,
    RING_LEGS,
    SETUP_CHECKS,
    TASKS,
    check_names,
    run_checks,
)
from .report import host_facts
from .setup import CACHE, SetupError, setup_paddle, setup_torch
from .util import say, tail

_lock = threading.Lock()


def run_check(report: dict, ctx: Context, name: str, func, *args) -> dict:
    """Run one check; whatever it raises becomes its error, and past the budget it is skipped.
    The report is written after it, whatever happened."""
    say(f"{name}: start")
    try:
        result = func(ctx, *args)
    except OutOfTime as error:
        result = {"status": "skipped", "reason": str(error)}
    except Exception as error:  # a check's failure must not stop the others
        result = {
            "status": "error",
            "error": f"{type(error).__name__}: {error}",
            "traceback": tail(traceback.format_exc(), 8),
        }
    with _lock:
        report["checks"][name] = result
    say(
        f"{name}: {result['status']}"
        + (f" ({result.get('error') or result.get('reason')})" if result["status"] != "ok" else "")
    )
    ctx.publish()
    return result


def blocked(report: dict, names: list[str], reason: str) -> None:
    for name in names:
        if report["checks"].get(name, {}).get("status") in (None, "skipped"):
            report["checks"][name] = {"status": "error", "error": reason}


def needs(name: str) -> str:
    """The framework venv a check needs: paddle or torch (configs and data run in torch's)."""
    return "paddle" if ".paddle." in name else "torch"


# --- setup --------------------------------------------------------------------------------------


def state_path(ctx: Context) -> Path:
    """Where setup leaves what it found: beside the venvs (GPU), in the work folder (dry-run)."""
    return (CACHE if ctx.plan.gpu else ctx.work) / "setup.json"


def _venv_stamp(python: str | None) -> str | None:
    """The install stamp of the venv ``python`` belongs to (ensure_installed writes it)."""
    if python is None:
        return None
    stamp = Path(python).parent.parent / ".gpu-check-installed"
    return stamp.read_text().strip() if stamp.is_file() else "no stamp"


def _reusable(ctx: Context, state: dict) -> bool:
    """Whether an earlier setup's state still holds: the same mode and work folder, every
    setup check ok, the venvs' pythons there with the same install stamps."""
    if state.get("mode") != ("gpu" if ctx.plan.gpu else "dry-run"):
        return False
    if state.get("work_dir") != str(ctx.work):
        return False
    if any(state.get("checks", {}).get(n, {}).get("status") != "ok" for n in SETUP_CHECKS):
        return False
    for framework in FRAMEWORKS:
        python = state.get("python", {}).get(framework)
        if not python or not Path(python).exists():
            return False
        if state.get("stamps", {}).get(framework) != _venv_stamp(python):
            return False
    return (ctx.work / "data" / "sizes.json").is_file()


def _restore(report: dict, ctx: Context, state: dict) -> None:
    for key in ("host", "torch_build", "paddle_build"):
        report[key] = state[key]
    for name in SETUP_CHECKS:
        report["checks"][name] = state["checks"][name]
    ctx.python.update(state["python"])
    ctx.env.update(state["env"])
    ctx.setup_error.update(state.get("setup_error", {}))


def orchestrate_setup(report: dict, ctx: Context) -> None:
    """Install and probe both venvs (at once: the downloads overlap), then configs and the data
    in the torch venv. A second call finds the state file and returns in seconds."""
    path = state_path(ctx)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    if state and _reusable(ctx, state):
        _restore(report, ctx, state)
        report["setup_reused"] = str(path)
        say(f"setup: everything in place ({path}); nothing to do")
        return
    report["host"] = host_facts(ctx.plan)
    capability = report["host"].get("compute_capability")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    try:
        torch_side = pool.submit(_torch_side, report, ctx)
        paddle_side = pool.submit(run_setup_paddle, report, ctx, capability)
        torch_side.result()
        paddle_side.result()
    except BaseException:
        ctx.stop()
        raise
    finally:
        pool.shutdown(wait=True)
    state = {
        "mode": report["mode"],
        "work_dir": str(ctx.work),
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **{key: report[key] for key in ("host", "torch_build", "paddle_build")},
        "checks": {name: report["checks"][name] for name in SETUP_CHECKS},
        "python": ctx.python,
        "env": ctx.env,
        "setup_error": ctx.setup_error,
        "stamps": {fw: _venv_stamp(ctx.python[fw]) for fw in FRAMEWORKS},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2, default=str))
    report["setup_state"] = str(path)


def _torch_side(report: dict, ctx: Context) -> None:
    """setup.torch, then (it needs the torch venv) configs and data."""
    run_setup_torch(report, ctx)
    if ctx.python["torch"] is None:
        reason = f"setup.torch failed: {ctx.setup_error['torch']}"
        blocked(report, ["configs", "data"], reason)
        return
    run_check(report, ctx, "configs", check_configs)
    run_check(report, ctx, "data", check_data)


def run_setup_torch(report: dict, ctx: Context) -> None:
    """setup.torch, and torch_build from it; on failure no torch check can run."""
    try:
        torch_result = setup_torch(ctx)
    except OutOfTime as error:
        torch_result = {"status": "skipped", "reason": str(error)}
    except SetupError as error:
        torch_result = {**error.info, "status": "error", "error": str(error)}
    except Exception as error:
        torch_result = {"status": "error", "error": str(error)}
    report["checks"]["setup.torch"] = torch_result
    report["torch_build"] = {
        k: torch_result.get(k)
        for k in ("version", "cuda", "cudnn_runtime", "device_name", "capability", "venv")
    }
    say(f"setup.torch: {torch_result['status']} {torch_result.get('error', '')}")
    if torch_result["status"] != "ok":
        ctx.python["torch"] = None
        ctx.setup_error["torch"] = torch_result.get("error") or torch_result.get("reason", "")
    ctx.publish()


def run_setup_paddle(report: dict, ctx: Context, capability: str | None) -> None:
    """setup.paddle (its attempts go into paddle_build); on failure no Paddle check can run."""
    try:
        paddle_result = setup_paddle(ctx, report["paddle_build"], capability)
    except OutOfTime as error:
        paddle_result = {"status": "skipped", "reason": str(error)}
    except Exception as error:
        paddle_result = {"status": "error", "error": str(error)}
    report["checks"]["setup.paddle"] = paddle_result
    say(f"setup.paddle: {paddle_result['status']} {paddle_result.get('error', '')}")
    if paddle_result["status"] != "ok":
        ctx.python["paddle"] = None
        ctx.setup_error["paddle"] = paddle_result.get("error") or paddle_result.get("reason", "")
    ctx.publish()


# --- run ----------------------------------------------------------------------------------------


def load_setup(report: dict, ctx: Context) -> bool:
    """The setup state into ``report`` and ``ctx``; False (every check then an error) when
    there is none. The dry-run, whose setup takes seconds, sets up here instead."""
    path = state_path(ctx)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    if state and state.get("mode") == report["mode"] and state.get("work_dir") == str(ctx.work):
        _restore(report, ctx, state)
        report["setup_state"] = str(path)
        return True
    if not ctx.plan.gpu:
        say("run --dry-run: no setup state in the work folder; setting up first (no installs)")
        orchestrate_setup(report, ctx)
        return True
    reason = f"no setup state at {path}: run `bash scripts/gpu_check.sh setup` first"
    blocked(report, check_names(), reason)
    return False


def orchestrate_run(report: dict, ctx: Context) -> None:
    if not load_setup(report, ctx):
        return
    checks = report["checks"]
    data_there = (ctx.work / "data" / "sizes.json").is_file()
    if (checks["data"]["status"] != "ok" or not data_there) and ctx.python["torch"] is not None:
        run_check(report, ctx, "data", check_data)  # cut short in setup, or the folder went
    for framework in FRAMEWORKS:
        if ctx.python[framework] is None:
            reason = f"setup.{framework} failed: {ctx.setup_error.get(framework)}"
            blocked(report, [n for n in run_checks() if needs(n) == framework], reason)
    if checks["data"]["status"] != "ok":
        blocked(report, run_checks(), "no data: the data check failed")
        return
    timed(report, ctx)
    correctness(report, ctx)


def _ready(report: dict, ctx: Context, name: str) -> bool:
    """Not already failed for want of its venv or the data, and selected (``--only``)."""
    if ctx.only and not any(fnmatch.fnmatchcase(name, pattern) for pattern in ctx.only):
        reason = f"not selected (--only {','.join(ctx.only)})"
        report["checks"][name] = {"status": "skipped", "reason": reason}
        return False
    return report["checks"][name]["status"] == "skipped"


def timed(report: dict, ctx: Context) -> None:
    """The throughput checks, one at a time: nothing else on the GPU or the CPUs."""
    order = [
        ("throughput.synthetic", check_synthetic, ()),
        (run_checks()[1], check_loader, ()),
        ("prefetcher.off", check_loader, (True,)),
        *((f"compile.{fw}.{name}", check_compile, (fw, name)) for fw, name in COMPILE_RUNS),
        *((f"throughput.paddle.ocr.ring_{leg}", check_ring, (leg,)) for leg in RING_LEGS),
    ]
    for name, func, args in order:
        if _ready(report, ctx, name):
            run_check(report, ctx, name, func, *args)


def correctness(report: dict, ctx: Context) -> None:
    """AMP, smoke with resume, the PP-OCRv4 fine-tune and export, two gloo ranks: none is
    timed, so several run at once (started in this order while the budget lasts)."""
    jobs: list[tuple] = []
    for framework in FRAMEWORKS:
        for task_name in TASKS:
            for dtype in AMP_DTYPES:
                name = f"amp.{framework}.{task_name}.{dtype}"
                jobs.append((name, check_amp, framework, task_name, dtype))
    for framework, task_name in (("torch", "resnet50"), ("paddle", "ocr")):
        jobs.append((f"smoke.{framework}.{task_name}", check_smoke, framework, task_name))
    jobs.append(("finetune.paddle.ppocrv4", check_finetune))
    jobs.append(("dist.torch.gloo2", check_dist))
    jobs = [job for job in jobs if _ready(report, ctx, job[0])]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=ctx.plan.jobs)
    try:
        futures = [
            pool.submit(run_check, report, ctx, name, func, *args) for name, func, *args in jobs
        ]
        for future in futures:
            future.result()
    except BaseException:
        ctx.stop()  # Ctrl-C or SIGTERM: end the running checks, so the pool can close
        raise
    finally:
        pool.shutdown(wait=True)
