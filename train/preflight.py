"""/dev/shm sizing before the first batch, and the short-shm policy.

Worker processes hand batches to the trainer through shared memory (PyTorch always; Paddle with
use_shared_memory). When /dev/shm is too small (Docker's default is 64 MB) PyTorch dies with
"Bus error" or hangs, and Paddle crashes or silently slows down. We compute the need from the
real sample shapes and say so before starting:

  need = batch bytes x batches in flight per loader (prefetch_factor x num_workers + 2 held by
         the trainer) x loaders alive at once x local ranks x headroom + memory-cache bytes

shm.policy "fail" stops with the fix; "adapt" lowers prefetch_factor, then num_workers, and for
Paddle finally turns use_shared_memory off (pipes: slower, but no shm), with a loud warning that
states the expected slowdown.

Our loaders' batch ring (datasets/batch_ring.py, Paddle and torch) has exactly the batches in
flight of this plan as slots (prefetch_factor x num_workers + 2), so the plan counts it as it is.

Before sizing, the trainer deletes the batch files that dead Paddle processes left in /dev/shm
(:func:`remove_stale_batches`), Paddle's own and our rings', which would otherwise fill it a
little more at every crash, and the bad-sample and in-flight state files that dead trainers
left in the temp directory (:func:`remove_stale_state_files`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets import owner_lock
from datasets.bad_samples import STATE_FILE as BAD_SAMPLES_FILE
from datasets.batch_ring import RING_PREFIX
from datasets.cache import MEMORY_FILE
from datasets.handles import process_alive
from datasets.in_flight import STATE_FILE as IN_FLIGHT_FILE
from train import tasks
from train.config.schema import batches_in_flight
from train.errors import ShmTooSmallError

log = logging.getLogger("train")

SHM_PATH = "/dev/shm"
SHM_FIX = (
    "give the container more shared memory: shm_size: 8g in compose.yaml (docker run "
    "--shm-size=8g), or ipc: host; on Kubernetes mount a memory-backed emptyDir at "
    "/dev/shm; or lower loader.prefetch_factor / loader.num_workers; or set "
    "shm.policy: adapt"
)


def sample_bytes(config, sample: dict | None = None) -> int:
    """Bytes of one collated sample: from a real sample when given, else from the config's
    fixed output shapes (our pipelines always produce these)."""
    if sample is not None:
        return int(sum(np.asarray(v).nbytes for v in sample.values()))
    return tasks.get(config.task).sample_bytes(config.data)


@dataclass
class ShmPlan:
    batch_bytes: int
    batches_in_flight: int
    loaders: int
    local_ranks: int
    cache_bytes: int
    headroom: float

    @property
    def need_bytes(self) -> int:
        ipc = self.batch_bytes * self.batches_in_flight * self.loaders * self.local_ranks
        return int(ipc * self.headroom) + self.cache_bytes * self.local_ranks

    def describe(self) -> str:
        return (
            f"{_mb(self.need_bytes)} = {_mb(self.batch_bytes)}/batch x "
            f"{self.batches_in_flight} in flight x {self.loaders} loader(s) x "
            f"{self.local_ranks} rank(s) x headroom {self.headroom:g}"
            + (f" + memory cache {_mb(self.cache_bytes)}/rank" if self.cache_bytes else "")
        )


def _mb(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def uses_shm(config) -> bool:
    if config.loader.num_workers == 0:
        return False
    return config.framework == "torch" or config.loader.use_shared_memory


def plan(config, local_ranks: int, sample: dict | None = None) -> ShmPlan:
    """The /dev/shm need of ``config``, whose loader section is resolved (train.data.resolve)."""
    loader = config.loader
    in_flight = 0
    if uses_shm(config):
        in_flight = batches_in_flight(loader.num_workers, loader.prefetch_factor)
    # The validation loader's workers are alive at the same time only when persistent.
    loaders = 2 if (config.data.val and loader.persistent_workers) else 1
    batch = max(loader.batch_size, loader.eval_batch_size or 0) * sample_bytes(config, sample)
    cache = config.data.cache_max_bytes if config.data.cache == "memory" else 0
    return ShmPlan(batch, in_flight, loaders, local_ranks, cache, config.shm.headroom)


def shm_free_bytes(path: str = SHM_PATH) -> int:
    try:
        stat = os.statvfs(path)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


# A Paddle worker puts each batch in a file /dev/shm/paddle_<its pid>_<n>_<random>, and the
# trainer unlinks the file once it has taken the batch. Batches still queued when the trainer or
# a worker is killed (kill -9, the OOM killer, a crash) are never taken: their files stay until
# the tmpfs goes, which on a host is never and in a Kubernetes pod outlives container restarts.
_PADDLE_BATCH_FILE = re.compile(r"paddle_(\d+)_\d+_\d+")
# Our loaders' batch ring (datasets/batch_ring.py): the files of one trainer process,
# used only by it and its workers (which die with it), so stale as soon as that process is gone.
_RING_FILE = re.compile(re.escape(RING_PREFIX) + r"(\d+)_[0-9a-f]+_(?:\d+|ctl)")
STALE_AFTER_S = 600.0  # a live batch is taken within seconds; this leaves a wide margin


@dataclass
class StaleFiles:
    sizes: dict[Path, int]  # file -> bytes

    @property
    def paths(self) -> list[Path]:
        return list(self.sizes)

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


def _ours_stale(entry: os.DirEntry, pid: int) -> tuple[bool, bool]:
    """Whether one of our files (a batch ring's, a memory cache, a state file) is dead, and
    whether it is marked by a process this namespace cannot see. Alive while a process holds its
    owner's mark (datasets/owner_lock.py: the file carries it from the moment its name exists
    until its creator removes it or dies, in any PID namespace), and, for a file made before the
    mark existed or where the platform has none, while its pid is alive here."""
    mark = owner_lock.held(entry.path)
    alive_here = process_alive(pid)
    return (not mark and not alive_here), bool(mark) and not alive_here


def stale_batches(
    path: str = SHM_PATH, older_than_s: float = STALE_AFTER_S, now: float | None = None
) -> StaleFiles:
    """The shared-memory files left by dead processes, which no process will ever read.

    Ours (batch rings, data.cache: memory) by :func:`_ours_stale`, whatever their age: that holds
    across PID namespaces. Paddle's batch files carry only a pid, which says nothing about
    another namespace, so they are listed when their creator is gone here and they are older
    than ``older_than_s`` (a batch in flight is young; Paddle's reusable shm-cache buffers have a
    live creator), and not at all when this /dev/shm shows another PID namespace at work (a live
    file of ours whose pid is not alive here): a live run there would lose its batches."""
    now = time.time() if now is None else now
    stale, paddle, shared = StaleFiles({}), StaleFiles({}), False
    for entry in _scan(path):
        ours = _RING_FILE.fullmatch(entry.name) or MEMORY_FILE.fullmatch(entry.name)
        match = ours or _PADDLE_BATCH_FILE.fullmatch(entry.name)
        if not match:
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # taken meanwhile
        pid = int(match.group(1))
        if ours:
            dead, elsewhere = _ours_stale(entry, pid)
            if dead:
                stale.sizes[Path(entry.path)] = stat.st_size
            shared = shared or elsewhere
        elif now - stat.st_mtime >= older_than_s and not process_alive(pid):
            paddle.sizes[Path(entry.path)] = stat.st_size
    if shared and paddle.sizes:
        log.info(
            "%s: %d Paddle batch file(s) of processes not visible here kept: this /dev/shm is "
            "shared with another PID namespace, where they may be alive",
            path,
            len(paddle.sizes),
        )
    elif paddle.sizes:
        stale.sizes.update(paddle.sizes)
    return stale


def remove_stale_batches(path: str = SHM_PATH, older_than_s: float = STALE_AFTER_S) -> int:
    """Delete :func:`stale_batches`; return the bytes freed (logged when any)."""
    return _remove(
        stale_batches(path, older_than_s),
        path,
        "Paddle's batch files, batch rings, data.cache: memory",
    )


def stale_state_files(path: str) -> StaleFiles:
    """The bad-sample counters and in-flight tables (datasets/bad_samples.py,
    datasets/in_flight.py) in the temp directory, and memory caches that fell back to it (no
    /dev/shm), whose run is dead by :func:`_ours_stale`. A run killed with -9 or crashed leaves
    them behind: a few KB plus one byte per sample each, which on a host running tests piled up
    by the hundred."""
    stale = StaleFiles({})
    for entry in _scan(path):
        match = (
            BAD_SAMPLES_FILE.fullmatch(entry.name)
            or IN_FLIGHT_FILE.fullmatch(entry.name)
            or MEMORY_FILE.fullmatch(entry.name)
        )
        if not match:
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        if _ours_stale(entry, int(match.group(1)))[0]:
            stale.sizes[Path(entry.path)] = stat.st_size
    return stale


def remove_stale_state_files(path: str | None = None) -> int:
    """Delete :func:`stale_state_files`; return the bytes freed (logged when any)."""
    path = tempfile.gettempdir() if path is None else path
    kinds = "bad-sample counters, in-flight tables, data.cache: memory"
    return _remove(stale_state_files(path), path, kinds)


def _scan(path: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _remove(stale: StaleFiles, path: str, kinds: str) -> int:
    removed, freed = 0, 0
    for file, size in stale.sizes.items():
        try:
            file.unlink()
        except OSError:
            continue  # another rank removed it first, or it is another user's (sticky directory)
        removed, freed = removed + 1, freed + size
    if removed:
        log.warning(
            "%s: removed %d file(s), %s, left by processes that died without removing them (%s)",
            path,
            removed,
            _mb(freed),
            kinds,
        )
    return freed


def apply_policy(config, local_ranks: int, sample: dict | None = None, free: int | None = None):
    """Return ``config`` (its loader.num_workers resolved), or a copy with lower loader knobs,
    that fits /dev/shm; or raise ShmTooSmallError (policy fail)."""
    free = shm_free_bytes() if free is None else free
    first = plan(config, local_ranks, sample)
    if first.need_bytes <= free:
        log.info("/dev/shm: need %s, %s free: OK", first.describe(), _mb(free))
        return config
    problem = (
        f"/dev/shm too small: this config needs {first.describe()}, but only "
        f"{_mb(free)} is free in {SHM_PATH}"
    )
    if config.shm.policy == "fail":
        raise ShmTooSmallError(f"{problem}. HINT: {SHM_FIX}")
    adapted = _adapt(config, local_ranks, sample, free)
    workers, new_workers = config.loader.num_workers, adapted.loader.num_workers
    after = plan(adapted, local_ranks, sample)
    log.warning(
        "%s. shm.policy=adapt: continuing with prefetch_factor=%s num_workers=%d "
        "use_shared_memory=%s (need now %s). EXPECT SLOWER INPUT: about %d/%d of the configured "
        "worker throughput%s. Fix: %s",
        problem,
        adapted.loader.prefetch_factor,
        new_workers,
        adapted.loader.use_shared_memory,
        _mb(after.need_bytes),
        max(new_workers, 1),
        max(workers, 1),
        ", batches travel through pipes instead of shared memory"
        if not adapted.loader.use_shared_memory and config.loader.use_shared_memory
        else "",
        SHM_FIX,
    )
    return adapted


def _with_loader(config, **changes):
    return dataclasses.replace(config, loader=dataclasses.replace(config.loader, **changes))


def _adapt(config, local_ranks, sample, free):
    def fits(cfg):
        return plan(cfg, local_ranks, sample).need_bytes <= free

    workers = config.loader.num_workers
    candidate = _with_loader(config, prefetch_factor=1) if workers else config
    if fits(candidate):
        return candidate
    for n in range(workers - 1, 0, -1):
        if fits(_with_loader(candidate, num_workers=n)):
            return _with_loader(candidate, num_workers=n)
    if config.framework == "paddle":
        # Paddle can hand batches over through pipes: every worker kept, no shm used.
        return _with_loader(candidate, use_shared_memory=False)
    no_workers = _with_loader(candidate, num_workers=0)
    if fits(no_workers):  # torch: no workers means no IPC at all
        return _with_loader(no_workers, persistent_workers=False)
    raise ShmTooSmallError(
        f"/dev/shm has {_mb(free)} free, too little even for the memory "
        f"cache alone. HINT: {SHM_FIX}"
    )
