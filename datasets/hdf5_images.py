"""ResNet-50 image datasets in one HDF5 file.

Layout (schema version 2, what Hdf5ImageWriter writes):
  /image_bytes  uint8, contiguous (no chunks, no filters): every encoded JPEG/PNG back to back,
                stored as-is, never re-encoded
  /offsets      int64, one more than the records: record i is image_bytes[offsets[i]:offsets[i+1]]
  /labels       int64 class index per record
  /keys         variable-length UTF-8 source name per record (for reports only)
  /tags         optional: uint8 [records, tags] multi-hot, the record's tags (multi-label tasks)
  attrs         format="resnet50-hdf5", schema_version=2, class_names=JSON list, and with /tags
                tag_names=JSON list (one name per column of /tags)

A contiguous dataset has one place in the file, so a record is one ``os.pread`` at that place
plus its offset: no HDF5 call per sample. Schema version 1 kept each image as a row of a
variable-length dataset; HDF5 reads such a row through its global heap (53-70 us and 0.85 M
instructions for a 95 KB ImageNet-like JPEG here), and the decode right after it ran about 140
us slower than after a plain file read, with the same instructions: a record read and
transformed cost 1,361 us against 1,175 us through the pread (python -m bench.hdf5_reads;
docs/benchmarks.md, "HDF5 reads"). Version 1 files are still read, the slow way, with a warning;
``scripts/convert.py hdf5-upgrade`` rewrites one as version 2. No compression either way: JPEG
bytes do not compress.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import h5py
import numpy as np

from datasets.errors import BadSampleError, DatasetError
from datasets.handles import ProcessLocalHandle, record_open
from datasets.safe_files import open_new, refuse_link, remove_stale

FORMAT = "resnet50-hdf5"
SCHEMA_VERSION = 2  # the version written; READ_VERSIONS are read
READ_VERSIONS = (1, 2)
ROWS_PER_FLUSH = 512  # labels, keys and offsets are appended in blocks of this many records
CHUNK_ROWS = 4096  # of those three datasets (they grow while writing, so they are chunked)
COPY_BLOCK_BYTES = 64 << 20  # finish() moves the spooled image bytes into the file in blocks
log = logging.getLogger(__name__)
WRITER_HINT = "write one with scripts/make_synthetic.py imagenet or scripts/convert.py image-folder"
# What a file's datasets may claim beyond the bytes it stores (_check_stored). Reading one element
# of a compressed dataset inflates its whole chunk, so a compressed chunk over this many bytes is
# refused rather than inflated on every record read (h5py's own chunks stay under 1 MiB; ours,
# CHUNK_ROWS int64s, are 32 kB).
MAX_FILTERED_CHUNK_BYTES = 64 << 20
# Deflate's limit, 1032:1: a compressed dataset claiming more bytes per stored byte is a forged
# header (an index, or image bytes, of a few kB that would inflate to gigabytes); real indexes and
# encoded images compress far less.
MAX_INFLATE_RATIO = 1032


def open_hdf5_readonly(path: str) -> h5py.File:
    """Read-only without HDF5 file locking: locks fail on read-only and network mounts, and
    nobody writes a dataset while it trains. A small chunk cache suits random access."""
    try:
        return h5py.File(path, "r", locking=False, rdcc_nbytes=1 << 20)
    except OSError as exc:
        text = str(exc)
        if "truncated file" in text:
            raise DatasetError(
                f"truncated HDF5 file {path}: {text}",
                "the copy or download was interrupted; copy it again and check it with "
                "scripts/validate_data.py",
            ) from exc
        raise DatasetError(f"cannot open {path} as HDF5: {text}", WRITER_HINT) from exc


def _open_dataset(name: str):
    """An opener for ProcessLocalHandle: the file and its dataset ``name`` (looked up once per
    process, not once per sample: that saves a path traversal in HDF5 on every read)."""

    def opener(path: str) -> tuple[h5py.File, h5py.Dataset]:
        handle = open_hdf5_readonly(path)
        return handle, handle[name]

    return opener


def _close_file(handle: tuple[h5py.File, h5py.Dataset]) -> None:
    handle[0].close()


def _open_fd(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


def _broken(path: Path, key: str, problem: str) -> DatasetError:
    return DatasetError(
        f"malformed ResNet-50 HDF5 dataset {path}: {key}: {problem}",
        f"the file was not written by this project's writer, or was modified; {WRITER_HINT}",
    )


def _stored_bytes(path: Path, dset: h5py.Dataset) -> int:
    """The bytes of ``dset`` (as read: shape x itemsize) that the file really stores.

    HDF5 answers a read of space that was declared and never written with the fill value (zeros),
    at the cost of the read's size in memory: an 8 kB file whose chunked ``image_bytes`` claims
    512 MiB hands out 512 MiB of zeros per record. So only stored space counts: every chunk of a
    chunked dataset allocated, a contiguous one's allocated storage within the file on disk, an
    external one's segments within their files. Compact data lives in the object header itself.
    Virtual datasets (data in other files) hold nothing here."""
    plist = dset.id.get_create_plist()
    layout = plist.get_layout()
    declared = dset.size * dset.dtype.itemsize
    if layout == h5py.h5d.COMPACT:
        return declared
    if layout == h5py.h5d.CHUNKED:
        chunk_bytes = math.prod(dset.chunks) * dset.dtype.itemsize
        needed = math.prod(-(-side // chunk) for side, chunk in zip(dset.shape, dset.chunks))
        allocated = dset.id.get_num_chunks()
        return declared if allocated >= needed else min(declared, allocated * chunk_bytes)
    if layout != h5py.h5d.CONTIGUOUS or dset.is_virtual:
        return 0
    if plist.get_external_count():
        held = 0
        for i in range(plist.get_external_count()):
            name, offset, size = plist.get_external(i)
            external = Path(os.fsdecode(name))
            if not external.is_absolute() and (path.parent / external).is_file():
                external = path.parent / external  # HDF5 also looks beside the file
            on_disk = external.stat().st_size if external.is_file() else 0
            held += max(0, min(size, on_disk - offset))
        return min(declared, held)
    start = dset.id.get_offset()
    if start is None:  # never written: no storage allocated
        return 0
    return min(declared, dset.id.get_storage_size(), max(0, path.stat().st_size - start))


def _check_stored(path: Path, dset: h5py.Dataset, field: str) -> None:
    """Raise DatasetError unless the file stores every byte ``dset`` declares (so reading it costs
    no more memory than the file holds), and its compression is one real data can have.

    Checked before any read of the dataset, from its header alone. Missing bytes make the file,
    not a record, unusable: this project's writer writes every byte before it renames the file
    into place, so declared and unwritten space means an unfinished or forged file, and its
    records would read as zeros (garbage samples) at the cost of their claimed size."""
    declared = dset.size * dset.dtype.itemsize
    stored = _stored_bytes(path, dset)
    if stored < declared:
        raise _broken(
            path,
            field,
            f"declares {declared} bytes (shape {dset.shape} of {dset.dtype}) but the file "
            f"({path.stat().st_size} bytes) stores {stored} of them: the rest was never "
            "written (HDF5 would read it as zeros, one claimed size of memory per read)",
        )
    if dset.chunks is None or not dset.id.get_create_plist().get_nfilters():
        return
    chunk_bytes = math.prod(dset.chunks) * dset.dtype.itemsize
    if chunk_bytes > MAX_FILTERED_CHUNK_BYTES:
        raise _broken(
            path,
            field,
            f"compressed chunks of {chunk_bytes} bytes (over {MAX_FILTERED_CHUNK_BYTES}): "
            "every read would inflate a whole chunk",
        )
    if declared > MAX_INFLATE_RATIO * dset.id.get_storage_size():
        raise _broken(
            path,
            field,
            f"{declared} bytes compressed into {dset.id.get_storage_size()}, more than "
            f"{MAX_INFLATE_RATIO}:1 (deflate's limit): a forged header",
        )


def _checked_labels(path: Path, f: h5py.File, records: int, what: str) -> np.ndarray:
    labels = f["labels"]
    if not isinstance(labels, h5py.Dataset) or labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise _broken(path, "'labels'", f"not a 1-D integer dataset ({labels})")
    if len(labels) != records:
        raise _broken(path, f"{what}/'labels'", f"{records} images but {len(labels)} labels")
    if "keys" in f and len(f["keys"]) != records:
        raise _broken(path, "'keys'", f"{len(f['keys'])} keys for {records} images")
    _check_stored(path, labels, "'labels'")
    return np.asarray(labels[:], dtype=np.int64)


def _checked_class_names(path: Path, f: h5py.File) -> list[str]:
    if "class_names" not in f.attrs:
        raise _broken(path, "attribute 'class_names'", "missing (a JSON list of the class names)")
    return _json_names(path, f, "class_names")


def _json_names(path: Path, f: h5py.File, attribute: str) -> list[str]:
    """The names in ``attribute``: a non-empty JSON list of strings. A name of another type (a
    number, a list) is no name a report or an export's classes file could show as written."""
    where = f"attribute '{attribute}'"
    try:
        names = json.loads(f.attrs[attribute])
    except (TypeError, ValueError) as exc:  # ValueError: also bytes that are not UTF-8
        raise _broken(path, where, f"not JSON ({exc})") from exc
    if not isinstance(names, list) or not names:
        raise _broken(path, where, "not a non-empty JSON list")
    odd = next((name for name in names if not isinstance(name, str)), None)
    if odd is not None:
        problem = f"holds {odd!r} ({type(odd).__name__}), not a name (a JSON string)"
        raise _broken(path, where, problem)
    return names


def _checked_offsets(path: Path, f: h5py.File) -> tuple[np.ndarray, int | None]:
    """Version 2: the offsets, checked against image_bytes, and where image_bytes starts in the
    file (None unless it is contiguous and stored in this file: then reads go through h5py)."""
    image_bytes, offsets = f["image_bytes"], f["offsets"]
    if not isinstance(image_bytes, h5py.Dataset) or image_bytes.ndim != 1:
        raise _broken(path, "'image_bytes'", "not a 1-D dataset of the encoded images' bytes")
    if image_bytes.dtype != np.uint8:
        raise _broken(path, "'image_bytes'", f"dtype {image_bytes.dtype}, not uint8")
    if not isinstance(offsets, h5py.Dataset) or offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise _broken(path, "'offsets'", f"not a 1-D integer dataset ({offsets})")
    # Both before any read: the records' bytes must be in the file (so no record read costs more
    # memory than the file holds; offsets[-1] == len(image_bytes) below bounds every record by
    # it), and so must the index.
    _check_stored(path, image_bytes, "'image_bytes'")
    _check_stored(path, offsets, "'offsets'")
    bounds = np.asarray(offsets[:], dtype=np.int64)
    if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != len(image_bytes):
        raise _broken(
            path,
            "'offsets'",
            f"must run from 0 to the {len(image_bytes)} bytes of 'image_bytes'"
            + (f" (found {bounds[0]} .. {bounds[-1]})" if len(bounds) else " (it is empty)"),
        )
    if np.any(bounds[1:] < bounds[:-1]):
        first = int(np.argmax(bounds[1:] < bounds[:-1]))
        raise _broken(path, "'offsets'", f"decrease at record {first} (a record of < 0 bytes)")
    plist = image_bytes.id.get_create_plist()
    stored_here = plist.get_layout() == h5py.h5d.CONTIGUOUS and plist.get_external_count() == 0
    return bounds, image_bytes.id.get_offset() if stored_here else None


class Hdf5ImageSource:
    """Random access to (encoded image bytes, int label) records of one HDF5 file."""

    def __init__(self, path: str | Path, pread: bool = True) -> None:
        """``pread=False`` reads schema-2 records through h5py even where the file allows one
        pread a record (bench.hdf5_reads compares the two)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"HDF5 dataset not found: {self.path}", WRITER_HINT)
        with open_hdf5_readonly(str(self.path)) as f:
            record_open("index", str(self.path))
            self.version = self._checked_version(f)
            self.class_names = _checked_class_names(self.path, f)
            self.offsets, self._file_offset = None, None
            if self.version == 1:
                images = f["images"]
                if not isinstance(images, h5py.Dataset) or images.ndim != 1:
                    raise _broken(self.path, "'images'", "not a 1-D dataset of encoded images")
                if h5py.check_vlen_dtype(images.dtype) != np.dtype(np.uint8):
                    raise _broken(
                        self.path, "'images'", f"dtype {images.dtype}, not variable-length uint8"
                    )
                _check_stored(self.path, images, "'images'")
                self.labels = _checked_labels(self.path, f, len(images), "'images'")
                log.warning(
                    "%s is schema 1 (one variable-length row per image): it reads, but about 12%% "
                    "slower a ResNet-50 sample than schema 2; scripts/convert.py hdf5-upgrade "
                    "--src %s --out NEW.h5 rewrites it",
                    self.path,
                    self.path,
                )
            else:
                self.offsets, self._file_offset = _checked_offsets(self.path, f)
                self._file_offset = self._file_offset if pread else None
                self.labels = _checked_labels(self.path, f, len(self.offsets) - 1, "'offsets'")
        if self._file_offset is not None:
            self._handle = ProcessLocalHandle(str(self.path), _open_fd, os.close)
        else:
            name = "images" if self.version == 1 else "image_bytes"
            self._handle = ProcessLocalHandle(str(self.path), _open_dataset(name), _close_file)

    def _checked_version(self, f: h5py.File) -> int:
        names = {1: "images", 2: "image_bytes"}
        found = f.attrs.get("format")
        if not isinstance(found, str) or found != FORMAT:  # an array compares element-wise
            raise DatasetError(
                f"not a ResNet-50 HDF5 dataset: {self.path} lacks format={FORMAT!r}", WRITER_HINT
            )
        version = f.attrs.get("schema_version", 0)
        if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
            shown = version.item() if isinstance(version, np.generic) else version
            problem = f"{shown!r} ({type(version).__name__}) is not an integer"
            raise _broken(self.path, "attribute 'schema_version'", problem)
        version = int(version)
        if version not in READ_VERSIONS:
            raise DatasetError(
                f"{self.path} has schema_version {version}, this code reads "
                f"{' and '.join(map(str, READ_VERSIONS))}",
                "regenerate the file with this version's scripts",
            )
        needed = [names[version], "labels"] + (["offsets"] if version == 2 else [])
        missing = [name for name in needed if name not in f]
        if missing:
            raise DatasetError(
                f"not a ResNet-50 HDF5 dataset: {self.path} (schema_version {version}) lacks "
                f"the {' and '.join(repr(n) for n in missing)} dataset(s)",
                WRITER_HINT,
            )
        return version

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, index: int) -> str:
        return f"{self.path.name}#{index}"

    def index_of_key(self, key: str) -> int | None:
        name, _, number = key.rpartition("#")
        if name != self.path.name or not number.isdigit():
            return None
        return int(number) if int(number) < len(self) else None

    def source_of(self, index: int) -> str:
        return str(self.path)

    def read(self, index: int) -> tuple[bytes, int]:
        label = int(self.labels[index])
        if self.version == 1:
            return self._read_h5py(lambda images: images[index]), label
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        if self._file_offset is None:
            return self._read_h5py(lambda image_bytes: image_bytes[start:end]), label
        try:
            data = os.pread(self._handle.get(), end - start, self._file_offset + start)
        except OSError as exc:
            raise BadSampleError("read_error", f"reading {self.path} failed: {exc}") from exc
        if len(data) != end - start:
            raise BadSampleError(
                "read_error",
                f"{self.path} ends {end - start - len(data)} bytes into record {index} "
                f"(bytes {start}..{end} of 'image_bytes'): the file was cut short",
            )
        return data, label

    def _read_h5py(self, select) -> bytes:
        try:
            return select(self._handle.get()[1]).tobytes()
        except (OSError, KeyError, ValueError) as exc:
            raise BadSampleError("read_error", f"HDF5 read failed: {exc}") from exc

    def close(self) -> None:
        self._handle.close()


class Hdf5TagSource(Hdf5ImageSource):
    """The records of an HDF5 image file with their tags instead of their class: (encoded image
    bytes, tags) where tags is an int whose bit i is set when the record has tag i (an int
    label keeps the record cacheable as every other, datasets/cache.py). ``class_names`` are
    the tag names."""

    def __init__(self, path: str | Path, pread: bool = True) -> None:
        super().__init__(path, pread)
        with open_hdf5_readonly(str(self.path)) as f:
            if "tags" not in f or "tag_names" not in f.attrs:
                raise DatasetError(
                    f"{self.path} holds no tags (no 'tags' dataset and 'tag_names' attribute)",
                    "write it with tags: scripts/make_synthetic.py imagenet writes them, "
                    "Hdf5ImageWriter(..., tag_names=...) for other data",
                )
            tags = f["tags"]
            if tags.ndim != 2 or len(tags) != len(self.labels):
                problem = f"shape {tags.shape}, expected [{len(self.labels)} records, tags]"
                raise _broken(self.path, "'tags'", problem)
            tag_names = _json_names(self.path, f, "tag_names")
            if len(tag_names) != tags.shape[1]:
                problem = f"not a JSON list of the {tags.shape[1]} columns of 'tags'"
                raise _broken(self.path, "attribute 'tag_names'", problem)
            _check_stored(self.path, tags, "'tags'")
            bits = np.asarray(tags[:], dtype=bool)
        self.class_names = tag_names
        # One int per record (bit i: tag i), computed once: read() then costs no more than the
        # class file's.
        self.tag_masks = [sum(1 << int(i) for i in np.flatnonzero(row)) for row in bits]

    def read(self, index: int) -> tuple[bytes, int]:
        data, _ = super().read(index)
        return data, self.tag_masks[index]


def written_here(path: str | Path) -> bool:
    """Whether ``path`` is a ResNet-50 HDF5 file this project's writer made: a file (not a
    link) that opens as HDF5 and carries the ``format`` attribute the writer sets."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("format") == FORMAT
    except (OSError, ValueError):
        return False


def check_replaceable(out_file: str | Path, overwrite: bool) -> None:
    """Raise unless a writer may put a file at ``out_file``: nothing there, an empty file
    (nothing to lose), or, with ``overwrite``, a ResNet-50 HDF5 file this project wrote
    (written_here). Anything else is refused whatever ``overwrite`` says: --overwrite replaces a
    dataset of ours, never another file."""
    out_file = Path(out_file)
    refuse_link(out_file)
    if not out_file.exists() or (out_file.is_file() and out_file.stat().st_size == 0):
        return
    if not written_here(out_file):
        raise DatasetError(
            f"{out_file} exists and is not a ResNet-50 HDF5 file this project wrote (no "
            f"format={FORMAT!r} attribute), so it is never replaced",
            "pick a new --out",
        )
    if not overwrite:
        raise DatasetError(
            f"{out_file} already exists", "pass --overwrite to replace it, or pick --out"
        )


class Hdf5ImageWriter:
    """Writes ``<out>.partial`` (and spools the image bytes to ``<out>.partial-bytes``), then
    renames it to ``<out>`` on ``finish``: an interrupted write leaves nothing under ``<out>``.

    The contiguous ``image_bytes`` cannot grow, so the bytes go to the spool file as records
    arrive and into the HDF5 file once their total is known (finish); labels, keys and offsets
    are appended to the HDF5 file every ROWS_PER_FLUSH records, so memory stays bounded. Until
    finish the output's folder holds the image bytes twice (spool and file): twice the
    dataset's size must be free there."""

    def __init__(
        self,
        out_file: str | Path,
        class_names: list[str],
        overwrite: bool = False,
        tag_names: list[str] | None = None,
    ):
        """``tag_names``: the file also holds each record's tags (``add``'s ``tags``)."""
        self.out_file = Path(out_file)
        self.overwrite = overwrite
        check_replaceable(self.out_file, overwrite)
        self.tmp_file = self.out_file.with_name(self.out_file.name + ".partial")
        self.spool_file = self.out_file.with_name(self.out_file.name + ".partial-bytes")
        self.tmp_file.parent.mkdir(parents=True, exist_ok=True)
        # Leftovers of an interrupted write are removed; a link at either name is refused.
        remove_stale(self.tmp_file)
        refuse_link(self.spool_file)
        self._file = h5py.File(self.tmp_file, "x")  # O_EXCL: fails on a name planted meanwhile
        self._spool = os.fdopen(open_new(self.spool_file), "wb")
        self._file.attrs["format"] = FORMAT
        self._file.attrs["schema_version"] = SCHEMA_VERSION
        self._file.attrs["class_names"] = json.dumps(list(class_names))
        self._num_classes = len(class_names)
        make = self._file.create_dataset
        make("offsets", data=np.zeros(1, np.int64), maxshape=(None,), chunks=(CHUNK_ROWS,))
        make("labels", (0,), maxshape=(None,), chunks=(CHUNK_ROWS,), dtype=np.int64)
        make("keys", (0,), maxshape=(None,), chunks=(CHUNK_ROWS,), dtype=h5py.string_dtype())
        self._num_tags = None if tag_names is None else len(tag_names)
        if tag_names is not None:
            self._file.attrs["tag_names"] = json.dumps(list(tag_names))
            columns = len(tag_names)
            shape, chunks = (0, columns), (CHUNK_ROWS, columns)
            make("tags", shape, maxshape=(None, columns), chunks=chunks, dtype=np.uint8)
        # (end offset, label, key, multi-hot tags or None) not yet flushed
        self._rows: list[tuple[int, int, str, np.ndarray | None]] = []
        self._end = 0
        self.count = 0

    def add(self, image: bytes, label: int, key: str = "", tags=None) -> None:
        """``tags``: the ids of the record's tags (a file written with tag_names needs them)."""
        if not 0 <= label < self._num_classes:
            raise DatasetError(f"label {label} outside 0..{self._num_classes - 1}", "")
        self._spool.write(image)
        self._end += len(image)
        self._rows.append((self._end, label, key, self._multi_hot(tags)))
        self.count += 1
        if len(self._rows) >= ROWS_PER_FLUSH:
            self._flush()

    def _multi_hot(self, tags) -> np.ndarray | None:
        if self._num_tags is None:
            if tags is not None:
                raise DatasetError("tags given to a writer without tag_names", "pass tag_names")
            return None
        if tags is None:
            raise DatasetError("a record without tags in a file with tag_names", "pass tags")
        row = np.zeros(self._num_tags, np.uint8)
        for tag in tags:
            if not 0 <= int(tag) < self._num_tags:
                raise DatasetError(f"tag {tag} outside 0..{self._num_tags - 1}", "")
            row[int(tag)] = 1
        return row

    def _flush(self) -> None:
        if not self._rows:
            return
        start, n = self._file["labels"].shape[0], len(self._rows)
        for name, extra in (("offsets", 1), ("labels", 0), ("keys", 0)):
            self._file[name].resize((start + n + extra,))
        ends, labels, keys, tags = zip(*self._rows)
        self._file["offsets"][start + 1 :] = ends
        self._file["labels"][start:] = labels
        self._file["keys"][start:] = keys
        if self._num_tags is not None:
            self._file["tags"].resize((start + n, self._num_tags))
            self._file["tags"][start:] = np.stack(tags)
        self._rows = []

    def finish(self) -> Path:
        try:
            self._flush()
            self._spool.close()
            # No chunks, no maxshape, no filters: HDF5 stores the dataset contiguously.
            image_bytes = self._file.create_dataset("image_bytes", (self._end,), dtype=np.uint8)
            with open(self.spool_file, "rb") as spool:
                position = 0
                while block := spool.read(COPY_BLOCK_BYTES):
                    image_bytes[position : position + len(block)] = np.frombuffer(block, np.uint8)
                    position += len(block)
            if position != self._end:
                raise DatasetError(
                    f"{self.spool_file} holds {position} bytes, {self._end} were written to it",
                    "another process wrote to the same output: write each file from one process",
                )
            self._file.close()
            check_replaceable(self.out_file, self.overwrite)  # again: the step that replaces it
            os.replace(self.tmp_file, self.out_file)
        except BaseException:
            self.abort()
            raise
        self.spool_file.unlink(missing_ok=True)
        return self.out_file

    def abort(self) -> None:
        self._spool.close()
        if self._file:  # an h5py File is true while open
            self._file.close()
        self.tmp_file.unlink(missing_ok=True)
        self.spool_file.unlink(missing_ok=True)
