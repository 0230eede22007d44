"""One record cache shared by all workers of a loader, bounded by size, with counters.

What is cached is the record as storage returns it (encoded image + label), not the decoded or
augmented sample: random augmentations stay random, and encoded JPEGs are 5-6x smaller than
their pixels, so the same budget holds 5-6x more of the dataset. The cache removes storage
reads (slow disks, network mounts, remote copies) from epoch 2 on.

Modes: ``memory`` keeps the slab in /dev/shm (counts against the container's shm size; the
doctor includes it); ``disk`` keeps it in ``cache_dir`` keyed by the dataset's fingerprint, so a
later run reuses it. Layout of the file: header (int64 x 16), index table (offset, length per
sample; length -1 = absent), then the slab, filled front to back. Entries are never evicted: a
full cache stops admitting and counts the rejection (for a dataset that fits, eviction never
happens; for one that doesn't, a stable cached subset beats churn).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
from pathlib import Path

import numpy as np

from datasets import owner_lock
from datasets.handles import process_alive
from datasets.shared_block import SharedBlock

# The cache's defaults, here once: the dataset builders, the training config's data section
# (train/config/schema.py) and the benchmark's pipelines use these.
DEFAULT_CACHE_DIR = ".cache/data"
DEFAULT_CACHE_MAX_BYTES = 2 << 30

log = logging.getLogger(__name__)

_MAGIC = 0x43414348_45763031  # "CACHEv01"
_HEADER_ITEMS = 16
(H_MAGIC, H_ITEMS, H_CAPACITY, H_USED, H_HITS, H_MISSES, H_INSERTS, H_REJECTED, H_FINGERPRINT) = (
    range(9)
)
Record = tuple[bytes, "str | int"]


# cache: memory's file in /dev/shm is named data-cache-<creator pid>-<id>: the trainer's
# start-up sweep (train/preflight.py) removes those whose creator is gone (a kill -9 skips the
# unlink in close()).
MEMORY_FILE_PREFIX = "data-cache-"
MEMORY_FILE = re.compile(r"data-cache-(\d+)-[0-9a-f]+")
# cache: disk builds records-<fingerprint>.cache under this name first, then renames it.
PARTIAL_DISK_FILE = re.compile(r"records-[0-9a-f]+\.cache\.(\d+)\.partial")


def remove_dead_partial_caches(cache_dir: str | Path) -> list[Path]:
    """Remove the disk caches that a process died building (killed between creating the file
    and renaming it): no process holds their owner's mark (datasets/owner_lock.py) and their pid
    is gone here. A cache being built by a live run, in this PID namespace or another sharing
    the folder, is kept. Returns the removed paths."""
    removed = []
    for entry in _scan(cache_dir):
        match = PARTIAL_DISK_FILE.fullmatch(entry.name)
        if not match or owner_lock.held(entry.path) or process_alive(int(match.group(1))):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue  # removed meanwhile, or another user's
        removed.append(Path(entry.path))
    if removed:
        log.warning(
            "%s: removed %d disk cache(s) that dead processes left half built",
            cache_dir,
            len(removed),
        )
    return removed


def _scan(path: str | Path) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def encode_record(record: Record) -> bytes:
    data, label = record
    kind = b"i" if isinstance(label, (int, np.integer)) else b"s"
    label_bytes = str(label).encode("utf-8")
    return kind + struct.pack("<I", len(label_bytes)) + label_bytes + data


def decode_record(blob: bytes) -> Record:
    (length,) = struct.unpack_from("<I", blob, 1)
    label = blob[5 : 5 + length].decode("utf-8")
    return blob[5 + length :], int(label) if blob[:1] == b"i" else label


def fingerprint(source_path: str, num_items: int) -> int:
    """Identity of a dataset version: path, size and mtime of its files, and record count."""
    parts = [source_path, str(num_items)]
    for path in (
        sorted(Path(source_path).rglob("*")) if Path(source_path).is_dir() else [Path(source_path)]
    ):
        if path.is_file():
            stat = path.stat()
            parts.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:7], "little")


class SharedRecordCache:
    def __init__(
        self,
        mode: str,
        num_items: int,
        capacity_bytes: int,
        source_path: str,
        cache_dir: str | Path = ".cache/data",
    ) -> None:
        if mode not in ("memory", "disk"):
            raise ValueError(f"cache mode must be memory or disk, got {mode!r}")
        self.mode = mode
        self.num_items = num_items
        self.capacity = int(capacity_bytes)
        self._table_offset = _HEADER_ITEMS * 8
        self._slab_offset = self._table_offset + 16 * num_items
        self._fingerprint = fingerprint(source_path, num_items)
        if mode == "memory":
            shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = Path(shm_dir) / f"{MEMORY_FILE_PREFIX}{os.getpid()}-{id(self):x}"
            self._block = SharedBlock(path, self._slab_offset + self.capacity)
            self._initialize()
        else:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            path = Path(cache_dir) / f"records-{self._fingerprint:014x}.cache"
            self._block = self._open_disk_cache(path)

    def _open_disk_cache(self, path: Path) -> SharedBlock:
        if path.exists():
            block = SharedBlock(path)
            header = block.array(np.int64, 0, _HEADER_ITEMS)
            if (header[H_MAGIC], header[H_ITEMS], header[H_CAPACITY], header[H_FINGERPRINT]) == (
                _MAGIC,
                self.num_items,
                self.capacity,
                self._fingerprint,
            ):
                log.info("reusing disk cache %s (%d bytes filled)", path, header[H_USED])
                return block
        # Build under a temporary name, then rename: a reader never sees a half-initialised file.
        remove_dead_partial_caches(path.parent)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        block = SharedBlock(tmp, self._slab_offset + self.capacity)
        self._block = block
        self._initialize()
        os.replace(tmp, path)
        block.path = str(path)
        block._creator_pid = None  # disk caches outlive the run on purpose
        return block

    def _initialize(self) -> None:
        header = self._block.array(np.int64, 0, _HEADER_ITEMS)
        header[:] = 0
        header[H_MAGIC], header[H_ITEMS], header[H_CAPACITY] = _MAGIC, self.num_items, self.capacity
        header[H_FINGERPRINT] = self._fingerprint
        self._table()[:, 1] = -1

    def _table(self) -> np.ndarray:
        return self._block.array(np.int64, self._table_offset, 2 * self.num_items).reshape(-1, 2)

    @property
    def shm_bytes(self) -> int:
        """Bytes this cache may occupy in /dev/shm (0 for the disk mode)."""
        return self._slab_offset + self.capacity if self.mode == "memory" else 0

    def get(self, index: int) -> Record | None:
        header = self._block.array(np.int64, 0, _HEADER_ITEMS)
        with self._block.locked():  # the lock also orders our read after the writer's publish
            offset, length = self._table()[index]
            header[H_HITS if length >= 0 else H_MISSES] += 1
        if length < 0:
            return None
        start = self._slab_offset + int(offset)
        return decode_record(self._block.array(np.uint8, start, int(length)).tobytes())

    def put(self, index: int, record: Record) -> bool:
        blob = encode_record(record)
        header = self._block.array(np.int64, 0, _HEADER_ITEMS)
        with self._block.locked():
            entry = self._table()[index]
            if entry[1] >= 0:
                return True  # another worker cached it meanwhile
            offset = int(header[H_USED])
            if offset + len(blob) > self.capacity:
                header[H_REJECTED] += 1
                return False
            header[H_USED] = offset + len(blob)
            self._block.array(np.uint8, self._slab_offset + offset, len(blob))[:] = np.frombuffer(
                blob, np.uint8
            )
            entry[0], entry[1] = offset, len(blob)  # publish last
            header[H_INSERTS] += 1
        return True

    def stats(self) -> dict[str, int]:
        header = self._block.array(np.int64, 0, _HEADER_ITEMS)
        return {
            "hits": int(header[H_HITS]),
            "misses": int(header[H_MISSES]),
            "inserts": int(header[H_INSERTS]),
            "rejected_full": int(header[H_REJECTED]),
            "bytes_used": int(header[H_USED]),
            "capacity_bytes": self.capacity,
        }

    def reset_counters(self) -> None:
        header = self._block.array(np.int64, 0, _HEADER_ITEMS)
        with self._block.locked():
            header[H_HITS] = header[H_MISSES] = header[H_REJECTED] = 0

    def close(self) -> None:
        self._block.unlink()
