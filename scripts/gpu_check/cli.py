"""The command line (``bash scripts/gpu_check.sh {setup,run} [--dry-run] [--work-dir DIR]
[--keep]``; no command: setup, then run): picks the plan and the work folder, runs the command's
checks under its budget, writes the JSON and the Markdown table after every check and prints the
JSON. Exit 0: every check ran; 3: some were skipped (the budget, or a missing prerequisite such
as a compiler: each says why); 1: the script broke or `run` found no setup; 130: interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .context import Context
from .orchestrate import orchestrate_run, orchestrate_setup
from .plan import DRY_PLAN, GPU_PLAN, ROOT, SETUP_CHECKS, Plan, check_names
from .report import markdown, skeleton, summarize
from .util import clean, say

# --help: the package's docstring, without its list of modules.
DESCRIPTION = PACKAGE_DOC.split("\nModules (")[0]


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_check.sh",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=("setup", "run"),
        help="setup: install and probe the venvs, write the data (at most 5 minutes; a second "
        "call returns in seconds); run: the measurements (at most 7 minutes). Neither: both",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the same checks on the CPU with tiny step counts, using the "
        "existing .venv-torch and .venv-paddle (no installs)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="data, runs, logs and the reports (default: runs/gpu-check; dry-run: a temporary "
        "folder, removed when every check passed)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the dry-run's work folder")
    parser.add_argument(
        "--only",
        default="",
        help="run: only the checks matching these comma-separated patterns (e.g. "
        "'amp.*,smoke.*,finetune.*,dist.*': the tail a budget cut left), the rest skipped",
    )
    return parser


def work_dir(args: argparse.Namespace) -> tuple[Path, bool]:
    """The work folder, and whether it is a temporary one (the dry-run's default). A given or
    default folder keeps its data and setup state; `run` removes earlier runs."""
    temporary = args.work_dir is None and args.dry_run
    if args.work_dir is not None:
        work = args.work_dir.resolve()
    elif args.dry_run:
        work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    else:
        work = ROOT / "runs" / "gpu-check"
    return work, temporary


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    work, temporary = work_dir(args)
    commands = [args.command] if args.command else ["setup", "run"]
    code = 0
    for command in commands:
        code = one_command(command, plan, work, [p for p in args.only.split(",") if p])
        if code == 130:
            break  # interrupted
    if temporary and code == 0 and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return code


def one_command(command: str, plan: Plan, work: Path, only: list[str]) -> int:
    if command == "setup":
        budget = float(os.environ.get("GPU_CHECK_SETUP_BUDGET_S", plan.setup_budget_s))
        names = SETUP_CHECKS
    else:
        budget = float(os.environ.get("GPU_CHECK_BUDGET_S", plan.budget_s))
        names = check_names()
        if not only:  # a full run starts over; data and setup's logs stay
            for sub in ("runs", "export"):
                shutil.rmtree(work / sub, ignore_errors=True)
    started = time.monotonic()
    report = skeleton(plan, work, command, names)
    report["budget_s"] = budget
    # `run --only` (the tail of a cut run) reports beside the full run's reports, not over them
    stem = f"gpu_check.{command}" + ("-only" if only and command == "run" else "")
    paths = (work / f"{stem}.json", work / f"{stem}.md")
    report["report_md"] = str(paths[1])
    code = run(report, command, plan, work, budget, paths, started, only)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write(report, paths)
    print(json.dumps(clean(report), indent=2, allow_nan=False), flush=True)
    summary = report["summary"]
    say(
        f"{command} done in {report['elapsed_s']} s: ok={report['ok']}, "
        f"failed={summary.get('failed')}, skipped={summary.get('skipped')}"
    )
    say(f"{command}: JSON {paths[0]}, table {paths[1]}")
    return code


_write_lock = threading.Lock()


def write(report: dict, paths: tuple[Path, Path]) -> None:
    """The JSON and the Markdown table as they stand (after every check, and at the end)."""
    with _write_lock:
        with contextlib.suppress(Exception):
            summarize(report)
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for path, text in (
            (paths[0], json.dumps(clean(report), indent=2, allow_nan=False)),
            (paths[1], markdown(report)),
        ):
            partial = path.with_suffix(path.suffix + ".partial")
            partial.write_text(text, encoding="utf-8")
            partial.replace(path)


def run(
    report: dict,
    command: str,
    plan: Plan,
    work: Path,
    budget: float,
    paths: tuple[Path, Path],
    started: float,
    only: list[str],
) -> int:
    """The command's checks into ``report``, then its summary; the exit code. SIGTERM stops it
    as Ctrl-C does; either way every child still running is killed."""
    code = 0
    ctx = None
    signal.signal(signal.SIGTERM, _interrupted)

    def publish() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        write(report, paths)

    try:
        ctx = Context(plan, work, budget)
        ctx.publish = publish
        ctx.only = only
        (orchestrate_setup if command == "setup" else orchestrate_run)(report, ctx)
        summarize(report)
        statuses = [c["status"] for c in report["checks"].values()]
        if command == "run" and report["checks"]["setup.torch"].get("error", "").startswith(
            "no setup state"
        ):
            code = 1
        elif "skipped" in statuses:
            code = 3
        elif command == "setup" and "error" in statuses:
            code = 1
    except KeyboardInterrupt:
        report["script_error"] = "interrupted (SIGINT or SIGTERM)"
        code = 130
        with contextlib.suppress(Exception):
            summarize(report)
    except Exception:
        report["script_error"] = traceback.format_exc()
        code = 1
    finally:
        if ctx is not None:
            ctx.stop()
    return code
