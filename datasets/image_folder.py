"""Image-folder datasets (``root/<class>/<image>``), the layout torchvision's ImageFolder reads.

Used as a conversion source (scripts/convert.py image-folder) and as the comparison peer in the
benchmark. File paths are held in one numpy bytes array, not a Python list of str: reading a
list element in a forked worker writes its refcount and copies the page (pytorch issue 13246).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from datasets.errors import BadSampleError, DatasetError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class ImageFolderSource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DatasetError(
                f"image folder not found: {self.root}", "expected root/<class name>/<image files>"
            )
        self.class_names = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.class_names:
            raise DatasetError(
                f"no class sub-folders in {self.root}", "expected root/<class name>/<image files>"
            )
        paths, labels = [], []
        for label, name in enumerate(self.class_names):
            for dirpath, _, files in sorted(os.walk(self.root / name)):
                for file in sorted(files):
                    if file.lower().endswith(IMAGE_EXTENSIONS):
                        rel = os.path.relpath(os.path.join(dirpath, file), self.root)
                        paths.append(os.fsencode(rel))
                        labels.append(label)
        if not paths:
            raise DatasetError(
                f"no image files under {self.root}", f"extensions: {IMAGE_EXTENSIONS}"
            )
        self._paths = np.array(paths, dtype=np.bytes_)
        self.labels = np.array(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, index: int) -> str:
        return os.fsdecode(self._paths[index])

    def index_of_key(self, key: str) -> int | None:
        hits = np.flatnonzero(self._paths == os.fsencode(key))
        return int(hits[0]) if len(hits) else None

    def source_of(self, index: int) -> str:
        return str(self.root / self.key(index))

    def read(self, index: int) -> tuple[bytes, int]:
        path = self.root / self.key(index)
        try:
            return path.read_bytes(), int(self.labels[index])
        except FileNotFoundError as exc:
            raise BadSampleError("missing_key", f"file vanished: {path}") from exc
        except OSError as exc:
            raise BadSampleError("read_error", f"cannot read {path}: {exc}") from exc

    def close(self) -> None:
        pass
