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
import contextlib
import faulthandler
import functools
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

# paddle.distributed.launch runs this file as a script (it has no module mode): `train` then
# imports from the installed project (pip install --no-deps -e .), or from PYTHONPATH.
from train import errors

log = logging.getLogger("train")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from train.config import add_overrides_argument

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


def one_line(exc: BaseException) -> str:
    """The message a user needs, without a worker's re-raised traceback around it (display
    only: which kind of failure it is comes from its class or the loader's in-flight table)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error: " in line and not line.startswith("File "):
            return line.split("Error: ", 1)[1]
    return lines[-1] if lines else type(exc).__name__


def loader_report(data, hung_after_s: float | None) -> dict[str, list[str]]:
    """What the processes reading samples were doing when the loader failed, by kind (see
    RecordDataset.describe_in_flight); empty lists when no dataset was built."""
    datasets = [d for d in (data.train, data.val) if d is not None] if data is not None else []

    def collect() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for dataset in datasets:
            for kind, lines in dataset.describe_in_flight(hung_after_s).items():
                found.setdefault(kind, []).extend(lines)
        return found

    # A worker killed by a signal can still be tearing down (freeing its memory) when the
    # loader notices the broken pipe: give it a moment to be dead before calling it alive.
    # Who is alive is read before the table: a worker that dies in between is then found dead
    # by collect(), not missed by both.
    deadline = time.monotonic() + 3.0
    while True:
        any_alive = any(alive for d in datasets for *_, alive in d.in_flight.busy())
        found = collect()
        if any(found.values()) or not any_alive or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


# How torch ("DataLoader worker (pid 12) is killed by signal", "... (pid(s) 12) exited
# unexpectedly") and Paddle ("DataLoader process (pid 12) exited ...") report a dead worker.
FRAMEWORK_WORKER_DIED = re.compile(r"DataLoader (?:worker|process) \(pid")


def loader_failure(exc: BaseException, data, hung_after_s: float | None) -> int | None:
    """An exception the loader re-raised from a process reading samples: print what it was and
    return its exit code, or None when it is a bug (the caller re-raises it: a traceback).
    A worker is named as dead or hung only when the in-flight table shows one that is."""
    too_many = data.train.bad_log.exceeded() if data is not None else None
    if too_many:  # raised in a worker; Paddle's own error does not carry the message
        print(f"error: {too_many}", file=sys.stderr)
        return errors.EXIT_DATA
    found = loader_report(data, hung_after_s)
    if found.get("raised_data_error"):
        print(f"error: {one_line(exc)}", file=sys.stderr)
        for line in found["raised_data_error"]:
            print(f"  {line}", file=sys.stderr)
        return errors.EXIT_DATA
    if found.get("raised"):
        print(
            "error: the code that reads and transforms a sample raised (a bug, not a dead "
            f"worker): {one_line(exc)}",
            file=sys.stderr,
        )
        for line in found["raised"]:
            print(f"  {line}", file=sys.stderr)
        return None
    culprits = found.get("died", []) + found.get("hung", [])
    if not culprits and FRAMEWORK_WORKER_DIED.search(str(exc)):
        # The frameworks' own words for a dead worker, with no sample in flight: it died
        # between samples (waiting for work, handing a batch over), so no record is to blame.
        print(
            "error: a data loader worker died while it held no sample (between samples, not "
            f"on one): {one_line(exc)}",
            file=sys.stderr,
        )
        print(
            "HINT: a kill by signal 9 is most often the memory limit (dmesg, docker stats); "
            "continue from the last checkpoint with --resume",
            file=sys.stderr,
        )
        return errors.EXIT_WORKER
    if not culprits:
        return None
    print(f"error: data loader failed: {one_line(exc)}", file=sys.stderr)
    for line in culprits:
        print(f"  {line}", file=sys.stderr)
    print(
        "HINT: check that record with scripts/validate_data.py; add its key to "
        "data.skip_keys_file to skip it; for a kill by signal 9, check the memory "
        "limit (dmesg, docker stats)",
        file=sys.stderr,
    )
    return errors.EXIT_WORKER


def setup_logging(run_dir: Path | None, is_main: bool) -> None:
    from datasets.safe_files import AppendFileHandler
    from train import run_files

    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None and is_main:
        log_file = AppendFileHandler(run_dir / "train.log")  # a link there: refused
        handlers.append(run_files.stop_on_write_failure(log_file))  # a full disk: a warning
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
    )


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


def report_native_crashes() -> None:
    """A crash in native code (a segfault, glibc's abort on a corrupted heap) ends the process
    with no Python traceback. faulthandler prints every thread's Python stack to stderr first,
    so that the log says what the run was doing; the process then dies of the signal. The fatal
    signals go back to their default action before faulthandler is armed, so that nothing runs
    after its report: Paddle's import installs crash handlers that print a C++ stack, but they
    are no async-signal-safe code, and called from a crash they printed nothing, died of
    glibc's loader assertion (exit 127) or hung past two minutes (CI hosts saw each), and a
    crashed trainer that hangs holds its GPUs until someone kills it. run() arms it again after
    the framework's import, which replaces it. Loader workers inherit it; the frameworks install
    their own handlers there.

    Arming faulthandler also gives this thread an alternate signal stack, and the stop handlers
    need one: torch 2.6's oneDNN runs its CPU f32 GEMMs (an LSTM's, for one) with the stack
    register pointing into a heap buffer, so a SIGTERM handled on the normal stack writes its
    frame over the heap and glibc aborts on "corrupted size vs. prev_size" (oneDNN's report:
    https://github.com/uxlfoundation/oneDNN/issues/4845, fixed upstream after the oneDNN 3.5.3
    that torch 2.6 bundles). CPython installs its
    handlers with SA_ONSTACK, so the frames go to faulthandler's stack instead
    (tests/test_signal_frames.py; docs/reliability.md). A stderr without a file descriptor (a
    notebook's stream) gets no report, but faulthandler is armed on os.devnull for the stack."""
    with contextlib.suppress(ValueError):  # off the main thread: leave the handlers as they are
        for fatal in FATAL_SIGNALS:
            signal.signal(fatal, signal.SIG_DFL)
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):
        log.debug("no native crash report: stderr has no file descriptor")
        faulthandler.enable(file=_devnull(), all_threads=True)


@functools.cache
def _devnull():
    """One open os.devnull for faulthandler (it writes to the descriptor, which must stay open)."""
    return open(os.devnull, "w")  # noqa: SIM115 - held for the process's life


# The signals faulthandler reports (its own list): each dies of itself after the report.
FATAL_SIGNALS = (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL)


def main(argv: list[str] | None = None) -> int:
    report_native_crashes()
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
        code = errors.exit_code(exc)
        if code == errors.EXIT_CONFIG:
            print(exc, file=sys.stderr)
            return code
        too_many = held.data.train.bad_log.exceeded() if held.data is not None else None
        if code == errors.EXIT_DATA and too_many:  # the count's own message, whoever raised
            print(f"error: {too_many}", file=sys.stderr)
            return code
        if code == errors.EXIT_DATA:  # torch re-raises a worker's with its traceback as text
            print(f"error: {one_line(exc)}", file=sys.stderr)
            return code
        if code is not None:
            print(f"error: {exc}", file=sys.stderr)
            return code
        if held.data is None:
            raise
        timeout = held.config.loader.timeout_s or None
        code = loader_failure(exc, held.data, timeout)
        if code is None:
            raise
        return code
    finally:
        if held.data is not None:
            held.data.close()
        if held.backend is not None:
            held.backend.shutdown()
        if held.lock is not None:
            held.lock.release()


def run(args, held: Held) -> int:
    """The run, start to end; failures of a known kind are raised as such (train.errors)."""
    from datasets.safe_files import write_atomic
    from train import loop, preflight, report, run_dirs, run_files, stall
    from train.backends import launcher_rank, make_backend
    from train.config import RESOLVED_NAME, load_config, save_resolved
    from train.cpus import resolve_loader
    from train.data import build_run_data, stage_remote
    from train.run_lock import RunLock

    config = held.config = load_config(args.config, args.overrides)
    text = config.output.dir if args.output_dir is None else args.output_dir
    run_dir = Path(text)
    if launcher_rank(config.framework) == 0:  # the only rank that writes the run directory
        # Before anything is read or written: a directory that is no run directory (a mistyped
        # path, ".", an empty output.dir) is refused before the lock creates a file in it.
        run_dirs.check(text, args.overwrite, output_dir_key(args))
        held.lock = RunLock(run_dir).acquire()  # first: a second run fails before any work
    # Remote (s3://) data is staged before the backend imports its framework: a framework's
    # bundled zlib (Paddle's) could break the S3 client's compression otherwise.
    setup_logging(None, launcher_rank(config.framework) == 0)
    local_data = stage_remote(config)
    faulthandler.disable()  # the framework's import installs its crash handlers over the defaults
    backend = make_backend(config)
    report_native_crashes()  # over the framework's crash handlers
    dist = backend.init_distributed()
    held.backend = backend
    setup_logging(None, dist.is_main)
    prepare_run_dir(run_dir, args, dist.is_main)
    backend.barrier()
    resume = args.resume or (args.auto_resume and should_auto_resume(run_dir))
    setup_logging(run_dir, dist.is_main)
    run_files.room_errors_of_threads_in_one_line()  # the scalar log's writer thread
    if dist.is_main:
        with run_files.writing(run_dir / RESOLVED_NAME, then="run the same command again"):
            save_resolved(config, run_dir)
    log.info(
        "run %s: %s %s on %s, %d rank(s)",
        run_dir,
        config.task,
        config.framework,
        backend.device_name,
        dist.world_size,
    )
    backend.seed_everything(config.seed, config.deterministic)
    config, reason = resolve_loader(config, local_world_size=dist.local_world_size)
    log.info("num_workers=%d (%s)", config.loader.num_workers, reason)
    if dist.local_rank == 0:  # one sweep per node, before any worker of this run exists
        preflight.remove_stale_batches()
        preflight.remove_stale_state_files()
    config = preflight.apply_policy(config, dist.local_world_size)
    held.data = build_run_data(config, run_dir, local_data)
    summary = loop.train(config, backend, dist, held.data, run_dir, resume)
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
