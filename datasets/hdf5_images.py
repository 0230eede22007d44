"""ResNet-50 image datasets in one HDF5 file.

Layout (schema version 1):
  /images  variable-length uint8, one encoded JPEG/PNG per row (stored as-is, never re-encoded)
  /labels  int64 class index per row
  /keys    variable-length UTF-8 source name per row (for reports only)
  attrs    format="resnet50-hdf5", schema_version=1, class_names=JSON list

Chunks of 256 rows: a variable-length chunk holds only 16-byte heap references (4 KiB), so a
random read touches one small chunk plus the image's own heap block, and no compression is
applied because JPEG bytes do not compress.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from datasets import SCHEMA_VERSION
from datasets.errors import BadSampleError, DatasetError
from datasets.handles import ProcessLocalHandle, record_open

FORMAT = "resnet50-hdf5"
CHUNK_ROWS = 256
WRITER_HINT = "write one with scripts/make_synthetic.py imagenet or scripts/convert.py image-folder"


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


def _open_images(path: str) -> tuple[h5py.File, h5py.Dataset]:
    """The file and its images dataset: looking the dataset up once per process, not once per
    sample, saves a path traversal in HDF5 on every read."""
    handle = open_hdf5_readonly(path)
    return handle, handle["images"]


def _close_file(handle: tuple[h5py.File, h5py.Dataset]) -> None:
    handle[0].close()


def _checked_structure(path: Path, f: h5py.File) -> tuple[np.ndarray, list[str]]:
    """The labels and class names, once the file's structure is checked: one DatasetError
    naming the file, the key and the fix, instead of a KeyError or a flood of read errors."""

    def broken(key: str, problem: str) -> DatasetError:
        return DatasetError(
            f"malformed ResNet-50 HDF5 dataset {path}: {key}: {problem}",
            f"the file was not written by this project's writer, or was modified; {WRITER_HINT}",
        )

    if "class_names" not in f.attrs:
        raise broken("attribute 'class_names'", "missing (a JSON list of the class names)")
    try:
        class_names = json.loads(f.attrs["class_names"])
    except (TypeError, ValueError) as exc:
        raise broken("attribute 'class_names'", f"not JSON ({exc})") from exc
    if not isinstance(class_names, list) or not class_names:
        raise broken("attribute 'class_names'", "not a non-empty JSON list")
    images, labels = f["images"], f["labels"]
    if not isinstance(images, h5py.Dataset) or images.ndim != 1:
        raise broken("'images'", "not a 1-D dataset of encoded images")
    if h5py.check_vlen_dtype(images.dtype) != np.dtype(np.uint8):
        raise broken("'images'", f"dtype {images.dtype}, not variable-length uint8 bytes")
    if not isinstance(labels, h5py.Dataset) or labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise broken("'labels'", f"not a 1-D integer dataset ({labels})")
    if len(images) != len(labels):
        raise broken("'images'/'labels'", f"{len(images)} images but {len(labels)} labels")
    if "keys" in f and len(f["keys"]) != len(images):
        raise broken("'keys'", f"{len(f['keys'])} keys for {len(images)} images")
    return np.asarray(labels[:], dtype=np.int64), [str(name) for name in class_names]


class Hdf5ImageSource:
    """Random access to (encoded image bytes, int label) rows of one HDF5 file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"HDF5 dataset not found: {self.path}", WRITER_HINT)
        with open_hdf5_readonly(str(self.path)) as f:
            record_open("index", str(self.path))
            if f.attrs.get("format") != FORMAT or "images" not in f or "labels" not in f:
                raise DatasetError(
                    f"not a ResNet-50 HDF5 dataset: {self.path} lacks format={FORMAT!r} or the "
                    "'images'/'labels' datasets",
                    WRITER_HINT,
                )
            version = int(f.attrs.get("schema_version", 0))
            if version != SCHEMA_VERSION:
                raise DatasetError(
                    f"{self.path} has schema_version {version}, this code reads {SCHEMA_VERSION}",
                    "regenerate the file with this version's scripts",
                )
            self.labels, self.class_names = _checked_structure(self.path, f)
        self._handle = ProcessLocalHandle(str(self.path), _open_images, _close_file)

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
        try:
            data = self._handle.get()[1][index]
        except (OSError, KeyError, ValueError) as exc:
            raise BadSampleError("read_error", f"HDF5 read failed: {exc}") from exc
        return data.tobytes(), int(self.labels[index])

    def close(self) -> None:
        self._handle.close()


class Hdf5ImageWriter:
    """Appends rows to ``<out>.partial`` and renames to ``<out>`` on ``finish`` (atomic)."""

    def __init__(self, out_file: str | Path, class_names: list[str], overwrite: bool = False):
        self.out_file = Path(out_file)
        if self.out_file.exists() and not overwrite:
            raise DatasetError(
                f"{self.out_file} already exists", "pass --overwrite to replace it, or pick --out"
            )
        self.tmp_file = self.out_file.with_name(self.out_file.name + ".partial")
        self.tmp_file.parent.mkdir(parents=True, exist_ok=True)
        self._file = h5py.File(self.tmp_file, "w")  # "w" truncates a leftover .partial
        self._file.attrs["format"] = FORMAT
        self._file.attrs["schema_version"] = SCHEMA_VERSION
        self._file.attrs["class_names"] = json.dumps(list(class_names))
        self._num_classes = len(class_names)
        make = self._file.create_dataset
        make(
            "images", (0,), maxshape=(None,), chunks=(CHUNK_ROWS,), dtype=h5py.vlen_dtype(np.uint8)
        )
        make("labels", (0,), maxshape=(None,), chunks=(4096,), dtype=np.int64)
        make("keys", (0,), maxshape=(None,), chunks=(CHUNK_ROWS,), dtype=h5py.string_dtype())
        self._rows: list[tuple[bytes, int, str]] = []
        self.count = 0

    def add(self, image: bytes, label: int, key: str = "") -> None:
        if not 0 <= label < self._num_classes:
            raise DatasetError(f"label {label} outside 0..{self._num_classes - 1}", "")
        self._rows.append((image, label, key))
        self.count += 1
        if len(self._rows) >= 512:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        start, n = self._file["labels"].shape[0], len(self._rows)
        for name in ("images", "labels", "keys"):
            self._file[name].resize((start + n,))
        images = np.empty(n, dtype=object)
        images[:] = [np.frombuffer(r[0], dtype=np.uint8) for r in self._rows]
        self._file["images"][start:] = images
        self._file["labels"][start:] = [r[1] for r in self._rows]
        self._file["keys"][start:] = [r[2] for r in self._rows]
        self._rows = []

    def finish(self) -> Path:
        self._flush()
        self._file.close()
        os.replace(self.tmp_file, self.out_file)
        return self.out_file

    def abort(self) -> None:
        self._file.close()
        self.tmp_file.unlink(missing_ok=True)
