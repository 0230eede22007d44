"""Image-folder datasets (``root/<class>/<image>``), the layout torchvision's ImageFolder reads.

Used as a conversion source (scripts/convert.py image-folder) and as the comparison peer in the
benchmark. File paths are held in one numpy bytes array, not a Python list of str: reading a
list element in a forked worker writes its refcount and copies the page (pytorch issue 13246).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np

from datasets.errors import BadSampleError, DatasetError

# What counts as an image file, by its name's suffix (any case): what this reader lists and what
# train.predict reads from a folder. datasets/sources.py, which decides a path's format, exports
# it; it is defined here, below that module, which imports this one.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
log = logging.getLogger(__name__)


def _inside(path: str, real_root: str) -> bool:
    """Whether ``path``, every link in it resolved, is at or below ``real_root``."""
    return os.path.commonpath([os.path.realpath(path), real_root]) == real_root


class ImageFolderSource:
    """The images below ``root``. Links are followed only where they lead to a place below
    ``root``: one that leads out (to /etc, a home directory) is left out of the listing with a
    warning, and refused when read, so a folder from elsewhere cannot make a conversion copy
    files from outside it."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DatasetError(
                f"image folder not found: {self.root}", "expected root/<class name>/<image files>"
            )
        self._real_root = os.path.realpath(self.root)
        self.class_names = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.class_names:
            raise DatasetError(
                f"no class sub-folders in {self.root}", "expected root/<class name>/<image files>"
            )
        paths, labels, outside = [], [], []
        for label, name in enumerate(self.class_names):
            if not _inside(str(self.root / name), self._real_root):
                outside.append(name + "/")
                continue
            # os.walk follows no link to a folder below the class folder, so only the class
            # folder (above) and each file can be a link.
            for dirpath, _, files in sorted(os.walk(self.root / name)):
                for file in sorted(files):
                    if file.lower().endswith(IMAGE_SUFFIXES):
                        full = os.path.join(dirpath, file)
                        rel = os.path.relpath(full, self.root)
                        if os.path.islink(full) and not _inside(full, self._real_root):
                            outside.append(rel)
                            continue
                        paths.append(os.fsencode(rel))
                        labels.append(label)
        if outside:
            log.warning(
                "%s: left out %d link(s) that lead outside it: %s",
                self.root,
                len(outside),
                ", ".join(outside[:5]) + (" ..." if len(outside) > 5 else ""),
            )
        if not paths:
            raise DatasetError(f"no image files under {self.root}", f"extensions: {IMAGE_SUFFIXES}")
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
            return self._read_inside(str(path)), int(self.labels[index])
        except FileNotFoundError as exc:
            raise BadSampleError("missing_key", f"file vanished: {path}") from exc
        except OSError as exc:
            raise BadSampleError("read_error", f"cannot read {path}: {exc}") from exc

    def _read_inside(self, path: str) -> bytes:
        """The file's bytes; a link is read through only to a file below the root (the check
        happens at the read, so a file replaced by a link after the listing is caught too)."""
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            real = os.path.realpath(path)
            if os.path.commonpath([real, self._real_root]) != self._real_root:
                raise BadSampleError(
                    "read_error", f"{path} is a link that leads outside {self.root} (to {real})"
                ) from None
            fd = os.open(real, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def close(self) -> None:
        pass
