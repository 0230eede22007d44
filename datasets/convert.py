"""Converters into the project's formats. Each writes atomically (temp name, then rename) and
refuses to overwrite unless asked; an interrupted conversion leaves nothing under the final
name and is restarted from scratch by the next run (the writers remove stale .partial files).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from datasets.errors import DatasetError
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
    for number, line in enumerate(label_file.read_text(encoding="utf-8").splitlines(), 1):
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
    no '..' that climbs out. Symlinks inside the folder are followed as the user made them, but a
    label file (often from elsewhere) cannot make the converter copy /etc/hostname or
    ../secret.txt into a dataset."""
    normal = os.path.normpath(rel_path)
    return not os.path.isabs(normal) and normal != ".." and not normal.startswith("../")


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

    def samples() -> Iterator[tuple[bytes, str]]:
        for rel_path, label, number in rows:
            image_path = data_dir / rel_path
            problem = None
            if not _stays_inside(rel_path):
                problem = (
                    f"{label_file}:{number}: {rel_path!r} leads outside --data-dir {data_dir} "
                    "(an absolute path or '..'); paths in a label file are relative to it"
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
                yield image_path.read_bytes(), label
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
