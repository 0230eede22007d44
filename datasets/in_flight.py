"""Which sample each worker process is working on right now, readable by the main process.

When a DataLoader worker dies (segfault in a decoder, OOM kill, os._exit) or hangs, PyTorch and
Paddle report the worker but not the sample that killed it. Each process writes
(pid, sample index, start time) into its own slot of a shared table before it touches a record
and clears it afterwards, so the main process can say "worker pid 4242 died while reading
sample #1234 (key ..., file ...)" and the user can look at, skip or fix exactly that record.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from datasets.handles import process_alive
from datasets.shared_block import SharedBlock

SLOTS = 256  # loader workers x loaders x restarts of non-persistent workers, with room to spare
IDLE = -1


class InFlightTable:
    def __init__(self, state_dir: str | Path | None = None) -> None:
        state_dir = Path(state_dir) if state_dir else Path(tempfile.gettempdir())
        path = state_dir / f"in-flight-{os.getpid()}-{id(self):x}.state"
        self._block = SharedBlock(path, 8 * 3 * SLOTS)
        self._slot: int | None = None
        self._slot_pid: int | None = None
        self._row: np.ndarray | None = None  # this process's slot, a view into the table

    def _table(self) -> np.ndarray:
        return self._block.array(np.int64, 0, 3 * SLOTS).reshape(SLOTS, 3)

    def _my_slot(self) -> int:
        pid = os.getpid()
        if self._slot is not None and self._slot_pid == pid:
            return self._slot
        table = self._table()
        with self._block.locked():
            free = [i for i in range(SLOTS) if table[i, 0] in (0, pid)]
            if not free:  # reuse the slot of a process that is gone
                free = [i for i in range(SLOTS) if not process_alive(int(table[i, 0]))]
            slot = free[0] if free else pid % SLOTS
            table[slot] = (pid, IDLE, 0)
        self._slot, self._slot_pid = slot, pid
        return slot

    def _my_row(self) -> np.ndarray:
        if self._row is None or self._slot_pid != os.getpid():
            slot = self._my_slot()
            self._row = self._table()[slot]
        return self._row

    def start(self, index: int) -> None:
        row = self._my_row()
        row[2] = time.monotonic_ns()
        row[1] = index

    def done(self) -> None:
        self._my_row()[1] = IDLE

    def busy(self) -> list[tuple[int, int, float, bool]]:
        """(pid, sample index, seconds on it, process alive) for every busy slot."""
        now = time.monotonic_ns()
        rows = []
        for pid, index, started in self._table().copy():
            if pid and index != IDLE:
                rows.append((int(pid), int(index), (now - started) / 1e9, process_alive(int(pid))))
        return rows

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_slot=None, _slot_pid=None, _row=None)
        return state

    def close(self) -> None:
        self._block.unlink()
