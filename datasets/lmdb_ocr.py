"""OCR LMDB datasets in the layout of PaddleOCR and the public CRNN benchmark LMDBs.

Each LMDB holds ``num-samples`` (ASCII int) and, for n = 1..num-samples, ``image-%09d``
(encoded image bytes) and ``label-%09d`` (UTF-8 text). Our writer adds ``schema-version``;
LMDBs without it (everything public) load unchanged. A dataset path is one LMDB directory or a
tree of them (every folder holding a ``data.mdb``), read in sorted path order.

Per-sample metadata is O(number of LMDBs), not O(samples): the global index maps to
(LMDB, record) with one searchsorted over a small int64 array.
"""

from __future__ import annotations

import bisect
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np

from datasets import SCHEMA_VERSION
from datasets.errors import BadSampleError, DatasetError
from datasets.handles import ProcessLocalHandle, record_open
from datasets.safe_files import refuse_link, remove_stale

WRITER_HINT = "write one with scripts/make_synthetic.py ocr or scripts/convert.py paddleocr-labels"
_META_PAGES = 2
# A label is one text line: anything longer is a bad sample (label_too_long) before it is decoded
# or encoded, whatever max_text_length says (a text line of 64 kB is no text line).
MAX_LABEL_BYTES = 1 << 16
# num-samples is a count of records: more digits than an int64 holds is no count (and Python
# refuses to parse an int of over 4300 digits at all).
_MAX_COUNT_DIGITS = 18


def lmdb_dirs(root: Path) -> Iterator[Path]:
    """The LMDB directories of the directory ``root``: ``root`` itself when it holds a data.mdb,
    else each folder below it that holds one (links to folders are not followed). A generator:
    datasets/sources.py asks only whether there is a first one, to tell an OCR LMDB (tree) from
    an image folder by the same rule this reader opens it by."""
    if (root / "data.mdb").is_file():
        yield root
        return
    for folder, _, files in os.walk(root):
        if "data.mdb" in files:
            yield Path(folder)


def find_lmdbs(root: str | Path) -> list[Path]:
    """The LMDB directories at or below ``root``, sorted."""
    root = Path(root)
    if not root.exists():
        raise DatasetError(f"OCR dataset path does not exist: {root}", WRITER_HINT)
    if root.is_file():
        raise DatasetError(
            f"{root} is a file; an OCR LMDB is a directory holding data.mdb", WRITER_HINT
        )
    found = sorted(lmdb_dirs(root))
    if not found:
        raise DatasetError(f"no LMDB (no data.mdb) found under {root}", WRITER_HINT)
    return found


def _check_not_truncated(env: lmdb.Environment, path: Path) -> None:
    """A truncated data.mdb would raise SIGBUS on the first read past its end (the file is
    memory-mapped), killing the process with a bus error. Compare the size the LMDB's own meta
    page promises with the size on disk before any read."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    actual = os.path.getsize(path / "data.mdb")
    if actual < needed:
        env.close()
        raise DatasetError(
            f"truncated LMDB file {path / 'data.mdb'}: {actual} bytes on disk, {needed} expected",
            "the copy or download was interrupted; copy the dataset again and check it with "
            "scripts/validate_data.py",
        )


def open_lmdb_readonly(path: str | Path) -> lmdb.Environment:
    """Read-only, lock-free, no readahead (random access), no memory init: LMDB's advice for
    many concurrent readers of a file nobody writes."""
    path = Path(path)
    data_file = path / "data.mdb"
    page = 4096
    if not data_file.is_file() or os.path.getsize(data_file) < _META_PAGES * page:
        raise DatasetError(f"not an LMDB (missing or tiny data.mdb): {path}", WRITER_HINT)
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, meminit=False)
    except lmdb.Error as exc:
        raise DatasetError(f"cannot open LMDB {path}: {exc}", WRITER_HINT) from exc
    _check_not_truncated(env, path)
    return env


def _close_env(env: lmdb.Environment) -> None:
    env.close()


def read_header(path: Path) -> int:
    """Open briefly (in whichever process builds the index), validate, return num-samples."""
    env = open_lmdb_readonly(path)
    record_open("index", str(path))
    try:
        entries = env.stat()["entries"]
        with env.begin(buffers=False) as txn:
            version = txn.get(b"schema-version")
            count = txn.get(b"num-samples")
            digits = count.strip() if count is not None else b""
            claimed = int(digits) if digits.isdigit() and len(digits) <= _MAX_COUNT_DIGITS else 0
            # The last record num-samples promises: a write or copy cut short loses both of its
            # keys (one key missing is one bad sample, missing_key).
            last = [f"{kind}-{claimed:09d}" for kind in ("image", "label")] if claimed else []
            missing = [key for key in last if txn.get(key.encode()) is None]
    finally:
        env.close()
    if version is not None:
        if not version.strip().isdigit() or len(version.strip()) > _MAX_COUNT_DIGITS:
            raise DatasetError(
                f"malformed OCR LMDB {path}: schema-version is {version[:20]!r}, not a number",
                f"the file was written by another tool or damaged: convert it again; {WRITER_HINT}",
            )
        if int(version) > SCHEMA_VERSION:
            raise DatasetError(
                f"{path} has schema-version {int(version)}, this code reads up to "
                f"{SCHEMA_VERSION}",
                "update the project, or regenerate the dataset with this version's scripts",
            )
    if count is None:
        raise DatasetError(
            f"not an OCR LMDB: key 'num-samples' missing in {path}",
            f"expected PaddleOCR's layout (num-samples, image-%09d, label-%09d); {WRITER_HINT}",
        )
    try:
        samples = int(count)
        if len(count.strip().lstrip(b"+-")) > _MAX_COUNT_DIGITS:
            raise ValueError("too many digits")
    except ValueError:
        raise DatasetError(
            f"malformed OCR LMDB {path}: key 'num-samples' is {count[:20]!r}"
            + (f" ({len(count)} bytes)" if len(count) > 20 else "")
            + ", not a record count",
            f"the file was written by another tool or damaged: convert it again; {WRITER_HINT}",
        ) from None
    # num-samples larger than the records (a copy cut short, a writer that died before its
    # last commit) would give a missing_key bad sample for every record past the end.
    if samples < 0 or entries < samples or (missing and len(missing) == len(last)):
        raise DatasetError(
            f"malformed OCR LMDB {path}: key 'num-samples' says {samples} records, but the file "
            f"holds {entries} keys (2 per record)"
            + (f" and lacks {', '.join(sorted(missing))}" if missing else ""),
            "the copy or the write was cut short: copy or convert it again and check it with "
            f"scripts/validate_data.py; {WRITER_HINT}",
        )
    return samples


class LmdbOcrSource:
    """Random access to (image bytes, label text) over one LMDB or a tree of them."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.paths = find_lmdbs(self.root)
        counts = np.array([read_header(p) for p in self.paths], dtype=np.int64)
        # ends[k] = number of samples in LMDBs 0..k; index i lives in LMDB bisect_right(ends, i).
        # Python ints, not numpy: one np.searchsorted on a scalar costs 3 us, 40 times a bisect.
        self._ends = [int(end) for end in np.cumsum(counts)]
        self._len = self._ends[-1] if self._ends else 0
        self._names = [str(p.relative_to(self.root)) if p != self.root else "" for p in self.paths]
        self._handles = [
            ProcessLocalHandle(str(p), open_lmdb_readonly, _close_env) for p in self.paths
        ]

    def __len__(self) -> int:
        return self._len

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        which = bisect.bisect_right(self._ends, index)
        start = self._ends[which - 1] if which else 0
        return which, index - start + 1  # records are numbered from 1

    def key(self, index: int) -> str:
        which, record = self._locate(index)
        name = self._names[which]
        return f"{name}/image-{record:09d}" if name else f"image-{record:09d}"

    def index_of_key(self, key: str) -> int | None:
        name, _, record = key.rpartition("/")
        try:
            which = self._names.index(name)
            number = int(record.removeprefix("image-"))
        except ValueError:
            return None
        start = self._ends[which - 1] if which else 0
        count = self._ends[which] - start
        return start + number - 1 if 1 <= number <= count else None

    def source_of(self, index: int) -> str:
        return str(self.paths[self._locate(index)[0]])

    def read(self, index: int) -> tuple[bytes, str]:
        which, record = self._locate(index)
        try:
            with self._handles[which].get().begin(buffers=False) as txn:
                image = txn.get(b"image-%09d" % record)
                label = txn.get(b"label-%09d" % record)
        except lmdb.Error as exc:
            raise BadSampleError("read_error", f"LMDB read failed: {exc}") from exc
        if image is None or label is None:
            missing = "image" if image is None else "label"
            raise BadSampleError("missing_key", f"{missing}-{record:09d} not in the LMDB")
        if len(label) > MAX_LABEL_BYTES:
            raise BadSampleError(
                "label_too_long",
                f"label-{record:09d} holds {len(label)} bytes, over {MAX_LABEL_BYTES} (one text "
                "line); not decoded",
            )
        try:
            return image, label.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadSampleError("label_out_of_dict", f"label is not UTF-8: {exc}") from exc

    def close(self) -> None:
        for handle in self._handles:
            handle.close()


# What an LMDB folder of ours holds: LMDB's own files, nothing else.
LMDB_FILES = frozenset({"data.mdb", "lock.mdb"})


def _holds_only_lmdb_files(path: Path) -> bool:
    return set(os.listdir(path)) <= LMDB_FILES


def written_here(path: str | Path) -> bool:
    """Whether ``path`` is an OCR LMDB this project's writer made: a folder (not a link) holding
    only LMDB's files, whose data has the ``schema-version`` key the writer adds."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir() or not (path / "data.mdb").is_file():
        return False
    if not _holds_only_lmdb_files(path):
        return False
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, create=False)
    except lmdb.Error:
        return False
    try:
        with env.begin(buffers=False) as txn:
            return txn.get(b"schema-version") is not None
    finally:
        env.close()


def check_replaceable(out_dir: str | Path, overwrite: bool) -> None:
    """Raise unless a writer may put an LMDB at ``out_dir``: nothing there, an empty folder
    (nothing to lose), or, with ``overwrite``, an OCR LMDB this project wrote (written_here).
    Anything else is refused whatever ``overwrite`` says: --overwrite replaces a dataset of
    ours, never another folder."""
    out_dir = Path(out_dir)
    refuse_link(out_dir)
    if not out_dir.exists() or (out_dir.is_dir() and not os.listdir(out_dir)):
        return
    if not written_here(out_dir):
        raise DatasetError(
            f"{out_dir} exists and is not an OCR LMDB this project wrote (a folder holding only "
            "data.mdb and lock.mdb, with the schema-version key), so it is never replaced",
            "pick an empty or new --out",
        )
    if not overwrite:
        raise DatasetError(
            f"{out_dir} already exists", "pass --overwrite to replace it, or pick --out"
        )


class LmdbOcrWriter:
    """Writes an OCR LMDB atomically: into ``<out>.partial`` then renamed to ``<out>``.

    A crash leaves only the ``.partial`` folder, which the next run removes and restarts
    (writers are cleanly restartable; the final name never holds half a dataset). What it
    replaces or removes is checked to be its own first (check_replaceable; a ``.partial``
    holding only LMDB's files).
    """

    def __init__(self, out_dir: str | Path, overwrite: bool = False, commit_every: int = 1000):
        self.out_dir = Path(out_dir)
        self.overwrite = overwrite
        check_replaceable(self.out_dir, overwrite)
        self.tmp_dir = self.out_dir.with_name(self.out_dir.name + ".partial")
        if refuse_link(self.tmp_dir).is_dir() and not _holds_only_lmdb_files(self.tmp_dir):
            raise DatasetError(
                f"{self.tmp_dir} holds files an interrupted write did not leave (only data.mdb "
                "and lock.mdb would be): not removed",
                "move them away, or pick another --out",
            )
        remove_stale(self.tmp_dir, folder=True)  # an interrupted run's: restart cleanly
        self.tmp_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir()  # new: nothing planted in it
        self._map_size = 64 << 20
        self._env = lmdb.open(str(self.tmp_dir), map_size=self._map_size, subdir=True)
        self._pending: list[tuple[bytes, bytes]] = []
        self._commit_every = commit_every
        self.count = 0

    def add(self, image: bytes, label: str) -> None:
        self.count += 1
        self._pending.append((b"image-%09d" % self.count, image))
        self._pending.append((b"label-%09d" % self.count, label.encode("utf-8")))
        if len(self._pending) >= 2 * self._commit_every:
            self._flush()

    def _flush(self, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        items = self._pending + list(extra)
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in items:
                        txn.put(key, value)
                break
            except lmdb.MapFullError:  # grow the map and retry the whole transaction
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)
        self._pending = []

    def finish(self) -> Path:
        """Write num-samples and the schema version, then move into place."""
        self._flush(
            ((b"num-samples", b"%d" % self.count), (b"schema-version", b"%d" % SCHEMA_VERSION))
        )
        self._env.sync()
        self._env.close()
        check_replaceable(self.out_dir, self.overwrite)  # again: the step that removes it
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        self._env.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
