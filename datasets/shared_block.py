"""A file mapped into every process that uses it, with an exclusive lock for updates.

This is how workers share one cache and one set of counters without a server process: the
main process creates the file, workers (forked or spawned) map it lazily by path, and
``fcntl.flock`` serializes updates. flock works across fork and spawn, needs nothing pickled but
the path, and is released by the kernel if a worker dies holding it, so a killed worker cannot
deadlock the others. Reads of published data need no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from datasets import owner_lock, safe_files
from datasets.process_id import current_pid


def _create_exclusive(path: str, size: int) -> int:
    """A new file at ``path`` of ``size`` zero bytes, created by this call and carrying the
    owner's mark from its first moment (owner_lock.create_marked: never through a symlink, never
    over an existing name): these files live in shared, world-writable folders (/dev/shm, /tmp),
    where opening a planted name with O_TRUNC would truncate whatever it points to. A regular
    file of our own already there is a leftover of an earlier process whose pid and object id
    this one reuses: it is replaced. Anything else (a symlink, another user's file) is refused."""
    try:
        return owner_lock.create_marked(path, size)
    except FileExistsError:
        found = os.lstat(path)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            raise FileExistsError(
                f"{path} already exists and is not a file of ours (a symlink or another user's "
                "file in a shared folder): not opened. Remove it, or point the run's shared "
                "files elsewhere (TMPDIR for state files; /dev/shm is the memory cache's)"
            ) from None
        os.unlink(path)
        return owner_lock.create_marked(path, size)


class SharedBlock:
    def __init__(self, path: str | Path, size: int | None = None) -> None:
        """Create the file with ``size`` zero bytes (sparse), or attach to it when size is None."""
        self.path = str(path)
        self._creator_pid = os.getpid() if size is not None else None
        # The creator keeps one descriptor with the owner's mark (datasets/owner_lock.py) until
        # unlink() or its death: the start-up sweep never takes the file of a live run.
        self._owner_fd: int | None = None
        if size is not None:
            self._owner_fd = _create_exclusive(self.path, size)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._pid: int | None = None

    def _mapped(self) -> mmap.mmap:
        if self._map is None or self._pid != current_pid():
            try:  # by name in every process: a link put in the file's place is not followed
                self._fd = os.open(self.path, os.O_RDWR | safe_files.NOFOLLOW)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise safe_files.LinkRefusedError(self.path) from None
                raise
            self._map = mmap.mmap(self._fd, 0)
            self._pid = current_pid()
        return self._map

    def array(self, dtype, offset: int, count: int) -> np.ndarray:
        """A writable numpy view of ``count`` items at byte ``offset`` of the shared file."""
        return np.frombuffer(self._mapped(), dtype=dtype, count=count, offset=offset)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self._mapped()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unlink(self) -> None:
        """Remove the file; only the creating process does (workers just drop their mapping)."""
        if self._creator_pid == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            if self._owner_fd is not None:
                os.close(self._owner_fd)
                self._owner_fd = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_fd=None, _map=None, _pid=None, _owner_fd=None)
        return state
