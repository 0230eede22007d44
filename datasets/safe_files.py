"""Files this project writes, opened so that a link planted at their name is refused, never
followed.

Run directories, caches and dataset outputs often live in shared or long-lived folders. A
symbolic link left at a name the project writes (``RUN/.lock``, ``checkpoints/latest.partial``,
``OUT.h5.partial``) would redirect a plain ``open(path, "w")`` to whatever it points at and
truncate or overwrite that file. Here every such file is opened with ``O_NOFOLLOW``, a new one
also with ``O_CREAT | O_EXCL`` (which never follows a link and fails on any name already there,
so a link planted between a stale file's removal and the open is refused too), and a link is
reported as LinkRefusedError naming the path. Directories are not checked: a run or data
directory that is itself a link to another volume is an ordinary setup.

The trainer (``train/``) and the data tools (``datasets/``, ``scripts/``) share this module;
it imports nothing of either.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LinkRefusedError(OSError):
    """A symbolic link stands at a name this project writes (or a hard link at one it rewrites in
    place): the write is refused instead of going to the link's target."""

    def __init__(self, path: str | os.PathLike, what: str = "a symbolic link") -> None:
        self.message = (
            f"{path} is {what}; remove it (files are written without following links, so that a "
            "link planted at a name this project writes cannot redirect the write)"
        )
        super().__init__(errno.ELOOP, self.message, os.fspath(path))

    def __str__(self) -> str:
        return self.message


def refuse_link(path: str | os.PathLike) -> Path:
    """``path``, after raising LinkRefusedError when a symbolic link stands there. For names
    written by rename (which replaces a link, never its target) or by a library that takes a
    path: the link is reported rather than silently replaced or followed."""
    if os.path.islink(path):
        raise LinkRefusedError(path)
    return Path(path)


def remove_stale(path: str | os.PathLike, folder: bool = False) -> None:
    """Remove what an interrupted write left at ``path``: a ``.partial`` file or, with
    ``folder``, a ``.partial`` folder and what it holds. A link there is refused, not removed and
    not followed; a folder where a file was written is refused too."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(found.st_mode):
        raise LinkRefusedError(path)
    if not stat.S_ISDIR(found.st_mode):
        os.unlink(path)
    elif folder:
        shutil.rmtree(path)
    else:
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", os.fspath(path))


def open_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A descriptor of a new, empty file at ``path``, open for writing. A regular file already
    there (a stale ``.partial``) is removed first; a link there is refused. Removing and
    creating, rather than truncating, also leaves alone any other name hard-linked to the old
    file."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        found = None
    if found is not None:
        if stat.S_ISLNK(found.st_mode):
            raise LinkRefusedError(path)
        if stat.S_ISDIR(found.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", os.fspath(path))
        os.unlink(path)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)
    except FileExistsError:
        if os.path.islink(path):  # planted since the removal above
            raise LinkRefusedError(path) from None
        raise


def open_append(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A descriptor of ``path`` open for appending (created when missing); a link is refused."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise LinkRefusedError(path) from None
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int = 0o644) -> Path:
    """``data`` (text as UTF-8) into ``path`` through ``<path>.partial``, flushed to disk, then
    renamed into place: a crash leaves the old file or the new one, never half of one. A link at
    either name is refused."""
    path = refuse_link(path)
    tmp = path.with_name(path.name + ".partial")
    fd = open_new(tmp, mode)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data.encode("utf-8") if isinstance(data, str) else data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class AppendFileHandler(logging.FileHandler):
    """logging.FileHandler whose file is opened by open_append: a link at the log's name is
    refused, not followed."""

    def _open(self):
        fd = open_append(self.baseFilename)
        return os.fdopen(fd, self.mode, encoding=self.encoding, errors=self.errors)
