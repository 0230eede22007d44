"""The command line (``bash scripts/gpu_check.sh [--dry-run] [--work-dir DIR] [--keep]``): picks
the plan and the work folder, runs the checks under the budget and prints the one JSON object.
Exit 0: every check ran; 3: the budget left some skipped; 1: the script broke; 130: interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .context import Context
from .orchestrate import orchestrate
from .plan import DRY_PLAN, GPU_PLAN, ROOT, Plan
from .report import skeleton, summarize
from .util import START, clean, say

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
        "--dry-run",
        action="store_true",
        help="the same checks on the CPU with tiny step counts, using the "
        "existing .venv-torch and .venv-paddle (no installs)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="data, runs and logs (default: runs/gpu-check; dry-run: a temporary "
        "folder, removed when every check passed)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the dry-run's work folder")
    return parser


def work_dir(args: argparse.Namespace) -> tuple[Path, bool]:
    """The work folder, and whether it is a temporary one (the dry-run's default). A given or
    default folder keeps its data; its earlier results are removed."""
    temporary = args.work_dir is None and args.dry_run
    if args.work_dir is not None:
        work = args.work_dir.resolve()
    elif args.dry_run:
        work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    else:
        work = ROOT / "runs" / "gpu-check"
    if work.exists() and not temporary:
        for sub in ("logs", "stats", "runs"):  # the data is reused; results start over
            shutil.rmtree(work / sub, ignore_errors=True)
    return work, temporary


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", plan.budget_s))
    work, temporary = work_dir(args)
    report = skeleton(plan, work)
    report["budget_s"] = budget
    code = run(report, plan, work, budget)
    report["elapsed_s"] = round(time.monotonic() - START, 1)
    if temporary and report["ok"] and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        report["work_dir"] = None
    print(json.dumps(clean(report), indent=2, allow_nan=False), flush=True)
    summary = report["summary"]
    say(
        f"done in {report['elapsed_s']} s: ok={report['ok']}, failed={summary.get('failed')}, "
        f"skipped={summary.get('skipped')}"
    )
    return code


def run(report: dict, plan: Plan, work: Path, budget: float) -> int:
    """Every check into ``report``, then its summary; the exit code. SIGTERM stops it as Ctrl-C
    does; either way every child still running is killed."""
    code = 0
    ctx = None
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        ctx = Context(plan, work, budget)
        orchestrate(report, ctx)
        summarize(report)
        if report["summary"]["skipped"]:
            code = 3
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
