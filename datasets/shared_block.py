"""A file mapped into every process that uses it, with an exclusive lock for updates.

This is how workers share one cache and one set of counters without a server process: the
main process creates the file, workers (forked or spawned) map it lazily by path, and
``fcntl.flock`` serializes updates. flock works across fork and spawn, needs nothing pickled but
the path, and is released by the kernel if a worker dies holding it, so a killed worker cannot
deadlock the others. Reads of published data need no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from datasets.process_id import current_pid


class SharedBlock:
    def __init__(self, path: str | Path, size: int | None = None) -> None:
        """Create the file with ``size`` zero bytes (sparse), or attach to it when size is None."""
        self.path = str(path)
        self._creator_pid = os.getpid() if size is not None else None
        if size is not None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._pid: int | None = None

    def _mapped(self) -> mmap.mmap:
        if self._map is None or self._pid != current_pid():
            self._fd = os.open(self.path, os.O_RDWR)
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

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_fd=None, _map=None, _pid=None)
        return state
