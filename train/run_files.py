"""A write to the run directory that fails, above all for want of room, as one line and exit 4.

A full volume (ENOSPC), a used-up quota (EDQUOT) and the process's file-size limit (EFBIG:
``ulimit -f``, a batch system's RLIMIT_FSIZE) make a write fail wherever the run is. Every
writer of the run directory (checkpoints, best/, metrics.jsonl, the scalar log, summary.json,
the plots, config.resolved.yaml) turns its failure into RunFileError or CheckpointError (exit 4,
train/errors.py): one line naming the file, what is left of the room and the fix, after it has
removed what it half wrote. What the run wrote before stays whole (checkpoints, best/, the
complete lines of metrics.jsonl), so ``--resume`` continues from the last checkpoint.

train.log is the exception: it is a copy of what the run prints on stderr, and a logging call
happens anywhere (inside error handling and cleanup too), where raising would make a log line a
crash site. A failed write stops the file with one warning on stderr, and the run goes on until
a write it cannot do without ends it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from train.errors import RunFileError

# The failures that are want of room, and what each is called in the messages.
OUT_OF_ROOM = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file-size limit reached",
}
_PROBE_BYTES = 1 << 20  # what a probe appends at most: past any block the failed write left
_ALMOST_FULL = 1 << 20  # free bytes under which a volume counts as full


def os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind ``error``: itself, or the first in its chain of causes and contexts
    (a library that wraps the OSError of its write)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _probe(path: Path) -> int | None:
    """The errno of a further write to ``path`` (a directory: its largest file, which a failed
    write was filling), found by appending up to 1 MiB of zeros; None when that succeeds. Only
    for files about to be removed."""
    if path.is_symlink():
        return None
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
        if not files:
            return None
        path = max(files, key=lambda p: p.stat().st_size)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunk = bytes(1 << 16)
        for _ in range(_PROBE_BYTES // len(chunk)):
            os.write(fd, chunk)
    except OSError as error:
        return error.errno
    finally:
        os.close(fd)
    return None


def room_errno(error: BaseException, where: Path, probe: Path | None = None) -> int | None:
    """ENOSPC, EDQUOT or EFBIG when ``error``, a failed write under the folder ``where``, was for
    want of room; None otherwise. The errno is the failed write's own; a framework that reports
    a failed write without it (torch.save raises RuntimeError "file write failed") is answered by
    a probe write to ``probe`` (a partial file or folder about to be removed), then by the free
    space left at ``where``."""
    found = os_error(error)
    if found is not None:
        return found.errno if found.errno in OUT_OF_ROOM else None
    if probe is not None and probe.exists():
        probed = _probe(probe)
        if probed in OUT_OF_ROOM:
            return probed
    try:
        return errno.ENOSPC if shutil.disk_usage(where).free < _ALMOST_FULL else None
    except OSError:
        return None


def room_left(code: int, where: Path) -> str:
    """What is left of the room that ran out, for the message."""
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else size_text(limit)
        return f"a file reached this process's file-size limit, {shown} (ulimit -f)"
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return "its free space unknown"
    free = f"{usage.free / 1e6:.0f} MB free of {usage.total / 1e6:.0f} MB"
    if code == errno.EDQUOT:
        return f"the quota of this user or group is used up; {free} on the volume"
    return free


def size_text(size: int) -> str:
    """``size`` bytes for a message."""
    return f"{size} bytes" if size < 1e6 else f"{size / 1e6:.3g} MB"


def room_fix(code: int) -> str:
    """What gives the run room again."""
    if code == errno.EFBIG:
        return "raise the file-size limit (ulimit -f unlimited, the job's RLIMIT_FSIZE)"
    what = "quota" if code == errno.EDQUOT else "space"
    return f"free {what} or give the run directory a larger volume, lower train.keep_last"


def one_line(text: str) -> str:
    """``text`` on one line (a framework's message can span several)."""
    return " ".join(text.split())


def write_failed(
    path: Path, error: BaseException, note: str = "", then: str = "continue with --resume"
) -> RunFileError:
    """The error that ends the run when ``path`` of the run directory could not be written;
    ``note`` says what the run still has, ``then`` what to do once the fix is made."""
    path = Path(path)
    code = room_errno(error, path.parent)
    note = f"; {note}" if note else ""
    if code is not None:
        return RunFileError(
            f"{OUT_OF_ROOM[code]}: could not write {path} ({room_left(code, path.parent)})"
            f"{note}. HINT: {room_fix(code)}, then {then}"
        )
    found = os_error(error) or error
    reason = getattr(found, "strerror", None) or one_line(str(found))[:300]
    return RunFileError(
        f"could not write {path}: {type(found).__name__}: {reason}{note}. HINT: check that the "
        f"run directory is writable (permissions, a read-only or lost mount), then {then}"
    )


@contextlib.contextmanager
def writing(
    path: Path, partial: Path | None = None, note: str = "", then: str = "continue with --resume"
) -> Iterator[None]:
    """Around the writes of the run file ``path``: an OSError becomes write_failed's
    RunFileError, after ``partial`` (the file being written before its rename) is removed."""
    try:
        yield
    except OSError as error:
        if error.errno == errno.ELOOP:  # a link refused at the name: its own error (exit 4)
            raise
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        raise write_failed(path, error, note, then) from error


def append(fd: int, path: Path, data: bytes) -> None:
    """Append ``data`` to the file open as ``fd`` (O_APPEND) whole or not at all: a write that
    fails part way (the disk filling in the middle of a line) is cut back off, so that a reader
    of the file (report.read_metrics, a later --resume appending to it) never meets half a
    line. RunFileError naming ``path`` when it fails."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as error:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise write_failed(path, error) from error


def _cut_to_whole_lines(path: Path) -> None:
    """Cut ``path`` back to its last complete line: a write that failed part way leaves half a
    line at its end."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - (1 << 16))
            tail = os.pread(fd, size - start, start)
            if tail and not tail.endswith(b"\n"):
                os.ftruncate(fd, start + tail.rfind(b"\n") + 1)
        finally:
            os.close(fd)


def room_errors_of_threads_in_one_line() -> None:
    """A library's writer thread (the scalar log's: TensorBoard's event writer) that dies of
    want of room prints one warning line instead of its traceback. The library raises the same
    error again in the training thread at its next call, where it ends the run with exit 4
    (Telemetry: RunFileError naming the scalar log), unless a write of the run's own fails
    first. Any other failure of a thread prints as before."""
    previous = threading.excepthook
    if getattr(previous, "room_errors_in_one_line", False):
        return

    def hook(args) -> None:
        error = args.exc_value
        if not (isinstance(error, OSError) and error.errno in OUT_OF_ROOM):
            previous(args)
            return
        thread = args.thread
        name = f"{thread.name} ({type(thread).__name__})" if thread is not None else "a thread"
        print(f"warning: {name} stopped: {OUT_OF_ROOM[error.errno]}: {error}", file=sys.stderr)

    hook.room_errors_in_one_line = True
    threading.excepthook = hook


def stop_on_write_failure(handler: logging.FileHandler) -> logging.FileHandler:
    """``handler`` (train.log) made to stop at its first failed write with one warning on
    stderr, instead of logging's traceback on every later record (see the module's docstring for
    why the run goes on)."""
    default = handler.handleError

    def handle_error(record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            default(record)
            return
        stream, handler.stream = handler.stream, None
        handler.emit = lambda record: None  # closed for good, not reopened by FileHandler.emit
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # its buffer cannot be written either
                stream.close()
        _cut_to_whole_lines(Path(handler.baseFilename))
        code = error.errno if error.errno in OUT_OF_ROOM else None
        why = (
            f"{OUT_OF_ROOM[code]} ({room_left(code, Path(handler.baseFilename).parent)})"
            if code is not None
            else one_line(str(error))
        )
        print(
            f"warning: {handler.baseFilename} is no longer written: {why}; the log goes on on "
            "stderr",
            file=sys.stderr,
        )

    handler.handleError = handle_error
    return handler
