"""An owner's mark on a shared file that any process can test, in any PID namespace.

The batch rings, the memory cache and the state files live in /dev/shm and the temp directory,
named after the pid of the process that made them. A crashed run leaves them behind, and the
start-up sweep (train/preflight.py) removes them, but a pid says nothing across PID namespaces:
with a /dev/shm shared between containers (``ipc: host``, a pod's memory-backed emptyDir) a live
run of another container has a pid that looks dead here. So the creator also holds a read lock on
the file's first byte for as long as it lives, and the sweep asks the kernel whether anyone holds
one. Locks belong to the inode, so the answer is the same in every namespace, and the kernel drops
the lock when the last process holding the file open dies, however it dies.

The lock is an open-file-description lock (``F_OFD_SETLK``, Linux 3.15+): it is independent of
the ``flock`` that SharedBlock takes for its updates, it is shared with forked workers (which keep
the file alive while they run) and, unlike a classic ``fcntl`` lock, it is not dropped when the
same process closes another descriptor of the file. Where the platform has no such locks,
:func:`hold` does nothing and :func:`held` answers None: the sweep then goes by pid alone.

:func:`create_marked` makes the file nameless (``O_TMPFILE``), marks and sizes it, and only then
links it under its name, so no process ever sees the name without the mark: a sweep in another
namespace needs no grace period for new files, and none for files written until a moment ago
(their times say nothing about their owner).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (padded).
_FLOCK = struct.Struct("@hhqqi4x")
_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
_GETLK = getattr(fcntl, "F_OFD_GETLK", None)


def _request(kind: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 1, 0)  # the first byte; l_pid must be 0 for OFD


def hold(fd: int) -> None:
    """Mark the file open on ``fd`` as owned while ``fd`` (or a forked copy of it) is open."""
    if _SETLK is not None:
        fcntl.fcntl(fd, _SETLK, _request(fcntl.F_RDLCK))


def held(path: str | os.PathLike[str]) -> bool | None:
    """Whether a live process holds the owner's mark on ``path``; None when this platform cannot
    tell (no OFD locks) or the file cannot be opened (gone, or another user's)."""
    if _GETLK is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        answer = fcntl.fcntl(fd, _GETLK, _request(fcntl.F_WRLCK))
    except OSError:
        return None
    finally:
        os.close(fd)
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


# Filesystems or kernels without unnamed files answer these; the file is then made by name.
_NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT}


def create_marked(path: str, size: int = 0, mode: int = 0o600) -> int:
    """A new file at ``path`` that carries the owner's mark from the moment its name exists;
    return its descriptor (keep it open: the mark lasts as long as it, or a fork's copy). Raises
    FileExistsError when anything is at ``path`` (a symlink included: none is followed), as
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` would.

    Where unnamed files are not available (``O_TMPFILE``: Linux 3.11+, on tmpfs and the common
    disk filesystems), the file is created by name and marked right after, a window of two
    system calls in which a sweep sees it unmarked."""
    directory = os.path.dirname(path) or "."
    tmpfile = getattr(os, "O_TMPFILE", None)
    if tmpfile is not None and _SETLK is not None and os.path.isdir("/proc/self/fd"):
        try:
            fd = os.open(directory, tmpfile | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), mode)
        except OSError as error:
            if error.errno not in _NO_TMPFILE:
                raise
        else:
            try:
                hold(fd)
                os.ftruncate(fd, size)
                # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names the open file (a dir fd makes
                # os.link call linkat; plain link() would link the /proc symlink itself). Like
                # O_EXCL it fails with EEXIST whatever is at ``path``, and follows no symlink there.
                proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.link(str(fd), path, src_dir_fd=proc_fds, follow_symlinks=True)
                finally:
                    os.close(proc_fds)
            except BaseException:
                os.close(fd)
                raise
            return fd
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        hold(fd)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd
