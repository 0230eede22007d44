"""The bad-sample policy: log once, substitute deterministically, count across workers, abort
above a fraction, and write the bad keys to a file a later run can skip.

Anchors do less: PaddleOCR retries a random index forever without saying which record failed,
timm skips up to 20 in a row with a warning, and nobody counts. Counting needs state shared by
all workers, so the counters and a one-byte-per-sample "already reported" map live in a
``SharedBlock`` file created by the main process.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from datasets.errors import (
    BAD_SAMPLE_KINDS,
    BadSampleError,
    DatasetError,
    TooManyBadSamplesError,
    read_utf8,
)
from datasets.safe_files import open_append, refuse_link
from datasets.shared_block import SharedBlock

log = logging.getLogger("datasets.bad_samples")

_K = len(BAD_SAMPLE_KINDS)
# The counters' file, in the temp directory: bad-samples-<creator pid>-<id>.state. A creator
# killed with -9 cannot remove it; the next trainer's start-up sweep does (train/preflight.py).
STATE_FILE_PREFIX = "bad-samples-"
STATE_FILE = re.compile(r"bad-samples-(\d+)-[0-9a-f]+\.state")
# Header (int64): epoch, then per-kind counts for the current epoch, then per-kind run totals.
_EPOCH, _EPOCH_COUNTS, _TOTAL_COUNTS = 0, 1, 1 + _K
_HEADER_ITEMS = 1 + 2 * _K


class BadSampleLog:
    """Shared across the main process and its workers. Created in the main process."""

    def __init__(
        self,
        num_samples: int,
        max_bad_fraction: float = 0.01,
        bad_keys_file: str | Path | None = None,
        state_dir: str | Path | None = None,
    ):
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be within [0, 1], got {max_bad_fraction}")
        self.num_samples = num_samples
        self.max_bad_fraction = max_bad_fraction
        self.bad_keys_file = str(bad_keys_file) if bad_keys_file else None
        if self.bad_keys_file:  # here, in the main process, rather than in a worker's first write
            refuse_link(self.bad_keys_file)
        state_dir = Path(state_dir) if state_dir else Path(tempfile.gettempdir())
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / f"{STATE_FILE_PREFIX}{os.getpid()}-{id(self):x}.state"
        self._block = SharedBlock(path, 8 * _HEADER_ITEMS + num_samples)

    @property
    def limit(self) -> int:
        """Most bad samples an epoch may have before the run aborts."""
        return int(self.max_bad_fraction * self.num_samples)

    def _header(self) -> np.ndarray:
        return self._block.array(np.int64, 0, _HEADER_ITEMS)

    @property
    def epoch(self) -> int:
        return int(self._header()[_EPOCH])

    def start_epoch(self, epoch: int) -> None:
        """Main process, before iterating an epoch: resets the per-epoch counts."""
        header = self._header()
        with self._block.locked():
            header[_EPOCH] = epoch
            header[_EPOCH_COUNTS : _EPOCH_COUNTS + _K] = 0

    def record(
        self, index: int, key: str, source: str, error: BadSampleError, counted: bool
    ) -> None:
        """Note a bad record. ``counted`` is False for records met while looking for a
        substitute: they are reported, but the epoch count is of requested samples only."""
        header = self._header()
        reported = self._block.array(np.uint8, 8 * _HEADER_ITEMS, self.num_samples)
        kind = BAD_SAMPLE_KINDS.index(error.kind)
        with self._block.locked():
            first_time = reported[index] == 0
            reported[index] = 1
            if counted:
                header[_EPOCH_COUNTS + kind] += 1
                header[_TOTAL_COUNTS + kind] += 1
            epoch_bad = int(header[_EPOCH_COUNTS : _EPOCH_COUNTS + _K].sum())
        if first_time:
            log.warning("bad sample #%d key=%s file=%s: %s", index, key, source, error)
            if self.bad_keys_file:
                _append_line(self.bad_keys_file, f"{key}\t{error.kind}\t{source}\t{error.reason}")
        if counted and epoch_bad > self.limit:
            raise TooManyBadSamplesError(self._abort_message(epoch_bad))

    def mark_reported(self, indices) -> None:
        """Records already in the bad-keys file (a resumed run's): not logged or written again."""
        reported = self._block.array(np.uint8, 8 * _HEADER_ITEMS, self.num_samples)
        with self._block.locked():
            reported[list(indices)] = 1

    def add_counts(self, kinds: list[str]) -> None:
        """Count bad samples met before a resume (this epoch's and the run's counts)."""
        header = self._header()
        with self._block.locked():
            for kind in kinds:
                header[_EPOCH_COUNTS + BAD_SAMPLE_KINDS.index(kind)] += 1
                header[_TOTAL_COUNTS + BAD_SAMPLE_KINDS.index(kind)] += 1

    def _abort_message(self, epoch_bad: int) -> str:
        if self.bad_keys_file:
            keys = read_bad_keys(self.bad_keys_file)
            shown = ", ".join(keys[:10]) + (" ..." if len(keys) > 10 else "")
            where = f"first keys: {shown}; all keys in {self.bad_keys_file}"
        else:
            where = "keys are in the warnings above; set a bad-keys file to collect them"
        return (
            f"too many bad samples: {epoch_bad} in epoch {self.epoch} > data.max_bad_fraction "
            f"{self.max_bad_fraction} x {self.num_samples} samples = {self.limit} "
            f"({where}). HINT: run scripts/validate_data.py on the dataset; "
            "fix or regenerate it, or pass the keys file as data.skip_keys_file, or raise "
            "data.max_bad_fraction"
        )

    def exceeded(self) -> str | None:
        """The abort message when this epoch passed the limit (for the main process, which may
        only see a framework's generic "worker raised" error), else None."""
        epoch_bad = int(self._header()[_EPOCH_COUNTS : _EPOCH_COUNTS + _K].sum())
        return self._abort_message(epoch_bad) if epoch_bad > self.limit else None

    def epoch_counts(self) -> dict[str, int]:
        counts = self._header()[_EPOCH_COUNTS : _EPOCH_COUNTS + _K]
        return {k: int(c) for k, c in zip(BAD_SAMPLE_KINDS, counts) if c}

    def total_counts(self) -> dict[str, int]:
        counts = self._header()[_TOTAL_COUNTS : _TOTAL_COUNTS + _K]
        return {k: int(c) for k, c in zip(BAD_SAMPLE_KINDS, counts) if c}

    def distinct_bad(self) -> int:
        """Distinct bad records met so far (requested or tried as substitutes)."""
        return int(self._block.array(np.uint8, 8 * _HEADER_ITEMS, self.num_samples).sum())

    def close(self) -> None:
        self._block.unlink()


def _append_line(path: str, line: str) -> None:
    """One write with O_APPEND: lines from several workers never interleave."""
    fd = open_append(path)  # a link at the bad-keys file's name is refused, not followed
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def read_bad_kinds(path: str | Path) -> dict[str, str]:
    """{key: kind} of a bad-keys file this project wrote (empty when there is none yet)."""
    path = Path(path)
    if not path.is_file():
        return {}
    kinds = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and not line.startswith("#"):
            kinds.setdefault(fields[0], fields[1])
    return kinds


def read_bad_keys(path: str | Path) -> list[str]:
    """Keys (first column) of a bad-keys file written by a previous run or validate_data.py."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(
            f"skip-keys file not found: {path}",
            "set data.skip_keys_file to the "
            "bad_samples.tsv of an earlier run, or remove the setting",
        )
    keys = []
    fix = "point data.skip_keys_file at a bad_samples.tsv this project wrote (UTF-8)"
    for line in read_utf8(path, "skip-keys file", fix).splitlines():
        if line and not line.startswith("#"):
            keys.append(line.split("\t", 1)[0])
    return list(dict.fromkeys(keys))
