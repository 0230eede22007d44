r"""Train the OCR recognizer or ResNet-50 with PaddlePaddle or PyTorch, from one YAML config.

    python -m train --config configs/ocr/smoke.yaml
    python -m train --config configs/resnet50/smoke.yaml --set framework=paddle
    torchrun --nproc-per-node 2 -m train --config configs/resnet50/multi_gpu.yaml
    python -m paddle.distributed.launch --gpus 0,1 \
        --log_dir runs/ocr-paddle-multi_gpu/launch-logs \
        train/__main__.py --config configs/ocr/multi_gpu.yaml

Exit codes (train/errors.py): 0 done; 1 a bug (a traceback follows); 2 bad config or command
line; 3 data problem (dataset unreadable or malformed, too many bad samples); 4 checkpoint or
disk problem (a checkpoint, best/ or a run file could not be written, e.g. disk full, a quota or
the file-size limit; no usable checkpoint to resume; a disk cache without its room); 5 /dev/shm
too small for the config (shm.policy fail); 6 a loader worker died or hung (the error names the
sample it was on); 7 train.device asks for a GPU this process cannot use (the error says why);
8 the loss was NaN/Inf (train.nonfinite); 9 out of memory in a step; 10 another run holds the
output directory; 143 / 130 stopped by SIGTERM / SIGINT after saving a checkpoint (continue
with --resume).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path

# paddle.distributed.launch runs this file as a script (it has no module mode): `train` then
# imports from the installed project (pip install --no-deps -e .), or from PYTHONPATH.
from train import cli

log = logging.getLogger("train")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from train.config.load import add_overrides_argument

    parser = argparse.ArgumentParser(
        prog="python -m train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", required=True, help="scenario YAML, e.g. configs/ocr/smoke.yaml"
    )
    add_overrides_argument(parser)
    parser.add_argument("--output-dir", help="run directory (default: output.dir of the config)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    group.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue from the latest checkpoint if there is one, else start a new run "
        "(for jobs that restart: Kubernetes backoffLimit, compose restart policies)",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="empty the run directory and start over (only a run directory: one holding the "
        ".starved-run marker the trainer writes, or a run's own files)",
    )
    return parser.parse_args(argv)


def output_dir_key(args) -> str:
    """Where the run directory came from, for its error messages."""
    return "output.dir" if args.output_dir is None else "--output-dir"


def prepare_run_dir(run_dir: Path, args, is_main: bool) -> None:
    """Refuse a directory holding a run unless --resume/--auto-resume/--overwrite says what to
    do with it; --overwrite empties it (run_dirs.clear: only a run directory, never another
    folder); the main rank marks it as a run directory."""
    from train import checkpoint, run_dirs

    if checkpoint.latest(run_dir) is not None and not (
        args.resume or args.auto_resume or args.overwrite
    ):
        raise SystemExit(
            f"error: {run_dir} already holds a run. HINT: pass --resume to continue it, "
            "--overwrite to start over, or --output-dir for a new run"
        )
    if args.overwrite and is_main and run_dir.exists():
        run_dirs.clear(run_dir, output_dir_key(args))
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        run_dirs.mark(run_dir)


def should_auto_resume(run_dir: Path) -> bool:
    """--auto-resume: resume when the run directory holds a complete checkpoint. Every rank
    decides from the same (shared) run directory after the barrier, so they agree."""
    from train import checkpoint

    found = checkpoint.latest(run_dir)
    if found is None:
        log.info("--auto-resume: no checkpoint in %s yet, starting a new run", run_dir)
    return found is not None


class Held:
    """What main() has to close however the run ends."""

    backend = None
    data = None
    config = None
    lock = None


def main(argv: list[str] | None = None) -> int:
    cli.report_native_crashes()
    args = parse_args(argv)
    from train.stops import LEFTOVER_WORKER_GRACE_S, StopRequested, end_leftover_workers

    held = Held()
    try:
        return run(args, held)
    except StopRequested as exc:
        log.warning("%s; continue with --resume", exc)
        killed = end_leftover_workers()
        if killed:
            log.warning(
                "loader worker(s) %s still running %.0f s after the stop's checkpoint: killed "
                "(the checkpoint is complete)",
                ", ".join(map(str, killed)),
                LEFTOVER_WORKER_GRACE_S,
            )
        return 130 if exc.signal_name == "SIGINT" else 143
    except Exception as exc:
        # Torch's SIGCHLD handler raises for every further worker exit, and one that landed
        # while this block sorted the failure replaced it with its own RuntimeError (exit 1 for
        # a dead worker's exit 6). The run is failing anyway: restore the default first.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        timeout = (held.config.loader.timeout_s or None) if held.config is not None else None
        code = cli.failure_exit_code(exc, held.data, timeout)
        if code is None:
            raise
        return code
    finally:
        if held.data is not None:
            held.data.close()
        if held.backend is not None:
            held.backend.runtime.shutdown()
        if held.lock is not None:
            held.lock.release()


def run(args, held: Held) -> int:
    """The run, start to end; failures of a known kind are raised as such (train.errors)."""
    from datasets.safe_files import write_atomic
    from train import loop, preflight, report, run_dirs, run_files, stall
    from train.backends import launcher_dist, make_backend
    from train.config.load import RESOLVED_NAME, load_config, save_resolved
    from train.data import RunData, resolve
    from train.run_lock import RunLock

    loaded = held.config = load_config(args.config, args.overrides)
    launched = launcher_dist(loaded.framework)
    text = loaded.output.dir if args.output_dir is None else args.output_dir
    run_dir = Path(text)
    if launched.rank == 0:  # the only rank that writes the run directory
        # Before anything is read or written: a directory that is no run directory (a mistyped
        # path, ".", an empty output.dir) is refused before the lock creates a file in it.
        run_dirs.check(text, args.overwrite, output_dir_key(args))
        held.lock = RunLock(run_dir).acquire()  # first: a second run fails before any work
    cli.setup_logging(None, launched.rank == 0)
    # Remote (s3://) data is staged before the backend imports its framework: a framework's
    # bundled zlib (Paddle's) could break the S3 client's compression otherwise.
    resolved = resolve(loaded, local_world_size=launched.local_world_size)
    faulthandler.disable()  # the framework's import installs its crash handlers over the defaults
    backend = make_backend(resolved.config)
    cli.report_native_crashes()  # over the framework's crash handlers
    dist = backend.runtime.init_distributed()
    held.backend = backend
    cli.setup_logging(None, dist.is_main)
    prepare_run_dir(run_dir, args, dist.is_main)
    backend.runtime.barrier()
    resume = args.resume or (args.auto_resume and should_auto_resume(run_dir))
    cli.setup_logging(run_dir, dist.is_main)
    run_files.room_errors_of_threads_in_one_line()  # the scalar log's writer thread
    if dist.is_main:  # the config as written (s3:// URLs, "auto"): a rerun resolves it again
        with run_files.writing(run_dir / RESOLVED_NAME, then="run the same command again"):
            save_resolved(loaded, run_dir)
    log.info(
        "run %s: %s %s on %s, %d rank(s)",
        run_dir,
        loaded.task,
        loaded.framework,
        backend.runtime.device_name,
        dist.world_size,
    )
    backend.runtime.seed_everything(loaded.seed, loaded.deterministic)
    log.info("num_workers=%d (%s)", resolved.config.loader.num_workers, resolved.workers_reason)
    if dist.local_rank == 0:  # one sweep per node, before any worker of this run exists
        preflight.remove_stale_batches()
        preflight.remove_stale_state_files()
    # The run's loaders fitted to this node's free /dev/shm (shm.policy), logged into train.log.
    config = held.config = preflight.apply_policy(resolved.config, dist.local_world_size)
    held.data = RunData.open(config, run_dir)
    source = (args.config, args.overrides)  # what loader.autotune's tuned.yaml extends
    summary = loop.train(config, backend, dist, held.data, run_dir, resume, source)
    if "loader_bottleneck" in summary:  # the loader held this run: the tuner for its scenario
        tune = stall.tune_command(args.config, args.overrides)
        ordered = {}
        for key, value in summary.items():
            ordered[key] = value
            if key == "loader_bottleneck":  # the command right under the sentence
                ordered["loader_tune"] = tune
        summary = ordered
    if dist.is_main:
        with run_files.writing(run_dir / "summary.json"):
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
        plots = report.write_plots(run_dir) if config.output.plots else []
        print(report.summary_table({"run_dir": str(run_dir), **summary}))
        print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {', '.join(map(str, plots))}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
