"""Converters into the project's formats. Each writes atomically (temp name, then rename) and
refuses to overwrite unless asked; an interrupted conversion leaves nothing under the final
name and is restarted from scratch by the next run (the writers remove stale .partial files).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from datasets.errors import DatasetError, read_utf8
from datasets.hdf5_images import Hdf5ImageSource, Hdf5ImageWriter, open_hdf5_readonly
from datasets.image_folder import ImageFolderSource
from datasets.lmdb_ocr import LmdbOcrWriter
from datasets.synthetic import write_all

log = logging.getLogger(__name__)


def read_paddleocr_labels(label_file: Path) -> list[tuple[str, str, int]]:
    """(relative image path, label, line number) from PaddleOCR's ``path<TAB>label`` lines."""
    if not label_file.is_file():
        raise DatasetError(f"label file not found: {label_file}", "pass --labels PATH")
    rows = []
    text = read_utf8(label_file, "label file", "save it as UTF-8, as PaddleOCR reads it")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise DatasetError(
                f"{label_file}:{number}: no TAB in {line[:60]!r}",
                "PaddleOCR label files hold 'image_path<TAB>label' per line",
            )
        path, label = line.split("\t", 1)
        rows.append((path, label, number))
    if not rows:
        raise DatasetError(
            f"{label_file} holds no samples", "expected 'image_path<TAB>label' lines"
        )
    return rows


def _stays_inside(rel_path: str) -> bool:
    """Whether a label file's path names something below --data-dir, as written: not absolute,
    no '..' that climbs out. A label file (often from elsewhere) cannot make the converter copy
    /etc/hostname or ../secret.txt into a dataset; _resolved_inside checks where links lead."""
    normal = os.path.normpath(rel_path)
    return not os.path.isabs(normal) and normal != ".." and not normal.startswith("../")


def _resolved_inside(image_path: Path, real_data_dir: str) -> str | None:
    """``image_path`` with every link resolved when that stays below ``real_data_dir`` (the
    resolved --data-dir), else None: a link inside the folder may point to another place in
    it, never out of it (a link to /etc/shadow or ~/.ssh would copy that file into the
    dataset, whose path text passed _stays_inside)."""
    real = os.path.realpath(image_path)
    return real if os.path.commonpath([real, real_data_dir]) == real_data_dir else None


def _read_resolved(real: str) -> bytes:
    """The bytes of the file at ``real`` (a path with its links resolved): opened without
    following a link there, so a link put in its place after the check is not read through."""
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read()


def paddleocr_labels_to_lmdb(
    label_file: str | Path,
    data_dir: str | Path,
    out_dir: str | Path,
    overwrite: bool = False,
    strict: bool = False,
    progress: Callable | None = None,
) -> tuple[Path, int, list[str]]:
    """Copy image bytes as they are (no re-encode) with their labels into an OCR LMDB.

    Returns (LMDB path, samples written, problems). Missing files and empty labels are skipped
    and listed; with ``strict`` the first one aborts and nothing is written.
    """
    label_file, data_dir = Path(label_file), Path(data_dir)
    rows = read_paddleocr_labels(label_file)
    problems: list[str] = []
    real_data_dir = os.path.realpath(data_dir)

    def samples() -> Iterator[tuple[bytes, str]]:
        for rel_path, label, number in rows:
            image_path = data_dir / rel_path
            problem = real = None
            if not _stays_inside(rel_path):
                problem = (
                    f"{label_file}:{number}: {rel_path!r} leads outside --data-dir {data_dir} "
                    "(an absolute path or '..'); paths in a label file are relative to it"
                )
            elif (real := _resolved_inside(image_path, real_data_dir)) is None:
                problem = (
                    f"{label_file}:{number}: {rel_path!r} is a link that leads outside "
                    f"--data-dir {data_dir} (to {os.path.realpath(image_path)}); only files "
                    "below --data-dir are copied"
                )
            elif not image_path.is_file():
                problem = f"{label_file}:{number}: image not found: {image_path}"
            elif not label.strip():
                problem = f"{label_file}:{number}: empty label for {rel_path}"
            if problem:
                if strict:
                    raise DatasetError(problem, "fix the label file, or drop --strict to skip")
                problems.append(problem)
                log.warning("skipped %s", problem)
            else:
                yield _read_resolved(real), label
            if progress:
                progress()

    writer = LmdbOcrWriter(out_dir, overwrite=overwrite)
    path = write_all(writer, samples())
    return path, writer.count, problems


def image_folder_to_hdf5(
    root: str | Path,
    out_file: str | Path,
    overwrite: bool = False,
    progress: Callable | None = None,
) -> tuple[Path, int]:
    """Copy encoded files as they are (no re-encode) with class indices into one HDF5 file."""
    source = ImageFolderSource(root)
    writer = Hdf5ImageWriter(out_file, source.class_names, overwrite=overwrite)

    def samples() -> Iterator[tuple[bytes, int, str]]:
        for index in range(len(source)):
            data, label = source.read(index)
            yield data, label, source.key(index)

    return write_all(writer, samples(), progress), writer.count


def upgrade_hdf5(
    src_file: str | Path,
    out_file: str | Path,
    overwrite: bool = False,
    progress: Callable | None = None,
) -> tuple[Path, int]:
    """Rewrite a ResNet-50 HDF5 file of an older schema (or any readable one) in the current
    layout, records, labels, keys and class names unchanged (datasets/hdf5_images.py)."""
    src_file, out_file = Path(src_file), Path(out_file)
    if src_file.resolve() == out_file.resolve():
        raise DatasetError(
            f"--src and --out are the same file ({src_file})",
            "write to a new file, then replace the old one with it",
        )
    source = Hdf5ImageSource(src_file)
    with open_hdf5_readonly(str(src_file)) as f:
        if "keys" in f:
            keys = [k.decode() if isinstance(k, bytes) else str(k) for k in f["keys"][:]]
        else:  # keys are optional (reports only): name each record as the reader does
            keys = [source.key(i) for i in range(len(source))]
    writer = Hdf5ImageWriter(out_file, source.class_names, overwrite=overwrite)

    def samples() -> Iterator[tuple[bytes, int, str]]:
        for index in range(len(source)):
            data, label = source.read(index)
            yield data, label, keys[index]

    try:
        return write_all(writer, samples(), progress), writer.count
    finally:
        source.close()
