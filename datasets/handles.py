"""File handles opened lazily, once per process.

LMDB environments and h5py files must not cross a fork: a handle opened in the parent and used in
a forked worker shares file offsets, locks and library state with its siblings, which gives
corrupted reads or crashes (py-lmdb and HDF5 both document this). So datasets store only paths,
open on first use inside whichever process uses them, and open again when ``os.getpid()``
changes. Handles are dropped when the dataset is pickled (spawn workers), never pickled.

Set ``DATA_OPEN_LOG=/path/file`` to append one line per open ("pid<TAB>purpose<TAB>path"). Tests
use it to prove each worker opens each file exactly once; users can use it to debug the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from datasets.process_id import current_pid
from datasets.safe_files import open_append

H = TypeVar("H")

OPEN_LOG_ENV = "DATA_OPEN_LOG"


def record_open(purpose: str, path: str) -> None:
    """Append an open event to $DATA_OPEN_LOG (one short O_APPEND write: atomic across
    processes)."""
    log_path = os.environ.get(OPEN_LOG_ENV)
    if not log_path:
        return
    line = f"{os.getpid()}\t{purpose}\t{path}\n".encode()
    fd = open_append(log_path)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class ProcessLocalHandle(Generic[H]):
    """Holds one handle per process, created by ``opener(path)`` on first ``get()``."""

    def __init__(self, path: str, opener: Callable[[str], H], closer: Callable[[H], Any]) -> None:
        self.path = path
        self._opener = opener
        self._closer = closer
        self._handle: H | None = None
        self._pid: int | None = None

    def get(self) -> H:
        pid = current_pid()
        if self._handle is None or self._pid != pid:
            # A handle inherited through fork belongs to the parent: forget it without closing
            # (closing it here could release the parent's locks or mappings).
            self._handle = self._opener(self.path)
            self._pid = pid
            record_open("read", self.path)
        return self._handle

    def close(self) -> None:
        if self._handle is not None and self._pid == current_pid():
            self._closer(self._handle)
        self._handle = None
        self._pid = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_pid"] = None
        return state


_bound_pid: int | None = None

# How far up the process tree the dataset's owner may be: the parent for fork and spawn workers,
# the grandparent for forkserver workers (the fork server is the owner's child).
_OWNER_DEPTH = 2


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (another user's process included); a zombie counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc, or None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def owner_is_ancestor(owner_pid: int, depth: int = _OWNER_DEPTH) -> bool:
    """True while ``owner_pid`` is among this process's first ``depth`` ancestors. When the
    owner dies, its descendants are re-parented to init (or a subreaper) and this turns False."""
    pid: int | None = os.getppid()
    for _ in range(depth):
        if pid == owner_pid:
            return True
        if pid is None or pid <= 1:
            return False
        pid = _parent_of(pid)
    return False


# The stop signals a launcher sends to a rank's whole process group.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT in this thread while it starts loader workers (the backends wrap
    the loaders' iter() in this). A worker is born in its trainer's process group and leaves it
    only in die_with_parent; a launcher's group SIGTERM in between killed it (CI: torchrun
    stopped a rank as its evaluation loader started; rank 1's worker was "killed by signal:
    Terminated", rank 1 died and rank 0's all-reduce failed). Held, the signal waits: in the
    trainer until its workers exist (then the stop handler takes it, as a stop request), in a
    worker until it has left the group (then _release_stop_signals drops it). Workers inherit
    the forking thread's mask, through exec too (spawn), so they start with both held."""
    global _starting_workers
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    _starting_workers = True
    try:
        yield
    finally:
        _starting_workers = False
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


# Forked workers (both frameworks' default start method) leave the group at the fork itself, so
# a group signal can reach one only in the moment between fork() and this hook. That matters:
# signals do not queue, so a group SIGTERM still pending when the trainer sends its own (Python
# terminates daemon workers at exit) merges with it, and dropping it would drop both. Spawned
# and forkserver workers leave in die_with_parent; for them the backends' closing of an
# interrupted epoch (torch: _shutdown_workers; Paddle: its generator's close) stops the workers
# by message once they run, so an exit does not wait on a lost signal.
_starting_workers = False


def _leave_group_if_starting_worker() -> None:
    if _starting_workers:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_leave_group_if_starting_worker)


def _release_stop_signals(owner_pid: int) -> None:
    """In a worker that has just left its trainer's process group: drop the stop signals that
    reached it while it was still in the group (they were meant for the trainer, which got its
    own copy), then stop holding them. One its trainer (or parent) sent it is the trainer
    ending it (Python's exit terminates daemon workers): exit quietly, as Torch's own worker
    handler does for its parent's SIGTERM (re-raising it would die "killed by signal", which
    the trainer reports as a lost worker)."""
    from_owner = False
    while (caught := signal.sigtimedwait(STOP_SIGNALS, 0)) is not None:
        from_owner = from_owner or caught.si_pid in (owner_pid, os.getppid())
    if from_owner:
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def die_with_parent(owner_pid: int) -> None:
    """In a loader worker (a process other than ``owner_pid``, the one that built the dataset),
    leave the trainer's process group (see below) and ask the kernel to SIGKILL us when our
    parent dies (for a forkserver worker the parent is the fork server, which exits with the
    owner). Without it, a worker blocked on a full queue outlives a trainer killed with -9 and
    holds its memory and files forever (seen with Paddle's loader). Call it as early as possible
    in the worker (the backends' worker_init_fn): the loaders' own parent watchdogs read the
    parent pid once at start-up, so a worker whose trainer dies while it starts would watch init
    instead and live forever. Once per process; a no-op in the owner and off Linux."""
    global _bound_pid
    pid = current_pid()
    if _bound_pid == pid or pid == owner_pid:
        return
    _bound_pid = pid
    # Leave the trainer's process group, so that only the trainer stops its workers. Launchers
    # stop a rank by signalling its whole group (paddle.distributed.launch: os.killpg SIGTERM up
    # to 3 times, launch/utils/process_context.py; torchrun: os.killpg, elastic/multiprocessing/
    # subprocess_handler), and Torch's and Paddle's workers die of a SIGTERM their parent did
    # not send: the trainer then failed with "DataLoader worker ... killed by signal:
    # Terminated" instead of saving its stop checkpoint. PR_SET_PDEATHSIG below still ends a
    # worker with its trainer.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _release_stop_signals(owner_pid)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if not owner_is_ancestor(owner_pid):  # the owner died before prctl took effect
        os._exit(1)


def start_loader_worker(dataset: Any) -> None:
    """First thing in a loader worker (the backends' worker_init_fn), for any dataset: a
    dataset with ``start_worker`` (RecordDataset) ties the worker's life to its trainer's
    itself; any other is tied to the process that started the worker. Either way the worker
    stops holding the stop signals it was born with (stop_signals_held). A worker left holding
    them lives through its trainer's exit: Python's exit ends daemon workers with SIGTERM and
    waits for them, so the trainer hung at exit on a worker blocked reading its next index."""
    start_worker = getattr(dataset, "start_worker", None)
    if start_worker is not None:
        start_worker()
    else:
        die_with_parent(os.getppid())
