"""What a dataset path is, decided in one place, and the record source that reads it.

A path's format follows from what is there, not from its name:

- ``ocr-lmdb``: a directory holding data.mdb, or a tree of such directories (the rule
  datasets/lmdb_ocr.py opens a path by: ``lmdb_dirs``);
- ``image-folder``: any other directory, read as ``root/<class>/<image>``
  (datasets/image_folder.py);
- ``hdf5``: a file that h5py finds the HDF5 signature in, whatever its suffix
  (datasets/hdf5_images.py);
- ``image-file``: any other file, one encoded image (an input of train.predict).

The one use of a name: a file called ``*.h5``/``*.hdf5`` without the HDF5 signature is refused
rather than taken for an image, since it is an empty file, a failed download or another format
renamed, and every reader would fail on it later with a less telling error.

A caller names the formats its task reads (``accept``); a path of another format is refused here,
naming the path, the format found and the formats read, so a wrong path fails at open in one line
instead of inside a reader that assumed its own format.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from datasets.errors import DatasetError
from datasets.image_folder import IMAGE_SUFFIXES

if TYPE_CHECKING:
    from datasets.hdf5_images import Hdf5ImageSource, Hdf5TagSource
    from datasets.image_folder import ImageFolderSource
    from datasets.lmdb_ocr import LmdbOcrSource

__all__ = [
    "FORMATS",
    "HDF5",
    "IMAGE_FILE",
    "IMAGE_FOLDER",
    "IMAGE_SUFFIXES",
    "OCR_LMDB",
    "RECORD_FORMATS",
    "check_format",
    "detect_format",
    "open_source",
    "open_tag_source",
]

OCR_LMDB = "ocr-lmdb"
IMAGE_FOLDER = "image-folder"
HDF5 = "hdf5"
IMAGE_FILE = "image-file"

# Each format as the formats a reader reads are listed in its errors.
FORMATS = {
    OCR_LMDB: "an OCR LMDB (a directory holding data.mdb, or a tree of them)",
    HDF5: "an HDF5 file",
    IMAGE_FOLDER: "an image folder (root/<class>/<image>)",
    IMAGE_FILE: "an image file",
}
# A path found to be of the format, in a wrong-format error: the two formats that are what is
# left over say why the path is one.
_FOUND = {
    **FORMATS,
    IMAGE_FOLDER: "a directory with no data.mdb at or below it, so an image folder",
    IMAGE_FILE: "a file that is not HDF5, so an image file",
}
# The formats a record source (open_source) reads; an image file is one image, no dataset.
RECORD_FORMATS = (OCR_LMDB, HDF5, IMAGE_FOLDER)
HDF5_SUFFIXES = (".h5", ".hdf5")
_FOLDER_HINT = "lay the images out as root/<class name>/<image files>"


def detect_format(path: str | Path) -> str:
    """The format of ``path``, one of FORMATS; a DatasetError with the fix for a path that does
    not exist, cannot be read, or is neither a regular file nor a directory."""
    path = Path(path)
    try:
        if path.is_dir():
            with os.scandir(path):  # an unreadable directory fails here, not as an empty one
                pass
            from datasets.lmdb_ocr import lmdb_dirs

            return OCR_LMDB if next(lmdb_dirs(path), None) is not None else IMAGE_FOLDER
        if not path.exists():
            raise _missing(path)
        if not path.is_file():
            raise DatasetError(
                f"dataset path {path} is neither a file nor a directory (a device, a pipe or a "
                "socket)",
                "point at the dataset's file or directory",
            )
        with open(path, "rb"):  # an unreadable file fails here, with the reason
            pass
        import h5py

        if h5py.is_hdf5(path):
            return HDF5
    except OSError as exc:
        raise DatasetError(
            f"cannot read dataset path {path}: {exc.strerror or exc}",
            f"make it readable by this user (uid {os.getuid()}), or point at a readable copy",
        ) from exc
    if path.suffix.lower() in HDF5_SUFFIXES:
        from datasets.hdf5_images import WRITER_HINT

        raise DatasetError(
            f"{path} is named as an HDF5 file but holds no HDF5 data (no HDF5 signature)",
            "it is empty, a download that failed or another format renamed: copy or convert it "
            f"again; {WRITER_HINT}",
        )
    return IMAGE_FILE


def _missing(path: Path) -> DatasetError:
    if path.is_symlink():
        return DatasetError(
            f"dataset path {path} is a link to {os.readlink(path)}, which does not exist",
            "point the link at the dataset, or give the dataset's own path",
        )
    where = "" if path.is_absolute() else f" (a relative path is read from {Path.cwd()})"
    return DatasetError(
        f"dataset path does not exist: {path}",
        f"check the path{where}; in a container, check that the dataset's volume is mounted",
    )


def check_format(path: str | Path, accept: Iterable[str], *, reader: str) -> str:
    """The format of ``path`` when it is one of ``accept``, the formats ``reader`` (a phrase:
    "the classification task") reads; else a DatasetError naming the path, the format found and
    the formats read, with how to make one of them."""
    accept = tuple(accept)
    unknown = [name for name in accept if name not in FORMATS]
    if unknown or not accept:
        raise ValueError(f"accept: {accept!r}, expected some of {tuple(FORMATS)}")
    found = detect_format(path)
    if found not in accept:
        raise DatasetError(
            f"{path} is {_FOUND[found]}; {reader} reads {_either(FORMATS[a] for a in accept)}",
            "; ".join(_hint(name) for name in accept),
        )
    return found


def _either(items: Iterable[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _hint(name: str) -> str:
    if name == OCR_LMDB:
        from datasets.lmdb_ocr import WRITER_HINT

        return f"OCR LMDB: {WRITER_HINT}"
    if name == HDF5:
        from datasets.hdf5_images import WRITER_HINT

        return f"HDF5: {WRITER_HINT}"
    if name == IMAGE_FOLDER:
        return f"image folder: {_FOLDER_HINT}"
    return "give the image file itself"


def open_source(
    path: str | Path, accept: Iterable[str] = RECORD_FORMATS, *, reader: str
) -> LmdbOcrSource | Hdf5ImageSource | ImageFolderSource:
    """The record source of ``path`` (datasets/dataset.py's RecordSource), of the format
    check_format finds among ``accept``: LmdbOcrSource, Hdf5ImageSource or ImageFolderSource."""
    accept = tuple(accept)
    if not set(accept) <= set(RECORD_FORMATS):
        raise ValueError(f"accept: {accept!r}, a record source reads {RECORD_FORMATS}")
    found = check_format(path, accept, reader=reader)
    if found == OCR_LMDB:
        from datasets.lmdb_ocr import LmdbOcrSource

        return LmdbOcrSource(path)
    if found == HDF5:
        from datasets.hdf5_images import Hdf5ImageSource

        return Hdf5ImageSource(path)
    from datasets.image_folder import ImageFolderSource

    try:
        return ImageFolderSource(path)
    except DatasetError as exc:
        if OCR_LMDB not in accept:
            raise
        # A reader of both: the directory may be an LMDB tree missing its data.mdb as well.
        raise DatasetError(
            f"{path} is neither an OCR LMDB (no data.mdb at or below it) nor an image folder "
            f"({exc.problem})",
            f"{_hint(OCR_LMDB)}; {_hint(IMAGE_FOLDER)}",
        ) from None


def open_tag_source(path: str | Path, *, reader: str) -> Hdf5TagSource:
    """The records of an HDF5 image file with their tags (Hdf5TagSource): only an HDF5 file
    holds tags, so any other format is refused as check_format refuses it."""
    check_format(path, (HDF5,), reader=reader)
    from datasets.hdf5_images import Hdf5TagSource

    return Hdf5TagSource(path)
