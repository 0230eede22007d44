"""What the commands share: logging, the report of a native crash, and the one table from a
failure to its message and exit code (train/errors.py), for python -m train, the commands after
training (train.evaluate, train.export, train.predict), train.tune, the doctor and
python -m train.config."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from train import errors

log = logging.getLogger("train")


def message_of(exc: BaseException) -> str:
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
        print(f"error: {message_of(exc)}", file=sys.stderr)
        for line in found["raised_data_error"]:
            print(f"  {line}", file=sys.stderr)
        return errors.EXIT_DATA
    if found.get("raised"):
        print(
            "error: the code that reads and transforms a sample raised (a bug, not a dead "
            f"worker): {message_of(exc)}",
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
            f"on one): {message_of(exc)}",
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
    print(f"error: data loader failed: {message_of(exc)}", file=sys.stderr)
    for line in culprits:
        print(f"  {line}", file=sys.stderr)
    print(
        "HINT: check that record with scripts/validate_data.py; add its key to "
        "data.skip_keys_file to skip it; for a kill by signal 9, check the memory "
        "limit (dmesg, docker stats)",
        file=sys.stderr,
    )
    return errors.EXIT_WORKER


def failure_exit_code(
    exc: BaseException, data=None, hung_after_s: float | None = None
) -> int | None:
    """Print a failure of a known kind (its message names the fix) and return its exit code
    (train/errors.py), or None for a bug: the caller re-raises it, with its traceback.
    ``data`` is the run's data (train.data.RunData) once built: a failure the loader re-raised
    from a process reading samples is then sorted by what that process was doing."""
    code = errors.exit_code(exc)
    if code == errors.EXIT_CONFIG:
        print(exc, file=sys.stderr)  # one line already, with its file and key
        return code
    too_many = data.train.bad_log.exceeded() if data is not None else None
    if code == errors.EXIT_DATA and too_many:  # the count's own message, whoever raised
        print(f"error: {too_many}", file=sys.stderr)
        return code
    if code == errors.EXIT_DATA:  # torch re-raises a worker's with its traceback as text
        print(f"error: {message_of(exc)}", file=sys.stderr)
        return code
    if code is not None:
        print(f"error: {exc}", file=sys.stderr)
        return code
    if data is None:
        return None
    return loader_failure(exc, data, hung_after_s)


def run_command(body: Callable[[], int], unusable: tuple[type[BaseException], ...] = ()) -> int:
    """``body()``, the work of a command after training (train.evaluate, train.export,
    train.predict), with a failure of a known kind printed and returned as its exit code.
    Exceptions of the ``unusable`` classes are a model, a checkpoint or weights the command
    cannot use: exit 4, as a checkpoint python -m train cannot read. Anything else is a bug
    and keeps its traceback."""
    from datasets.errors import BadSampleError

    try:
        return body()
    except Exception as exc:
        if errors.exit_code(exc) is None:
            if isinstance(exc, BadSampleError):  # an input to predict that does not decode
                print(f"error: {message_of(exc)}", file=sys.stderr)
                return errors.EXIT_DATA
            if isinstance(exc, unusable):
                print(f"error: {exc}", file=sys.stderr)
                return errors.EXIT_CHECKPOINT
        code = failure_exit_code(exc)
        if code is None:
            raise
        return code


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


def report_native_crashes() -> None:
    """A crash in native code (a segfault, glibc's abort on a corrupted heap) ends the process
    with no Python traceback. faulthandler prints every thread's Python stack to stderr first,
    so that the log says what the run was doing; the process then dies of the signal. The fatal
    signals go back to their default action before faulthandler is armed, so that nothing runs
    after its report: Paddle's import installs crash handlers that print a C++ stack, but they
    are no async-signal-safe code, and called from a crash they printed nothing, died of
    glibc's loader assertion (exit 127) or hung past two minutes, and a
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
