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

import contextlib
import errno
import hashlib
import logging
import os
import re
import resource
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from datasets import owner_lock
from datasets.errors import CacheSpaceError
from datasets.handles import process_alive
from datasets.safe_files import refuse_link
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


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.2f} MB" if size < 10e6 else f"{size / 1e6:.0f} MB"


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


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


def _source_files(source_path: str) -> list[tuple[Path, os.stat_result]]:
    """The dataset's files (the file, or every file under the folder) with their stat."""
    paths = sorted(Path(source_path).rglob("*")) if Path(source_path).is_dir() else [source_path]
    return [(Path(path), Path(path).stat()) for path in paths if Path(path).is_file()]


def fingerprint(source_path: str, num_items: int, files=None) -> int:
    """Identity of a dataset version: path, size and mtime of its files (``files``:
    _source_files, read here when not given), and record count."""
    parts = [source_path, str(num_items)]
    for path, stat in _source_files(source_path) if files is None else files:
        parts.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:7], "little")


# What a cached record may take beyond its bytes in the dataset's files: its label as text and
# the entry's framing (encode_record). A disk cache is sized to the dataset's bytes plus this per
# record, or data.cache_max_bytes when that is less: its whole file is reserved on disk at start
# (_reserve), so a limit far above the dataset would hold disk space for nothing. A dataset
# whose records take more than that (a compressed HDF5 dataset) gets a cache that fills up and
# counts the rest as rejected, as any full cache does.
RECORD_FRAMING_BYTES = 64
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}  # the filesystem cannot say


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
        files = _source_files(source_path)
        self._fingerprint = fingerprint(source_path, num_items, files)
        self._source = source_path
        if mode == "disk":  # no bigger than the dataset can fill: it is all reserved (_reserve)
            dataset_bytes = sum(stat.st_size for _, stat in files)
            self.capacity = min(self.capacity, dataset_bytes + RECORD_FRAMING_BYTES * num_items)
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
        # A link at the cache's name is refused: reused, its target would be written to (the
        # new file is made with O_EXCL | O_NOFOLLOW by SharedBlock, and renamed over the name).
        if refuse_link(path).exists():
            block = SharedBlock(path)
            header = block.array(np.int64, 0, _HEADER_ITEMS)
            if (header[H_MAGIC], header[H_ITEMS], header[H_CAPACITY], header[H_FINGERPRINT]) == (
                _MAGIC,
                self.num_items,
                self.capacity,
                self._fingerprint,
            ):
                log.info("reusing disk cache %s (%d bytes filled)", path, header[H_USED])
                stat = os.stat(path)
                if stat.st_blocks * 512 < stat.st_size:  # left sparse by an earlier version
                    try:
                        self._reserve(path)
                    except OSError as error:
                        raise self._no_room(path, error) from error
                return block
        # Build under a temporary name, then rename: a reader never sees a half-initialised file.
        remove_dead_partial_caches(path.parent)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            block = SharedBlock(tmp, self._slab_offset + self.capacity)
            self._reserve(tmp)
        except BaseException as error:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # what it holds is not counted as free below
            if isinstance(error, OSError):
                raise self._no_room(tmp, error) from error
            raise
        self._block = block
        self._initialize()
        os.replace(tmp, path)
        block.path = str(path)
        block._creator_pid = None  # disk caches outlive the run on purpose
        return block

    def _reserve(self, path: Path) -> None:
        """Give the disk cache at ``path`` all its blocks now (posix_fallocate). The cache is a
        memory map, filled by whichever process reads a record first: a page written there when
        the disk has no room for it is a SIGBUS that kills that process (the trainer, or a
        worker, which the trainer then reports as dead on a good sample). Reserved, the fill
        never needs room; without it, CacheSpaceError before any work (exit 4 in the trainer).
        A filesystem that cannot reserve is checked for free space instead. A failure here is
        an error, not a silent fallback to no cache: a run asked for the cache because reading
        the storage every epoch is slow, and the fix (more room, data.cache: memory or none) is
        the user's choice. Raises the OSError, for _no_room."""
        size = self._slab_offset + self.capacity
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in _NO_FALLOCATE or _free_bytes(path.parent) < size:
                raise
            log.info("%s: cannot reserve here; the free space covers its %d bytes", path, size)
        finally:
            os.close(fd)

    def _no_room(self, path: Path, error: OSError) -> Exception:
        """The one-line error of a disk cache that cannot get its bytes at ``path``, or
        ``error`` itself when it is no want of room."""
        folder, size = path.parent, self._slab_offset + self.capacity
        if error.errno == errno.EFBIG:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            room = f"this process's file-size limit is {_megabytes(limit)} (ulimit -f)"
        elif error.errno in (errno.ENOSPC, errno.EDQUOT) or error.errno in _NO_FALLOCATE:
            room = f"{_megabytes(_free_bytes(folder))} are free there"
            if error.errno == errno.EDQUOT:
                room += " but the quota of this user or group is used up"
        else:
            return error
        return CacheSpaceError(
            f"data.cache: disk needs {_megabytes(size)} in {folder} for {self._source} "
            f"(the dataset's bytes, at most data.cache_max_bytes), and {room}",
            "free space there or point data.cache_dir at a larger volume, lower "
            "data.cache_max_bytes, or use data.cache: memory (in /dev/shm) or none",
        )

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
