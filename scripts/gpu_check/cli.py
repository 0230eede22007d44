"""The command line, the order of the checks and the reports: setup, the timed checks one at a
time, then the correctness checks several at once while the budget lasts. The JSON has every key
from the start (a broken run still prints the whole schema); it is written after every check."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import fnmatch
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from datasets.safe_files import write_atomic

from . import __doc__ as PACKAGE_DOC
from . import checks, commands
from .commands import CHECK_NAMES, DRY_PLAN, GPU_PLAN, ROOT, SCHEMA, Plan
from .context import Context, OutOfTime, say, tail

NOT_REACHED = {"status": "skipped", "reason": "not reached"}
DRY_RUN_PYTHONS = {"torch": ".venv-torch/bin/python", "paddle": ".venv-paddle/bin/python"}
OPTIONS = {  # option: (type, help); docs/first_gpu_run.md says more
    "--python": (str, "the interpreter with the host's torch (dry-run: .venv-torch's)"),
    "--paddle-python": (str, "one with a Paddle GPU build (default: --python's)"),
    "--wheelhouse": (Path, "wheels the host lacks, installed with --no-index into OUT/site"),
    "--out": (Path, "data, runs, logs, reports (default: runs/gpu-check; dry-run: a temp dir)"),
    "--budget-s": (float, "wall-clock seconds, data included; checks past it are skipped"),
    "--only": (str, "only the checks matching these comma-separated patterns: 'amp.*,smoke.*'"),
}
TORCH_RUNS = ("throughput.synthetic", "throughput.loader", "prefetcher")  # not named .torch.
_lock, _write_lock = threading.Lock(), threading.Lock()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_check.sh",
        description=PACKAGE_DOC.split("\nModules (")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for option, (kind, text) in OPTIONS.items():
        parser.add_argument(option, type=kind, help=text, default="" if kind is str else None)
    parser.add_argument("--dry-run", action="store_true", help="the same checks on the CPU, tiny")
    parser.add_argument("--keep", action="store_true", help="keep the dry-run's work folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.wheelhouse is not None and not args.wheelhouse.is_dir():
        parser().error(f"--wheelhouse {args.wheelhouse}: no such folder")
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    budget = args.budget_s if args.budget_s is not None else plan.budget_s
    temporary = args.out is None and args.dry_run
    work = Path(tempfile.mkdtemp(prefix="gpu-check-")) if temporary else ROOT / "runs/gpu-check"
    work = args.out.resolve() if args.out is not None else work
    for sub in ("runs", "export"):  # a run starts over; the data stays
        shutil.rmtree(work / sub, ignore_errors=True)
    # The interpreters: as given (Paddle's defaults to --python's); a dry run given neither
    # takes make setup's venvs where they exist; else the one running this check.
    venvs = {k: str(ROOT / v) for k, v in DRY_RUN_PYTHONS.items() if (ROOT / v).exists()}
    venvs = venvs if args.dry_run and not args.python else {}
    torch = args.python or venvs.get("torch") or sys.executable
    pythons = {"torch": torch, "paddle": args.paddle_python or venvs.get("paddle") or torch}
    started, only, ctx = time.monotonic(), [p for p in args.only.split(",") if p], None
    paths = report_paths(work, only)
    report = {**skeleton(plan, work, CHECK_NAMES), "budget_s": budget, "report_md": str(paths[1])}
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does

    def publish() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        write(report, paths)

    try:
        ctx = Context(plan, work, budget)
        ctx.python.update(pythons)
        ctx.publish, ctx.only = publish, only
        say(f"torch: {pythons['torch']}; Paddle: {pythons['paddle']}; budget {budget:.0f} s")
        orchestrate(report, ctx, args.wheelhouse.resolve() if args.wheelhouse else None)
        code = exit_code(report)
    except KeyboardInterrupt:
        report["script_error"], code = "interrupted (SIGINT or SIGTERM)", 130
    except Exception:
        report["script_error"], code = traceback.format_exc(), 1
    finally:
        if ctx is not None:
            ctx.stop()  # every child still running
    publish()
    print(as_json(report), flush=True)
    print("\n".join(f"gpu_check: {line}" for line in summary_lines(report, paths)), flush=True)
    if temporary and code == 0 and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return code


def report_paths(work: Path, only: list[str]) -> tuple[Path, Path]:
    """The JSON and the Markdown table; a tail's (--only) beside the full run's, not over them."""
    stem = "gpu_check" + ("-only" if only else "")
    return work / f"{stem}.json", work / f"{stem}.md"


def exit_code(report: dict) -> int:
    """0: every check ran (ok or error, in the JSON); 3: some were skipped."""
    return 3 if any(c["status"] == "skipped" for c in report["checks"].values()) else 0


def run_check(report: dict, ctx: Context, name: str, func, *args) -> dict:
    """Run one check; whatever it raises becomes its error, and past the budget it is skipped.
    The report is written after it, whatever happened."""
    say(f"{name}: start")
    try:
        result = func(ctx, *args)
    except OutOfTime as error:
        result = {"status": "skipped", "reason": str(error)}
    except Exception as error:  # a check's failure must not stop the others
        result = {"status": "error", "error": f"{type(error).__name__}: {error}"}
        result["traceback"] = tail(traceback.format_exc(), 8)
    with _lock:
        report["checks"][name] = result
    why = f" ({result.get('error') or result.get('reason')})" if result["status"] != "ok" else ""
    say(f"{name}: {result['status']}{why}")
    ctx.publish()
    return result


def blocked(report: dict, names: list[str], reason: str) -> None:
    """Each of ``names`` not yet decided becomes an error: what it needs failed."""
    for name in names:
        if report["checks"].get(name, NOT_REACHED) == NOT_REACHED:
            report["checks"][name] = {"status": "error", "error": reason}


def _ready(report: dict, ctx: Context, name: str) -> bool:
    """Not already decided by its framework's setup or the data, and selected (``--only``)."""
    if report["checks"][name] != NOT_REACHED:
        return False
    if ctx.only and not any(fnmatch.fnmatchcase(name, pattern) for pattern in ctx.only):
        reason = f"not selected (--only {','.join(ctx.only)})"
        report["checks"][name] = {"status": "skipped", "reason": reason}
        return False
    return True


def _check(name: str) -> tuple:
    """The function of check ``name`` and its arguments (the framework, task, dtype)."""
    kind, *parts = name.split(".")
    if name == "throughput.synthetic":
        return (checks.check_synthetic,)
    if kind in ("throughput", "prefetcher"):
        return checks.check_throughput, name
    return getattr(checks, f"check_{kind}"), *(parts if kind in ("compile", "amp", "smoke") else ())


def _in_parallel(ctx: Context, jobs: list, workers: int) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    try:
        for future in [pool.submit(*job) for job in jobs]:
            future.result()
    except BaseException:
        ctx.stop()  # Ctrl-C or SIGTERM: end the running checks, so the pool can close
        raise
    finally:
        pool.shutdown(wait=True)


def _setup_side(report: dict, ctx: Context, framework: str) -> None:
    """setup.FRAMEWORK, then, for torch, configs and data, which need it."""
    result = run_check(report, ctx, f"setup.{framework}", getattr(checks, f"setup_{framework}"))
    build = {k: result.get(k) for k in checks.BUILD_FACTS}
    report[f"{framework}_build"] = {**build, "python": ctx.python[framework]}
    if result["status"] != "ok":
        ctx.setup_error[framework] = result.get("error") or result.get("reason", "")
        if framework == "torch":
            blocked(report, ["configs", "data"], f"setup.torch failed: {ctx.setup_error['torch']}")
    elif framework == "torch":
        run_check(report, ctx, "configs", checks.check_configs)
        run_check(report, ctx, "data", checks.check_data)
    ctx.publish()


def orchestrate(report: dict, ctx: Context, wheelhouse: Path | None) -> None:
    """Setup, then the timed checks one at a time, then the correctness checks. A framework's
    checks are skipped with its setup's reason (no Paddle build here), or errors when it failed."""
    report["host"] = host_facts(ctx.plan)
    if wheelhouse is not None:
        try:
            report["wheelhouse"] = checks.install_wheelhouse(ctx, ctx.python["torch"], wheelhouse)
        except Exception as error:  # RuntimeError, OutOfTime: setup.torch fails with it
            report["wheelhouse"] = {"dir": str(wheelhouse), "error": str(error)}
            ctx.setup_error["torch"] = str(error)
    _in_parallel(ctx, [(_setup_side, report, ctx, fw) for fw in ("torch", "paddle")], 2)
    entries = report["checks"]
    for framework in ("torch", "paddle"):
        setup = entries[f"setup.{framework}"]
        names = [n for n in commands.RUN_CHECKS if (".paddle." in n) == (framework == "paddle")]
        if setup["status"] == "skipped":
            entries.update({n: {"status": "skipped", "reason": setup["reason"]} for n in names})
        elif setup["status"] != "ok":
            blocked(report, names, f"setup.{framework} failed: {ctx.setup_error.get(framework)}")
    if entries["data"]["status"] != "ok":
        return blocked(report, commands.RUN_CHECKS, "no data: the data check did not pass")
    for name in commands.TIMED_CHECKS:  # alone on the GPU and the CPUs
        if _ready(report, ctx, name):
            run_check(report, ctx, name, *_check(name))
    jobs = [(run_check, report, ctx, name, *_check(name)) for name in commands.CORRECTNESS_CHECKS]
    _in_parallel(ctx, [job for job in jobs if _ready(report, ctx, job[3])], ctx.plan.jobs)


def skeleton(plan: Plan, work: Path, names: list[str]) -> dict:
    build = {"python": None, **dict.fromkeys(checks.BUILD_FACTS)}
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"schema": SCHEMA, "mode": "gpu" if plan.gpu else "dry-run", "ok": False}
    report.update(started_at=started, elapsed_s=None, budget_s=None, work_dir=str(work))
    report.update(report_md=None, host={}, wheelhouse=None)
    report.update(torch_build=dict(build), paddle_build=dict(build))
    report["checks"] = {name: dict(NOT_REACHED) for name in names}
    return {**report, "summary": {}, "script_error": None}


def host_facts(plan: Plan) -> dict:
    facts: dict = {"python": platform.python_version(), "cpus": os.cpu_count()}
    gpu_keys = ("gpu", "driver", "compute_capability", "gpu_memory_mib")
    facts.update(platform=platform.platform(), **dict.fromkeys((*gpu_keys, "cuda_driver")))
    with contextlib.suppress(OSError):
        stat = os.statvfs("/dev/shm")
        facts["dev_shm_gib"] = round(stat.f_blocks * stat.f_frsize / 2**30, 1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {**facts, "nvidia_smi": "not found" if plan.gpu else "not found (dry-run)"}
    query = [smi, "--query-gpu=name,driver_version,compute_cap,memory.total"]
    try:
        out = subprocess.run(
            [*query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        )
        lines = out.stdout.strip().splitlines()
        parts = [p.strip() for p in lines[0].split(",")] if lines else []
        facts.update(zip(gpu_keys, parts) if len(parts) >= 4 else {}, gpus_visible=len(lines))
        banner = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
        match = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        facts["cuda_driver"] = match.group(1) if match else None
    except (OSError, subprocess.SubprocessError) as error:
        facts["nvidia_smi"] = f"failed: {error}"
    return facts


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def _build_line(build: dict) -> str | None:
    """The framework build that ran ("2.11.0 (CUDA 13.0) in PYTHON"), or None."""
    cuda = f"CUDA {build['cuda']}" if build.get("cuda") else "CPU build"
    return f"{build['version']} ({cuda}) in {build.get('python')}" if build.get("version") else None


def summarize(report: dict) -> None:
    """``summary`` and ``ok`` from the checks (and ``vs_synthetic`` into the loader checks)."""
    entries = report["checks"]
    synthetic = entries.get("throughput.synthetic", {}).get("images_per_s")
    loader, keys = {}, ("samples_per_s", "data_wait_fraction", "vs_synthetic", "status")
    for name in (commands.TIMED_CHECKS[1], "prefetcher.off"):
        check = entries.get(name, {})
        if _ratio(check.get("samples_per_s"), synthetic) is not None:
            check["vs_synthetic"] = _ratio(check.get("samples_per_s"), synthetic)
        loader[name] = {k: check.get(k) for k in keys}
    on, off = (figures["samples_per_s"] for figures in loader.values())
    ring = [entries.get(f"throughput.paddle.ocr.ring_{leg}", {}) for leg in ("on", "off")]
    (rate_on, wait_on), (rate_off, wait_off) = (
        (r.get("samples_per_s"), r.get("data_wait_fraction")) for r in ring
    )
    summary = {"images_per_s": {"synthetic": synthetic, "loader": loader}}
    summary["prefetcher"] = {"knob": "loader.device_prefetch", "on": on, "off": off}
    summary["prefetcher"].update(on_over_off=_ratio(on, off), engaged=report["mode"] == "gpu")
    summary["batch_ring"] = {"knob": "loader.batch_ring", "on": rate_on, "off": rate_off}
    summary["batch_ring"].update(on_over_off=_ratio(rate_on, rate_off))
    summary["batch_ring"].update(data_wait_on=wait_on, data_wait_off=wait_off)
    compiled, scales, resumes, busy = {}, {}, {}, {}
    memory: dict = {"torch": None, "paddle": None, "by_check": {}}
    for name, check in entries.items():
        keys = ("compile_s", "step_off_over_on", "engaged", "status", "reason")
        if name.startswith("compile."):
            compiled[name[len("compile.") :]] = {k: check.get(k) for k in keys}
        if name.startswith("amp.") and name.endswith(".fp16"):
            scales[name] = check.get("loss_scale")
        if name.startswith("smoke."):
            resumes[name] = check.get("resume_loss")
        if "nvml" in check:
            busy[name] = (check["nvml"] or {}).get("busy_pct_median")
        peak = check.get("peak_mem_mb")  # the largest per framework, and each check's
        if isinstance(peak, (int, float)):
            memory["by_check"][name] = peak
            torch = ".torch." in name or name.startswith(TORCH_RUNS)
            framework = "torch" if torch else "paddle" if ".paddle." in name else None
            if framework:
                memory[framework] = max(peak, memory[framework] or peak)
    summary.update(compile=compiled, loss_scale=scales, resume_loss=resumes)
    summary.update(gpu_busy_pct_median=busy, peak_gpu_memory_mb=memory)
    summary["torch_build"] = _build_line(report["torch_build"])
    paddle_skipped = entries.get("setup.paddle", {}).get("reason")
    summary["paddle_build"] = _build_line(report["paddle_build"]) or paddle_skipped
    statuses = [check["status"] for check in entries.values()]
    summary["failed"] = [n for n, c in entries.items() if c["status"] == "error"]
    summary["skipped"] = [n for n, c in entries.items() if c["status"] == "skipped"]
    report.update(summary=summary, ok=all(s == "ok" for s in statuses))


def as_json(report: dict) -> str:
    """JSON text that is JSON: non-finite floats as strings ("NaN"), other objects as text."""
    text = json.dumps(report, default=str)
    return json.dumps(json.loads(text, parse_constant=str), indent=2, allow_nan=False)


def summary_lines(report: dict, paths: tuple[Path, Path]) -> list[str]:
    """What a reader of a cut-off log needs first: stdout's last lines, the table's header."""
    summary, host = report["summary"], report.get("host") or {}
    images = summary.get("images_per_s") or {}
    loader = (images.get("loader") or {}).get(commands.TIMED_CHECKS[1]) or {}
    lines = [f"ok={report['ok']} in {report['elapsed_s']} s (budget {report['budget_s']} s)"]
    gpu = f"{host.get('gpu')} (compute capability {host.get('compute_capability')}, driver "
    lines.append(f"GPU {gpu}{host.get('driver')}, CUDA {host.get('cuda_driver')})")
    lines.append(f"torch {summary.get('torch_build')}; Paddle {summary.get('paddle_build')}")
    if images.get("synthetic") or loader.get("samples_per_s"):
        lines.append(
            f"ResNet-50 synthetic {images.get('synthetic')} images/s, loader "
            f"{loader.get('samples_per_s')} ({loader.get('vs_synthetic')} of it), data wait "
            f"{loader.get('data_wait_fraction')}"
        )
    lines.append(f"failed {summary.get('failed')}; skipped {summary.get('skipped')}")
    return [*lines, f"JSON {paths[0]}, table {paths[1]}"]


def markdown(report: dict, paths: tuple[Path, Path]) -> str:
    """The short table beside the JSON: one row per check, its status and figures."""
    lines = [f"# gpu_check ({report['mode']})", ""]
    lines += [f"- {line}" for line in summary_lines(report, paths)]
    lines += ["", "| check | status | figure | note |", "|---|---|---|---|"]
    for name, check in report["checks"].items():
        # its figures: the numbers at its top level, in the order the check wrote them
        numbers = {k: v for k, v in check.items() if type(v) in (int, float)}
        figures = [f"{k} {v:.4g}" if type(v) is float else f"{k} {v}" for k, v in numbers.items()]
        figure = "" if check["status"] == "skipped" else ", ".join(figures)
        note = (check.get("error") or check.get("reason") or "").replace("\n", " ")[:160]
        lines.append(f"| {name} | {check['status']} | {figure} | {note.replace('|', '/')} |")
    if report.get("script_error"):
        lines += ["", "script_error:", "", "```", report["script_error"][-2000:], "```"]
    return "\n".join(lines) + "\n"


def write(report: dict, paths: tuple[Path, Path]) -> None:
    """The JSON and the Markdown table as they stand (after every check, and at the end)."""
    with _write_lock:
        with contextlib.suppress(Exception):
            summarize(report)
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        write_atomic(paths[0], as_json(report))
        write_atomic(paths[1], markdown(report, paths))
