"""The order of the checks: setup (the wheelhouse, both frameworks probed on the device, every
command line through the config loader, the data), then the timed checks one at a time, most
important first (synthetic ceiling, the loader at 8 workers, the prefetcher off, train.compile,
the Paddle batch ring), then the correctness runs several at once (AMP, smoke with resume,
PP-OCRv4 fine-tune and export, two gloo ranks). ``run_check`` turns whatever a check raises into
its JSON entry and has the report written after every check; a check whose prerequisite failed
is marked an error, one whose framework is not on this host skipped.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
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
from .plan import AMP_DTYPES, COMPILE_RUNS, FRAMEWORKS, RING_LEGS, TASKS, run_checks
from .report import NOT_REACHED, host_facts
from .setup import (
    NotHere,
    SetupError,
    build_facts,
    install_wheelhouse,
    setup_paddle,
    setup_torch,
)
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
    """Each of ``names`` not yet decided becomes an error: what it needs failed."""
    for name in names:
        if report["checks"].get(name, NOT_REACHED) == NOT_REACHED:
            report["checks"][name] = {"status": "error", "error": reason}


def needs(name: str) -> str:
    """The framework a check needs: paddle or torch (configs and data run with torch's)."""
    return "paddle" if ".paddle." in name else "torch"


# --- setup ---------------------------------------------------------------------------------------


def setup(report: dict, ctx: Context, wheelhouse: Path | None) -> None:
    """The wheelhouse (when given), both frameworks probed at once, then configs and the data
    with the torch interpreter."""
    report["host"] = host_facts(ctx.plan)
    if wheelhouse is not None:
        try:
            report["wheelhouse"] = install_wheelhouse(ctx, ctx.python["torch"], wheelhouse)
        except (SetupError, OutOfTime) as error:
            report["wheelhouse"] = {"dir": str(wheelhouse), "error": str(error)}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    try:
        sides = [pool.submit(_torch_side, report, ctx), pool.submit(_paddle_side, report, ctx)]
        for side in sides:
            side.result()
    except BaseException:
        ctx.stop()
        raise
    finally:
        pool.shutdown(wait=True)


def _torch_side(report: dict, ctx: Context) -> None:
    """setup.torch, then (they need it) configs and data."""
    failure = (report.get("wheelhouse") or {}).get("error")
    if failure:
        result = {"status": "error", "error": failure}
    else:
        result = _setup_result(setup_torch, ctx)
    report["checks"]["setup.torch"] = result
    report["torch_build"] = {**build_facts(result), "python": result.get("python")}
    _said("setup.torch", result)
    if result["status"] != "ok":
        ctx.setup_error["torch"] = result.get("error") or result.get("reason", "")
        blocked(report, ["configs", "data"], f"setup.torch failed: {ctx.setup_error['torch']}")
        ctx.publish()
        return
    ctx.publish()
    run_check(report, ctx, "configs", check_configs)
    run_check(report, ctx, "data", check_data)


def _paddle_side(report: dict, ctx: Context) -> None:
    """setup.paddle: ok, an error (a build that cannot run here), or skipped (no Paddle build
    here: its checks are skipped too, with the same reason)."""
    result = _setup_result(setup_paddle, ctx)
    report["checks"]["setup.paddle"] = result
    report["paddle_build"] = {**build_facts(result), "python": ctx.python["paddle"]}
    if result["status"] != "ok":
        ctx.setup_error["paddle"] = result.get("error") or result.get("reason", "")
    _said("setup.paddle", result)
    ctx.publish()


def _setup_result(func, ctx: Context) -> dict:
    try:
        return func(ctx)
    except (OutOfTime, NotHere) as error:
        return {"status": "skipped", "reason": str(error)}
    except SetupError as error:
        return {**error.info, "status": "error", "error": str(error)}
    except Exception as error:
        return {"status": "error", "error": f"{type(error).__name__}: {error}"}


def _said(name: str, result: dict) -> None:
    say(f"{name}: {result['status']} {result.get('error') or result.get('reason') or ''}")


# --- run ----------------------------------------------------------------------------------------


def orchestrate(report: dict, ctx: Context, wheelhouse: Path | None) -> None:
    """Setup, then the timed checks one at a time, then the correctness checks."""
    setup(report, ctx, wheelhouse)
    checks = report["checks"]
    for framework in FRAMEWORKS:
        setup_check = checks[f"setup.{framework}"]
        names = [n for n in run_checks() if needs(n) == framework]
        if setup_check["status"] == "skipped":
            for name in names:
                checks[name] = {"status": "skipped", "reason": setup_check["reason"]}
        elif setup_check["status"] != "ok":
            blocked(report, names, f"setup.{framework} failed: {ctx.setup_error.get(framework)}")
    if checks["data"]["status"] != "ok":
        blocked(report, run_checks(), "no data: the data check did not pass")
        return
    timed(report, ctx)
    correctness(report, ctx)


def _ready(report: dict, ctx: Context, name: str) -> bool:
    """Not already decided by its framework's setup or the data, and selected (``--only``)."""
    if report["checks"][name] != NOT_REACHED:
        return False
    if ctx.only and not any(fnmatch.fnmatchcase(name, pattern) for pattern in ctx.only):
        reason = f"not selected (--only {','.join(ctx.only)})"
        report["checks"][name] = {"status": "skipped", "reason": reason}
        return False
    return True


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
