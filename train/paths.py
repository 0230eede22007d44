"""Can this process write where a run will write, and read what it will read? Asked by trying.

os.access() answers from the mode bits and our uid, and is wrong exactly where it matters: on a
read-only mount (the bits say writable, the mount refuses), on root-squashed NFS (the server maps
root to nobody, whatever the bits say locally), and for root itself (it answers yes to nearly
everything, and a read-only mount or the server refuses anyway). ACLs are outside its answer too,
and a directory the run will create (as mkdir -p would) does not exist yet to be asked about.
So the probes here really do it: the write probe creates the missing directories, creates, writes
and removes a file, then removes the directories it made; the read probe enters, lists and opens
what a run will read. A failure names the path that refused, its owner and mode, and our uid,
and the fix texts say what to change.

Framework-free (the standard library only): used by the doctor (train/doctor.py) and by
scripts/check_scenarios.py, so that both ask the same question the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

RUN_AS_OWNER = "run as the owner (HOST_UID=$(id -u) in compose)"


# ---------------------------------------------------------------- describing a refusal
def whoami() -> str:
    return f"we are uid {os.getuid()} gid {os.getgid()}"


def strerror(exc: OSError) -> str:
    return exc.strerror or str(exc)


def describe_path(path: Path) -> str:
    """``/runs: owner 0:0, mode drwxr-xr-x (0755)``: what a chown/chmod fix needs."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: cannot stat ({exc.strerror})"
    mode = f"{stat.filemode(st.st_mode)} ({stat.S_IMODE(st.st_mode):04o})"
    return f"{path}: owner {st.st_uid}:{st.st_gid}, mode {mode}"


def denial(action: str, where: Path, error: OSError) -> str:
    """``cannot create a file in /runs: Permission denied (/runs: owner ..., mode ...; we are
    uid ...)``: what failed where, and who asked."""
    return f"cannot {action} {where}: {strerror(error)} ({describe_path(where)}; {whoami()})"


def nearest_existing(path: Path) -> Path:
    """``path`` itself, or its closest ancestor that exists (where mkdir -p would start)."""
    path = Path(os.path.abspath(path))
    # os.path.exists, not Path.exists: on Python 3.10/3.11 the latter raises PermissionError
    # for a path under a directory we cannot enter, and the probe must report that, not crash.
    return next((p for p in [path, *path.parents] if os.path.exists(p)), Path("/"))


# ---------------------------------------------------------------- writing
@dataclass
class WriteProbe:
    """Whether a file can really be created in ``path`` (created first if missing, as training
    would, and removed again). ``blocker`` is the directory where it failed."""

    path: Path
    error: OSError | None = None
    blocker: Path | None = None
    action: str = ""  # what failed: "create a file in", "create a directory in", ...
    existed: bool = True
    free_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def problem(self) -> str | None:
        """None when writable, else one line: ``PATH: cannot ACTION BLOCKER: why (owner, mode;
        our uid)``."""
        if self.error is None:
            return None
        return f"{self.path}: {denial(self.action, self.blocker or self.path, self.error)}"

    def fail(self, error: OSError, blocker: Path, action: str) -> WriteProbe:
        self.error, self.blocker, self.action = error, blocker, action
        return self


def _missing_parts(probe: WriteProbe) -> list[Path] | None:
    """The directories of ``probe.path`` that do not exist yet, outermost first; None (with the
    failure recorded on ``probe``) when an existing part cannot be entered or is not a directory."""
    chain = [*reversed(probe.path.parents), probe.path]
    for i, p in enumerate(chain):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return chain[i:]
        except OSError as exc:  # EACCES: the parent may not be entered; ENOTDIR: a file on the way
            probe.fail(exc, p.parent, "enter")
            return None
        if not stat.S_ISDIR(st.st_mode):
            exc = NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(p))
            probe.fail(exc, p, "use")
            return None
    return []


def probe_writable(path: str | os.PathLike) -> WriteProbe:
    """Create the missing directories of ``path``, create, write and remove a file in it, then
    remove the directories this made. os.access is not enough: read-only mounts, NFS root squash
    and ACLs only show when a write is tried."""
    probe = WriteProbe(Path(os.path.abspath(path)))
    missing = _missing_parts(probe)
    if missing is None:
        return probe
    probe.existed = not missing
    created: list[Path] = []
    try:
        for p in missing:
            try:
                os.mkdir(p)
            except FileExistsError:
                continue  # made meanwhile by someone else (another rank, another pod)
            except OSError as exc:
                return probe.fail(exc, p.parent, "create a directory in")
            created.append(p)
        try:
            fd, name = tempfile.mkstemp(dir=probe.path, prefix=".doctor-write-test-")
            try:
                os.write(fd, b"doctor")
            finally:
                os.close(fd)
                os.unlink(name)
        except OSError as exc:
            return probe.fail(exc, probe.path, "create a file in")
        probe.free_bytes = shutil.disk_usage(probe.path).free
        return probe
    finally:
        for p in reversed(created):  # training makes them again; the probe leaves no trace
            with contextlib.suppress(OSError):
                os.rmdir(p)


def write_problem(directory: str | os.PathLike) -> str | None:
    """None when files can be created in ``directory`` (made first if missing, like mkdir -p,
    and removed again); otherwise one line naming what refused, its owner and mode, and our uid."""
    return probe_writable(directory).problem


def write_fix(probe: WriteProbe, elsewhere: str) -> str:
    """The fix for a failed write probe, by its cause."""
    code = probe.error.errno if probe.error is not None else None
    blocker = probe.blocker or probe.path
    if code == errno.EROFS:
        return f"{blocker} is on a read-only mount: mount it read-write (no :ro), or {elsewhere}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"free space (or raise the quota) on the volume of {blocker}, or {elsewhere}"
    if code == errno.ENOTDIR:
        return f"remove or rename {blocker}, or {elsewhere}"
    return (
        f"{RUN_AS_OWNER}, or chown {os.getuid()}:{os.getgid()} {blocker} (on the host, for a "
        f"volume), or {elsewhere}"
    )


def first_unwritable(
    directories: Iterable[Path], files: Iterable[Path]
) -> tuple[Path, OSError] | None:
    """The first of the existing ``directories`` where no file can be created, or of the existing
    ``files`` that cannot be opened for appending (nothing is written: contents and mtime stay as
    they are), with the error. What is missing is skipped: it will be created."""
    for directory in directories:
        if directory.is_dir():
            probe = probe_writable(directory)
            if not probe.ok:
                return probe.blocker or directory, probe.error
    for path in files:
        if path.is_file():
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
            except OSError as exc:
                return path, exc
    return None


# ---------------------------------------------------------------- reading
def _open_error(path: Path) -> OSError | None:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        return exc
    return None


def first_unreadable(paths: list[str | os.PathLike]) -> tuple[Path, str, OSError] | None:
    """The first of ``paths`` (and what lies on the way to them) that this user cannot read:
    (path, what failed, the error). Directories are walked; data.mdb files are opened."""
    for raw in paths:
        path = Path(os.path.abspath(raw))
        for p in [*reversed(path.parents), path]:
            try:
                st = os.stat(p)
            except FileNotFoundError:
                break  # missing, not unreadable: the caller says so itself
            except OSError as exc:
                return p.parent, "enter", exc
        else:
            if not stat.S_ISDIR(st.st_mode):
                exc = _open_error(path)
                if exc is not None:
                    return path, "read", exc
                continue
            errors: list[OSError] = []
            for root, _dirs, files in os.walk(path, onerror=errors.append):
                if errors:
                    break
                for name in files:
                    if name == "data.mdb" and (exc := _open_error(Path(root) / name)) is not None:
                        return Path(root) / name, "read", exc
            if errors:
                exc = errors[0]
                return Path(exc.filename or path), "list", exc
    return None


def read_problem(path: str | os.PathLike) -> str | None:
    """None when ``path`` can be read (or is missing); otherwise one line naming what refused
    (``PATH: cannot read|list|enter WHERE: why (owner, mode; our uid)``)."""
    denied = first_unreadable([path])
    if denied is None:
        return None
    where, action, error = denied
    return f"{path}: {denial(action, where, error)}"


def read_fix(where: Path, action: str, elsewhere: str) -> str:
    """The fix for what :func:`first_unreadable` found."""
    chmod = {"enter": "a+x", "list": "-R a+rX"}.get(action, "a+r")
    return (
        f"make it readable for uid {os.getuid()} (on the host: chmod {chmod} {where}), "
        f"or {RUN_AS_OWNER}, or {elsewhere}"
    )
