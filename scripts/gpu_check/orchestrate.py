"""The order of the checks: set-up of both venvs, configs and data, then phase A (smoke and AMP
runs, several at once) and phase B (throughput, one run at a time). ``run_check`` turns whatever
a check raises into its JSON entry; a check whose prerequisite failed is marked an error.
"""

from __future__ import annotations

import concurrent.futures
import traceback

from .checks import (
    check_amp,
    check_compile,
    check_configs,
    check_data,
    check_loader,
    check_smoke,
    check_synthetic,
)
from .context import Context, OutOfTime
from .plan import AMP_DTYPES, COMPILE_RUNS, FRAMEWORKS, TASKS, WORKER_COUNTS, check_names
from .report import host_facts
from .setup import SetupError, setup_paddle, setup_torch
from .util import say, tail

# What prefetcher.on copies from the widest loader run (it is that run).
PREFETCH_ON_KEYS = (
    "status",
    "samples_per_s",
    "data_wait_fraction",
    "workers",
    "device",
    "error",
    "reason",
)


def run_check(report: dict, ctx: Context, name: str, func, *args) -> dict:
    """Run one check; whatever it raises becomes its error, and past the budget it is skipped."""
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
    report["checks"][name] = result
    say(
        f"{name}: {result['status']}" + (f" ({result.get('error')})" if result.get("error") else "")
    )
    return result


def blocked(report: dict, names: list[str], reason: str) -> None:
    for name in names:
        report["checks"][name] = {"status": "error", "error": reason}


def orchestrate(report: dict, ctx: Context) -> None:
    report["host"] = host_facts(ctx.plan)
    run_setup_torch(report, ctx)
    run_setup_paddle(report, ctx)
    if ctx.python["torch"] is None:  # the data and every torch check need the torch venv
        reason = f"setup.torch failed: {ctx.setup_error['torch']}"
        blocked(report, [n for n in check_names()[2:] if ".paddle." not in n], reason)
        blocked(
            report,
            [n for n in check_names() if ".paddle." in n],
            f"no data (the data check runs in the torch venv): {reason}",
        )
        return
    run_check(report, ctx, "configs", check_configs)
    if run_check(report, ctx, "data", check_data)["status"] != "ok":
        names = check_names()
        blocked(report, names[names.index("data") + 1 :], "no data: the data check failed")
        return
    if ctx.python["paddle"] is None:
        blocked(
            report,
            [n for n in check_names() if ".paddle." in n],
            f"setup.paddle failed: {ctx.setup_error['paddle']}",
        )
    run_phase_a(report, ctx)
    run_phase_b(report, ctx)


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


def run_setup_paddle(report: dict, ctx: Context) -> None:
    """setup.paddle (its attempts go into paddle_build); on failure no Paddle check can run."""
    try:
        paddle_result = setup_paddle(ctx, report["paddle_build"])
    except OutOfTime as error:
        paddle_result = {"status": "skipped", "reason": str(error)}
    except Exception as error:
        paddle_result = {"status": "error", "error": str(error)}
    report["checks"]["setup.paddle"] = paddle_result
    say(f"setup.paddle: {paddle_result['status']} {paddle_result.get('error', '')}")
    if paddle_result["status"] != "ok":
        ctx.python["paddle"] = None
        ctx.setup_error["paddle"] = paddle_result.get("error") or paddle_result.get("reason", "")


def run_phase_a(report: dict, ctx: Context) -> None:
    """Phase A: smoke and AMP runs, several at once (each is small; none is timed)."""
    jobs: list[tuple] = []
    for framework, task in (("paddle", "ocr"), ("torch", "resnet50")):
        if ctx.python[framework]:
            jobs.append((f"smoke.{framework}.{task}", check_smoke, framework, task))
    for framework in FRAMEWORKS:
        if ctx.python[framework]:
            for task in TASKS:
                for dtype in AMP_DTYPES:
                    jobs.append(
                        (f"amp.{framework}.{task}.{dtype}", check_amp, framework, task, dtype)
                    )
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


def run_phase_b(report: dict, ctx: Context) -> None:
    """Phase B: throughput, one run at a time, nothing else on the GPU or the CPUs."""
    run_check(report, ctx, "throughput.synthetic", check_synthetic)
    for workers in WORKER_COUNTS:
        run_check(report, ctx, f"throughput.loader.w{workers}", check_loader, workers)
    widest = report["checks"][f"throughput.loader.w{WORKER_COUNTS[-1]}"]
    report["checks"]["prefetcher.on"] = {
        **{k: widest.get(k) for k in PREFETCH_ON_KEYS if k in widest},
        "engaged": ctx.plan.gpu,
        "run": f"throughput.loader.w{WORKER_COUNTS[-1]}",
    }
    off = run_check(report, ctx, "prefetcher.off", check_loader, WORKER_COUNTS[-1], True)
    off["engaged"] = False
    for framework, task in COMPILE_RUNS:  # timed too: one at a time, last (the least needed)
        name = f"compile.{framework}.{task}"
        if ctx.python[framework]:
            run_check(report, ctx, name, check_compile, framework, task)
