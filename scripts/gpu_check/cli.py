"""The command line (``bash scripts/gpu_check.sh [--python PATH] [--paddle-python PATH]
[--wheelhouse DIR] [--out DIR] [--budget-s N] [--only PATTERNS] [--dry-run] [--keep]``): picks
the plan, the interpreters and the work folder, runs every check under one budget, writes the
JSON and the Markdown table after every check, prints the JSON and then a short summary as the
last lines. Exit 0: every check ran; 3: some were skipped (the budget, --only, no Paddle build
here, a missing compiler: each says why); 1: the script broke; 130: interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .context import Context
from .orchestrate import orchestrate
from .plan import DRY_PLAN, GPU_PLAN, ROOT, Plan, check_names
from .report import markdown, skeleton, summarize
from .util import clean, say

# --help: the package's docstring, without its list of modules.
DESCRIPTION = PACKAGE_DOC.split("\nModules (")[0]
# The dry-run's interpreters when none is given: make setup's venvs.
DRY_RUN_PYTHONS = {
    "torch": ROOT / ".venv-torch/bin/python",
    "paddle": ROOT / ".venv-paddle/bin/python",
}


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_check.sh",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--python",
        help="the interpreter with the host's PyTorch (default: the one running this check; "
        "dry-run: .venv-torch's)",
    )
    parser.add_argument(
        "--paddle-python",
        help="an interpreter with a Paddle GPU build (default: --python's); where none imports, "
        "the Paddle checks are skipped, saying why (a dry run given neither: .venv-paddle's)",
    )
    parser.add_argument(
        "--wheelhouse",
        type=Path,
        help="wheels the host lacks (make gpu-wheelhouse PY=3.12), installed with --no-index "
        "into OUT/site for --python's children; nothing comes from a network",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="data, runs, logs and the reports (default: runs/gpu-check; dry-run: a temporary "
        "folder, removed when every check passed unless --keep)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="wall-clock seconds for everything, data generation included; checks past it are "
        f"skipped (default: {GPU_PLAN.budget_s:.0f}; dry-run {DRY_PLAN.budget_s:.0f})",
    )
    parser.add_argument(
        "--only",
        default="",
        help="only the checks matching these comma-separated patterns (e.g. "
        "'amp.*,smoke.*': the tail a budget cut left), the rest skipped; setup always runs",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the same checks on the CPU with tiny step counts (make test runs it)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the dry-run's work folder")
    return parser


def work_dir(args: argparse.Namespace) -> tuple[Path, bool]:
    """The work folder, and whether it is a temporary one (the dry-run's default). A given or
    default folder keeps its data; earlier runs and exports are removed."""
    if args.out is not None:
        return args.out.resolve(), False
    if args.dry_run:
        return Path(tempfile.mkdtemp(prefix="gpu-check-")), True
    return ROOT / "runs" / "gpu-check", False


def interpreters(args: argparse.Namespace) -> dict[str, str]:
    """The torch and Paddle interpreters: as given (Paddle defaults to --python's); a dry run
    given neither takes make setup's venvs where they exist; else the one running this check."""
    venvs = args.dry_run and args.python is None
    torch = args.python or (venvs and _existing(DRY_RUN_PYTHONS["torch"])) or sys.executable
    paddle = args.paddle_python or (venvs and _existing(DRY_RUN_PYTHONS["paddle"])) or torch
    return {"torch": torch, "paddle": paddle}


def _existing(path: Path) -> str | None:
    return str(path) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.wheelhouse is not None and not args.wheelhouse.is_dir():
        parser().error(f"--wheelhouse {args.wheelhouse}: no such folder")
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    budget = args.budget_s if args.budget_s is not None else plan.budget_s
    work, temporary = work_dir(args)
    for sub in ("runs", "export"):  # a run starts over; the data stays
        shutil.rmtree(work / sub, ignore_errors=True)
    started = time.monotonic()
    report = skeleton(plan, work, check_names())
    report["budget_s"] = budget
    only = [p for p in args.only.split(",") if p]
    paths = report_paths(work, only)
    report["report_md"] = str(paths[1])
    code = run(report, plan, work, budget, paths, started, only, args, interpreters(args))
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write(report, paths)
    print(json.dumps(clean(report), indent=2, allow_nan=False), flush=True)
    print(summary_lines(report, paths), flush=True)
    if temporary and code == 0 and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return code


def report_paths(work: Path, only: list[str]) -> tuple[Path, Path]:
    """The JSON and the Markdown table; a tail's (--only) beside the full run's, not over them."""
    stem = "gpu_check" + ("-only" if only else "")
    return work / f"{stem}.json", work / f"{stem}.md"


def summary_lines(report: dict, paths: tuple[Path, Path]) -> str:
    """The last lines of stdout: what a reader of a cut-off log needs first."""
    summary = report["summary"]
    lines = [
        f"gpu_check: ok={report['ok']} in {report['elapsed_s']} s (budget {report['budget_s']} s)",
        f"gpu_check: torch {summary.get('torch_build')}; Paddle {summary.get('paddle_build')}",
    ]
    images = summary.get("images_per_s") or {}
    loader = (images.get("loader") or {}).get("throughput.loader.w8") or {}
    if images.get("synthetic") or loader.get("samples_per_s"):
        lines.append(
            f"gpu_check: ResNet-50 synthetic {images.get('synthetic')} images/s, loader "
            f"{loader.get('samples_per_s')} ({loader.get('vs_synthetic')} of it), data wait "
            f"{loader.get('data_wait_fraction')}"
        )
    lines.append(f"gpu_check: failed {summary.get('failed')}; skipped {summary.get('skipped')}")
    lines.append(f"gpu_check: JSON {paths[0]}, table {paths[1]}")
    return "\n".join(lines)


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


def exit_code(report: dict) -> int:
    """0: every check ran (ok or error, in the JSON); 3: some were skipped."""
    statuses = [check["status"] for check in report["checks"].values()]
    return 3 if "skipped" in statuses else 0


def run(
    report: dict,
    plan: Plan,
    work: Path,
    budget: float,
    paths: tuple[Path, Path],
    started: float,
    only: list[str],
    args: argparse.Namespace,
    pythons: dict[str, str],
) -> int:
    """Every check into ``report``, then its summary; the exit code. SIGTERM stops it as Ctrl-C
    does; either way every child still running is killed."""
    ctx = None
    signal.signal(signal.SIGTERM, _interrupted)

    def publish() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        write(report, paths)

    try:
        ctx = Context(plan, work, budget)
        ctx.python.update(pythons)
        ctx.publish = publish
        ctx.only = only
        say(f"torch: {pythons['torch']}; Paddle: {pythons['paddle']}; budget {budget:.0f} s")
        orchestrate(report, ctx, args.wheelhouse.resolve() if args.wheelhouse else None)
        summarize(report)
        return exit_code(report)
    except KeyboardInterrupt:
        report["script_error"] = "interrupted (SIGINT or SIGTERM)"
        with contextlib.suppress(Exception):
            summarize(report)
        return 130
    except Exception:
        report["script_error"] = traceback.format_exc()
        return 1
    finally:
        if ctx is not None:
            ctx.stop()
