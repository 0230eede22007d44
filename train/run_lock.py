"""One run per output directory: a lock that a second run reports at once.

Two runs writing one directory (a replacement pod started while the old one is still
terminating, --auto-resume started twice) would interleave checkpoints, rotate each other's
out and mix their metrics. The writer (global rank 0: the only rank that writes the run
directory) holds ``flock`` on ``<run dir>/.lock`` for its whole life. The kernel releases it
however the process ends, kill -9 included, so a lock is never stale once its holder is gone;
the file keeps the holder's pid, host and start time for the error message only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from datasets import safe_files
from train.errors import OutputDirLockedError

LOCK_NAME = ".lock"


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise OutputDirLockedError naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputDirLockedError(
                f"{self.path.parent} is in use by another run ({holder}). HINT: wait for that "
                "run to end (a replacement pod: until the old one has terminated), stop it, or "
                "give this run another --output-dir"
            ) from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # no holder to name any more
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _open_lock_file(path: Path) -> int:
    """The lock file, opened (created when missing) without following a link: the holder's line
    is written over its start, which through a link planted at ``.lock`` would truncate the
    link's target. An existing lock file is reused, never replaced: replacing it would let a
    second run lock the new file while the first still holds the old one. A hard link (a name
    shared with another file) is refused for the same reason as a symbolic one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | safe_files.NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise safe_files.LinkRefusedError(path) from None
        raise
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink > 1:
        os.close(fd)
        what = "a hard link to another file" if stat.S_ISREG(found.st_mode) else "not a file"
        raise safe_files.LinkRefusedError(path, what)
    return fd


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        holder = {}
    if not holder:
        return "its holder is just starting"
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, started "
        f"{holder.get('started')}: {holder.get('command')}"
    )
