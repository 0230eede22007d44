"""Every workaround this project needs for PaddlePaddle 2.6, in one place. Imported first by
the train.backends.paddle package, so nothing of ours imports paddle before it.

zlib (docs/paddle_png_zlib.md). libpaddle.so carries its own zlib 1.2.8 and exports its symbols.
- Python's zlib module (gzip, aiohttp under s3fs, PNG paths) loaded after ``import paddle`` binds
  to that copy and fails with "zlib.error: inconsistent stream state" or aborts in
  inflateReset2: so ``import zlib`` comes first here.
- If libpaddle.so is the first library to load the system libz.so.1, libz's own internal calls
  bind to paddle's older copies, and every later PNG decode (OpenCV, PIL) may crash or fail:
  so the system libz is loaded (ctypes) before paddle, every loader and every worker checks the
  load order (check_zlib_load_order), and spawned workers, which import paddle before any of
  our code, get the system libz in LD_PRELOAD (zlib_preloaded_in_new_processes).
- Remote data is staged before any framework is imported (train/__main__.py), so the S3 client
  never runs in a process with paddle's zlib.

The DataLoader (2.6):
- with persistent workers, every epoch start waits in 0.5 s sleeps (_ShortPolls, patched in);
- a non-persistent iterator leaks its worker queues' pipes (closing_pipes);
- ``timeout`` is only the dead-worker poll interval: a hung worker stalls training forever
  (with_deadline gives a real per-batch timeout, and release_stuck_iterator lets the stuck
  epoch's threads end before the interpreter does).
"""

from __future__ import annotations

import zlib  # noqa: F401  (Python's zlib module: before paddle; see above)

# isort: split
import atexit
import contextlib
import ctypes
import os
import queue
import threading
import time
import types
from collections.abc import Callable, Iterator


def _load_system_zlib() -> None:
    """Load libz.so.1 in its own link-map group, so its symbols bind to itself, not to paddle."""
    # No shared system zlib (macOS, static builds): then there is nothing to clash with.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libz.so.1")


_load_system_zlib()  # must run before `import paddle` below

import paddle.io.dataloader.dataloader_iter as _paddle_loader_iter  # noqa: E402


# ---------------------------------------------------------------- the loader's epoch-start poll
class _ShortPolls:
    """Paddle 2.6's loader iterator uses ``time`` only to poll: with persistent workers, every
    epoch start (``_reset``) waits for its workers in ``time.sleep(0.5)`` steps, so each epoch
    began at least 0.5 s late (measured: epoch 2's first batch 0.55 s vs 0.10 s for epoch 1).
    Polling every 2 ms keeps the same loops and conditions, without the dead time."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(min(seconds, 0.002))


_paddle_loader_iter.time = _ShortPolls()

# ---------------------------------------------------------------- zlib load order
ZLIB_DOC = "docs/paddle_png_zlib.md"


class ZlibLoadOrderError(RuntimeError):
    """libpaddle.so loaded the system zlib: PNG decoding in this process would crash."""


class _DlPhdrInfo(ctypes.Structure):
    # The leading fields of glibc's struct dl_phdr_info; the callback reads only the name.
    _fields_ = [
        ("dlpi_addr", ctypes.c_void_p),
        ("dlpi_name", ctypes.c_char_p),
        ("dlpi_phdr", ctypes.c_void_p),
        ("dlpi_phnum", ctypes.c_uint16),
    ]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t, ctypes.c_void_p
)


def loaded_libraries() -> list[str]:
    """Paths of this process's shared objects in load order (glibc's link map); empty where
    dl_iterate_phdr is not available."""
    paths: list[str] = []

    def collect(info, _size, _data) -> int:
        paths.append((info.contents.dlpi_name or b"").decode(errors="replace"))
        return 0

    try:
        iterate = ctypes.CDLL(None).dl_iterate_phdr
    except (AttributeError, OSError):
        return paths
    iterate(_PHDR_CALLBACK(collect), None)
    return paths


def _first(paths: list[str], match) -> int | None:
    return next((i for i, path in enumerate(paths) if match(os.path.basename(path))), None)


def _is_system_zlib(name: str) -> bool:
    return name.startswith("libz.so")  # not the renamed private copies wheels bundle


def zlib_load_order_problem() -> str | None:
    """Why PNG decoding is unsafe in this process, or None when it is safe.

    The system libz.so.1 is unsafe exactly when it entered the link map after libpaddle.so: it was
    then loaded as libpaddle.so's dependency, and the dynamic linker resolved libz's own calls
    (inflateReset2, deflate, ...) in libpaddle.so's scope, which finds paddle's zlib 1.2.8 first.
    """
    paths = loaded_libraries()
    paddle_at = _first(paths, lambda name: name == "libpaddle.so")
    zlib_at = _first(paths, _is_system_zlib)
    if paddle_at is None or zlib_at is None or zlib_at < paddle_at:
        return None
    return (
        f"pid {os.getpid()}: libpaddle.so was loaded before the system zlib ({paths[zlib_at]}), "
        "so zlib calls from OpenCV/PIL (every PNG decode) and Python's zlib module run into "
        "paddle's bundled zlib 1.2.8 and crash or fail. Import cv2, numpy or "
        "train.backends.paddle before paddle in the main script, or start Python with "
        "LD_PRELOAD=libz.so.1. See " + ZLIB_DOC
    )


def check_zlib_load_order() -> None:
    problem = zlib_load_order_problem()
    if problem:
        raise ZlibLoadOrderError(problem)


@contextlib.contextmanager
def zlib_preloaded_in_new_processes() -> Iterator[None]:
    """While Paddle starts spawn/forkserver workers, put the system zlib in LD_PRELOAD.

    Such a worker is a fresh interpreter that imports paddle (to unpickle its worker loop)
    before any of our code, so the guard at the top of this module comes too late there.
    Preloaded, libz is in the global scope before libpaddle.so exists. Restored afterwards, so
    no other child process of the trainer sees it.
    """
    paths = loaded_libraries()
    at = _first(paths, _is_system_zlib)
    previous = os.environ.get("LD_PRELOAD")
    if at is None or (previous and paths[at] in previous.split()):
        yield
        return
    os.environ["LD_PRELOAD"] = f"{paths[at]} {previous}" if previous else paths[at]
    try:
        yield
    finally:
        if previous is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = previous


# ---------------------------------------------------------------- the loader's pipes and timeout
def closing_pipes(iterator: Iterator) -> Iterator:
    """Yield from a non-persistent Paddle iterator, then close its worker queues' pipes.

    Paddle 2.6 shuts its queues down with Queue.close(), which leaves both pipe ends open until
    the iterator is garbage collected, and Paddle keeps a reference to it: every epoch leaked
    about ten descriptors (4 -> 70 over 100 short epochs) until "Too many open files"."""
    try:
        yield from iterator
    finally:
        if not getattr(iterator, "_shutdown", True):
            iterator._try_shutdown_all()  # abandoned mid-epoch (max_steps, an error)
        for q in [
            getattr(iterator, "_data_queue", None),
            *getattr(iterator, "_indices_queues", []),
        ]:
            # A queue this process wrote to has a feeder thread that closes both ends itself
            # once close() reaches it; closing them under it raises in that thread.
            if q is None or getattr(q, "_thread", None) is not None:
                continue
            for end in (q._reader, q._writer):
                with contextlib.suppress(OSError):
                    end.close()


_END = object()


def release_stuck_iterator(iterator, worker_wait_s: float = 1.0) -> None:
    """End a multi-process Paddle iterator whose epoch timed out: its fetch thread is told to
    stop and its blocking queue closed (so a read waiting in it ends), its workers, the hung one
    too, are killed and then reaped.

    with_deadline calls this at interpreter exit, after the run's error has named the hung
    worker. Left alone, the threads blocked in Paddle's C++ reader were woken by the exit's own
    worker shutdown while Python was finalizing, and a thread unwinding through C++ then ended
    the process with "terminate called without an active exception" (SIGABRT) instead of the
    run's exit code."""
    # Paddle's SIGCHLD handler raises for a tracked worker killed by a signal: untrack them.
    _paddle_loader_iter.core._erase_process_pids(id(iterator))
    iterator._exit_thread_expectedly()
    for worker in iterator._workers:
        if worker.is_alive():
            worker.kill()
    iterator._try_shutdown_all(timeout=worker_wait_s)


def _release_at_exit(release: Callable[[], None], pump: threading.Thread) -> None:
    release()
    pump.join(timeout=10.0)


def with_deadline(
    batches: Iterator, timeout_s: float, release: Callable[[], None] | None = None
) -> Iterator:
    """Yield from ``batches`` (run in a pump thread); raise TimeoutError after ``timeout_s``
    without a batch. The pump stops when the consumer stops, so no thread outlives the epoch;
    after a timeout the pump is blocked in the stuck iterator, so ``release``
    (release_stuck_iterator of the epoch's iterator) unblocks it at exit, and it is waited for."""
    handoff: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def offer(item: tuple) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for batch in batches:
                if not offer((batch, None)):
                    return
            offer((_END, None))
        except BaseException as error:  # re-raised in the consumer thread
            offer((_END, error))

    thread = threading.Thread(target=pump, name="paddle-loader-pump", daemon=True)
    thread.start()
    stuck = False
    try:
        while True:
            try:
                batch, error = handoff.get(timeout=timeout_s)
            except queue.Empty:
                stuck = True
                raise TimeoutError(
                    f"no batch from the DataLoader workers in {timeout_s:g} s "
                    "(loader.timeout_s): a worker is stuck, e.g. on slow or dead storage. "
                    "Raise loader.timeout_s, or set it to 0 to wait forever"
                ) from None
            if error is not None:
                raise error
            if batch is _END:
                return
            yield batch
    finally:
        stop.set()
        if stuck and release is not None:
            # At exit, before multiprocessing's own handler (atexit runs the last registered
            # first), so that the error reported first can name the worker as hung.
            atexit.register(_release_at_exit, release, thread)
        if not stuck:
            # Wait (for at most one batch) until the pump lets go of Paddle's iterator, so that
            # Paddle stops its workers now and not during interpreter exit, where it would log
            # "DataLoader workers exit unexpectedly" after a clean run.
            thread.join(timeout=min(timeout_s, 30.0))
        if not thread.is_alive() and isinstance(batches, types.GeneratorType):
            # End the epoch and its workers (_closing_pipes) now, not when this frame is
            # collected: a traceback keeps the frame, and IPython keeps the last one (for
            # %debug), so a notebook cell interrupted in next() kept its workers after `del`.
            batches.close()
