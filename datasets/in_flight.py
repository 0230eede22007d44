"""Which sample each worker process is working on right now, readable by the main process.

When a DataLoader worker dies (segfault in a decoder, OOM kill, os._exit) or hangs, PyTorch and
Paddle report the worker but not the sample that killed it. Each process writes
(pid, sample index, start time) into its own slot of a shared table before it touches a record
and clears it afterwards, so the main process can say "worker pid 4242 died while reading
sample #1234 (key ..., file ...)" and the user can look at, skip or fix exactly that record.

A worker whose code raised on a sample (a transform bug, a dataset that cannot be read) marks
its slot as such before the exception leaves it, so that the main process can tell a worker
that raised (alive, its exception re-raised by the loader) from one that died or hung, whatever
the framework did to the exception's type on the way.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from datasets.handles import process_alive
from datasets.process_id import current_pid
from datasets.shared_block import SharedBlock

SLOTS = 256  # loader workers x loaders x restarts of non-persistent workers, with room to spare
COLUMNS = 4  # pid, sample index, start time (monotonic ns), state
IDLE = -1
# A slot's state: what its process is doing with the sample.
READING = 0  # reading or transforming it
RAISED_DATA_ERROR = 1  # raised a data error (a DatasetError, too many bad samples) on it
RAISED = 2  # raised any other exception on it (a bug in a transform or decoder)
STATES = {READING: "reading", RAISED_DATA_ERROR: "raised a data error on", RAISED: "raised on"}
# The table's file, in the temp directory: in-flight-<creator pid>-<id>.state. A creator killed
# with -9 cannot remove it; the next trainer's start-up sweep does (train/preflight.py).
STATE_FILE_PREFIX = "in-flight-"
STATE_FILE = re.compile(r"in-flight-(\d+)-[0-9a-f]+\.state")


class InFlightTable:
    def __init__(self, state_dir: str | Path | None = None) -> None:
        state_dir = Path(state_dir) if state_dir else Path(tempfile.gettempdir())
        path = state_dir / f"{STATE_FILE_PREFIX}{os.getpid()}-{id(self):x}.state"
        self._block = SharedBlock(path, 8 * COLUMNS * SLOTS)
        self._slot: int | None = None
        self._slot_pid: int | None = None
        self._row: np.ndarray | None = None  # this process's slot, a view into the table
        self._raised_pid: int | None = None  # set in a process whose sample raised

    def _table(self) -> np.ndarray:
        return self._block.array(np.int64, 0, COLUMNS * SLOTS).reshape(SLOTS, COLUMNS)

    def _my_slot(self) -> int:
        pid = current_pid()
        if self._slot is not None and self._slot_pid == pid:
            return self._slot
        table = self._table()
        with self._block.locked():
            free = [i for i in range(SLOTS) if table[i, 0] in (0, pid)]
            if not free:  # reuse the slot of a process that is gone
                free = [i for i in range(SLOTS) if not process_alive(int(table[i, 0]))]
            slot = free[0] if free else pid % SLOTS
            table[slot] = (pid, IDLE, 0, READING)
        self._slot, self._slot_pid = slot, pid
        return slot

    def _my_row(self) -> np.ndarray:
        if self._row is None or self._slot_pid != current_pid():
            slot = self._my_slot()
            self._row = self._table()[slot]
        return self._row

    def start(self, index: int) -> None:
        pid = current_pid()
        if self._raised_pid == pid:
            return  # keep the sample that raised: the loaders read on after an exception
        # The slot of this process (after a fork, the child takes a slot of its own).
        row = self._row if self._slot_pid == pid and self._row is not None else self._my_row()
        row[2] = time.monotonic_ns()
        row[3] = READING
        row[1] = index

    def raised(self, data_error: bool) -> None:
        """The sample being read raised: keep it in the table, marked as such. The first one
        stays: both loaders let a worker go on to its next samples until the trainer, which
        re-raises the exception, shuts them down."""
        if self._raised_pid != current_pid():
            self._my_row()[3] = RAISED_DATA_ERROR if data_error else RAISED
            self._raised_pid = current_pid()

    def done(self) -> None:
        pid = current_pid()
        if self._raised_pid != pid:
            row = self._row if self._slot_pid == pid and self._row is not None else self._my_row()
            row[1] = IDLE

    def busy(self) -> list[tuple[int, int, float, bool]]:
        """(pid, sample index, seconds on it, process alive) for every slot still reading."""
        return [row[:4] for row in self.rows() if row[4] == READING]

    def rows(self) -> list[tuple[int, int, float, bool, int]]:
        """(pid, sample index, seconds on it, process alive, state) for every slot on a sample,
        reading or having raised on it."""
        now = time.monotonic_ns()
        rows = []
        for pid, index, started, state in self._table().copy():
            if pid and index != IDLE:
                alive = process_alive(int(pid))
                rows.append((int(pid), int(index), (now - started) / 1e9, alive, int(state)))
        return rows

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_slot=None, _slot_pid=None, _row=None, _raised_pid=None)
        return state

    def close(self) -> None:
        self._block.unlink()
