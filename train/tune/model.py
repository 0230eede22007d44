"""The tuner's model of an input pipeline: from measured stage costs and host facts to the
predicted throughput of every loader setting, and the bottleneck that holds each.

Operational analysis, as Plumber (Kuchnik et al., MLSys 2022) does for tf.data: each resource
a batch passes through has a service demand per batch (seconds of a worker, CPU seconds of the
cores, CPU seconds of the trainer process, seconds of the device, bytes of the storage), and the
pipeline cannot run faster than its most loaded resource:

    rate <= workers / (worker_cpu + wait)     the workers, each one batch at a time
    rate <= cores / (worker_cpu + main_s)     every CPU second, the trainer's included
    rate <= 1 / main_s                        the trainer's own hand-over of each batch
    rate <= storage rate / bytes it serves    the storage, for reads no cache serves
    rate <= 1 / step_s                        the device (the GPU's step, or --step-ms)

A read that waits on storage (its latency: wall time beyond its CPU time) holds its worker but
no core: the wait counts in the workers' bound and not in the cores'. Each worker waits on its
own reads, so more workers overlap more waits, up to the cores (the CPU) or the storage's rate.

A step on the CPU (train.device: cpu) is CPU seconds of the trainer process too: it joins the
trainer's and the cores' demand, and loading without workers is serial with it.

With no workers the trainer reads each batch itself, while the device runs the step it queued
(CUDA steps are asynchronous), so rate = 1 / max(load_s, step_s).

What a batch costs a worker is read + decode + augment for each sample, the collate, and the
worker's side of the hand-over; the trainer's side is its whole work on a batch (receiving it,
to the device, normalizing). Both sides of the hand-over are measured on the real loader with
the ring on and off (bench/handover.py counts the copies that make them differ); the cache
changes the read. The prefetch depth does not raise the bound: it absorbs the spread of batch
times, and a batch that takes longer than the batches in flight can cover stalls the trainer.
That loss is modelled as a factor 1 / (1 + closeness x cv^2 / (2 Q)): cv the batch time's
coefficient of variation, Q = workers x prefetch the batches in flight (1 without workers),
closeness = the slower of loader and device over the faster. Kingman's approximation of a
queue's wait grows with the spread of service times and with how close the two rates are; the
buffer divides it. The verified runs then measure what the model cannot see.

Pure: no framework, no I/O. The measurements come from train/tune/measure.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from datasets.cache import DEFAULT_CACHE_MAX_BYTES, RECORD_FRAMING_BYTES
from train.cpus import MAX_USEFUL_WORKERS as MAX_WORKERS

# Bottlenecks, by name, and the sentence the tuner's report and tuned.yaml give each.
GPU, CPU, DISK, SHM, HANDOVER = "gpu", "cpu", "disk", "shm", "handover"
BOTTLENECK_TEXT = {
    GPU: "none in the input pipeline: the device's step is the limit",
    CPU: "CPU: the workers' decode and augmentation use every core this process may use",
    DISK: "storage: the workers wait on reads from storage longer than they compute, or the "
    "storage's read rate is the limit (a record cache that fits, or more workers to overlap "
    "the waits, helps)",
    SHM: "/dev/shm: a faster setting needs more shared memory than is free",
    HANDOVER: "hand-over: the trainer process's work on each batch it receives (taking it from "
    "the workers, moving it to the device, normalizing it) takes longer than the workers need",
}

# The resources a batch passes through, the keys of Prediction.limits.
DEVICE, WORKERS, CORES, TRAINER, STORAGE = "device", "workers", "cores", "trainer", "storage"
# What an infeasible setting lacks besides /dev/shm (SHM): memory, room in data.cache_dir.
MEMORY, CACHE_DIR = "memory", "cache_dir"

PREFETCH_CHOICES = (1, 2, 4)
CACHE_CHOICES = ("none", "memory", "disk")
# Reads that wait on storage (a network volume's round trip) hold a worker but no core: while a
# sample waits longer than it computes, more workers than cores keep the cores busy, about
# cores x (1 + wait / CPU) of them. The grid then reaches that far, but not past 16 workers per
# rank: each is a process with its own memory, file handles and batches in /dev/shm, and past
# that a record cache serves such reads better.
MAX_WORKERS_FOR_WAITS = 16


@dataclass(frozen=True)
class StageCosts:
    """What one sample costs, measured on the real data (seconds; bytes)."""

    read_s: float  # the first read of a record from storage, wall time
    read_cpu_s: float  # the same read's CPU time (the rest of its wall time waits on storage)
    reread_s: float  # the same record read again (the page cache's speed), wall time
    reread_cpu_s: float  # the re-read's CPU time
    decode_s: float  # decoding the image
    augment_s: float  # the rest of the transform: augmentation, resize, label encoding
    collate_s: float  # stacking into the batch and the dataset's per-batch work, per sample
    # Per batch, beyond making it (the real loader's CPU seconds, train/tune/measure.py): the
    # trainer's own work without workers (to tensors, to the device, normalization), and with
    # workers, by batch ring on/off, each side's: the worker's hand-over, the trainer's whole.
    trainer_alone_s: float
    worker_handover_s: dict  # {ring: seconds}
    trainer_handover_s: dict  # {ring: seconds}
    sample_bytes: int  # one collated sample (what is handed over)
    record_bytes: float  # one stored record, encoded
    batch_cv: float  # coefficient of variation of a batch's time in a worker
    # Bytes of records per second the data's storage serves to reads the page cache does not
    # (measure.storage_read_rate); math.inf when it could not be measured: no storage bound.
    storage_bytes_per_s: float

    @property
    def transform_s(self) -> float:
        return self.decode_s + self.augment_s

    @property
    def read_wait_s(self) -> float:
        """What a first read waits on storage: wall time beyond its CPU time."""
        return max(0.0, self.read_s - self.read_cpu_s)

    @property
    def reread_wait_s(self) -> float:
        return max(0.0, self.reread_s - self.reread_cpu_s)


@dataclass(frozen=True)
class Host:
    """What this host (this container) gives the loader."""

    cores: int  # usable by this process: affinity and cgroup quota (train/cpus.py)
    shm_free_bytes: int
    memory_available_bytes: int  # for the page cache (and a memory cache)
    dataset_bytes: int  # the training data on storage
    cache_dir_free_bytes: int  # where data.cache: disk would write
    copy_bytes_per_s: float  # memcpy into pages already mapped: a cache hit's cost per byte
    busy_elsewhere: float = 0.0  # cores other processes kept busy while the tuner measured
    # A data.cache: disk file of this dataset version and cache size is already in the cache
    # folder: a run reuses it and reserves nothing more.
    disk_cache_built: bool = False


@dataclass(frozen=True)
class Target:
    """The run the loader must feed."""

    framework: str
    batch_size: int  # per rank
    step_s: float  # the device's step, per rank
    local_ranks: int = 1  # ranks on this node: each has its own loader and a share of cores
    step_on_cpu: bool = False  # the step is computed on this host's CPU (train.device: cpu)
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES  # data.cache_max_bytes
    shm_need: object = None  # (Candidate) -> bytes of /dev/shm it needs for every rank


@dataclass(frozen=True, order=True)
class Candidate:
    workers: int
    prefetch: int
    cache: str
    ring: bool

    def label(self) -> str:
        if self.workers == 0:
            return f"workers=0 cache={self.cache}"
        ring = "on" if self.ring else "off"
        return f"workers={self.workers} prefetch={self.prefetch} cache={self.cache} ring={ring}"

    def cost(self) -> tuple:
        """Cheaper first: fewer processes, fewer batches held in /dev/shm, no cache (it holds
        the dataset in memory or on disk), then the ring (it costs nothing but is ours)."""
        return (self.workers, self.prefetch, CACHE_CHOICES.index(self.cache), not self.ring)


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    samples_per_s: float
    bottleneck: str
    limits: dict  # {resource (DEVICE, WORKERS, CORES, TRAINER, STORAGE): samples/s it allows}
    shm_bytes: int
    feasible: bool
    why_not: str = ""  # for an infeasible candidate: what it lacks
    lacks: str = ""  # for an infeasible candidate: SHM, MEMORY or CACHE_DIR


@dataclass(frozen=True)
class Read:
    """A sample's read from epoch 2 on, as the model charges it."""

    cpu_s: float  # what it demands of a core
    wait_s: float  # what it waits on storage: it holds its worker, not a core
    storage_share: float  # the share of reads the storage serves (no cache, no page cache)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def cache_bytes(costs: StageCosts, host: Host, target: Target, cache: str) -> int:
    """Bytes a record cache of this kind takes, per rank for ``memory``, once for ``disk``
    (datasets/cache.py). A memory cache is a sparse file in /dev/shm that grows as it fills, up
    to data.cache_max_bytes: the dataset's records at most. A disk cache reserves its whole
    file at start: the dataset's bytes plus RECORD_FRAMING_BYTES a record, at most
    data.cache_max_bytes."""
    if cache == "memory":
        return min(target.cache_max_bytes, host.dataset_bytes)
    if cache == "disk":
        records = host.dataset_bytes / max(costs.record_bytes, 1.0)
        framed = host.dataset_bytes + RECORD_FRAMING_BYTES * records
        return int(min(target.cache_max_bytes, framed))
    return 0


def cache_fraction(costs: StageCosts, host: Host, target: Target, cache: str) -> float:
    """The share of the dataset a cache of this kind holds: the cache stops admitting when it
    holds data.cache_max_bytes (datasets/cache.py), so a dataset larger than that is partly
    cached, the same records every epoch."""
    if cache == "none" or host.dataset_bytes <= 0:
        return 0.0
    return max(0.0, min(1.0, target.cache_max_bytes / host.dataset_bytes))


def cache_misfit(costs: StageCosts, host: Host, target: Target, cache: str) -> tuple[str, str]:
    """(what it lacks: SHM, MEMORY or CACHE_DIR, why) when a cache of this kind cannot run on
    this host, as it would fail; ("", "") when it can.
    A memory cache of every local rank lives in /dev/shm, whose pages are memory: written
    past /dev/shm's free space, a page is a SIGBUS; past the memory available, the kernel
    kills a process for memory. A disk cache that cannot reserve its file stops the run at
    start (CacheSpaceError); every rank that starts before the file exists builds its own copy
    under a temporary name, each reserved whole, unless a run built it already."""
    need = cache_bytes(costs, host, target, cache)
    ranks = max(1, target.local_ranks)
    if cache == "memory":
        if need * ranks > host.shm_free_bytes:
            return SHM, (
                f"the memory cache takes {_mib(need)} of /dev/shm per rank ({ranks}), "
                f"{_mib(host.shm_free_bytes)} free"
            )
        if need * ranks > host.memory_available_bytes:
            return MEMORY, (
                f"the memory cache takes {_mib(need)} of memory per rank ({ranks}), "
                f"{_mib(host.memory_available_bytes)} available"
            )
    if cache == "disk" and not host.disk_cache_built:
        if host.cache_dir_free_bytes <= 0:
            return CACHE_DIR, "the cache folder is not writable"
        if need * ranks > host.cache_dir_free_bytes:
            return CACHE_DIR, (
                f"the disk cache reserves {_mib(need)} per rank ({ranks}) in data.cache_dir, "
                f"{_mib(host.cache_dir_free_bytes)} free"
            )
    return "", ""


def sample_read(costs: StageCosts, host: Host, target: Target, cache: str) -> Read:
    """A sample's read from epoch 2 on. Without a cache, the page cache keeps a dataset that
    fits in half the memory a memory cache leaves, so reads cost what a re-read did; a larger
    one is read from storage each epoch (first-read costs, and the storage's bytes). A cache
    serves what it holds at a copy of the record, with no wait on the storage (its latency is
    below the cache); ``disk`` maps its file, so when the page cache cannot keep it a hit is a
    read of that disk: at least a re-read's CPU, and its bytes count against the storage's rate
    (the cache folder taken to be on the same disk; that disk's own wait is not measured)."""
    room = host.memory_available_bytes
    if cache == "memory":
        room -= cache_bytes(costs, host, target, cache) * max(1, target.local_ranks)
    fits_page_cache = host.dataset_bytes <= room / 2
    if fits_page_cache:
        uncached = Read(costs.reread_cpu_s, costs.reread_wait_s, 0.0)
    else:
        uncached = Read(costs.read_cpu_s, costs.read_wait_s, 1.0)
    if cache == "none":
        return uncached
    copy = costs.record_bytes / host.copy_bytes_per_s
    hit = Read(copy, 0.0, 0.0)
    if cache == "disk" and not fits_page_cache:
        hit = Read(max(copy, costs.reread_cpu_s), 0.0, 1.0)
    held = cache_fraction(costs, host, target, cache)
    return Read(
        held * hit.cpu_s + (1 - held) * uncached.cpu_s,
        held * hit.wait_s + (1 - held) * uncached.wait_s,
        held * hit.storage_share + (1 - held) * uncached.storage_share,
    )


def handover_seconds(costs: StageCosts, candidate: Candidate) -> tuple[float, float]:
    """(a worker's, the trainer's) seconds per batch besides making it."""
    if candidate.workers == 0:
        return 0.0, costs.trainer_alone_s
    return costs.worker_handover_s[candidate.ring], costs.trainer_handover_s[candidate.ring]


def loading_seconds(
    costs: StageCosts, host: Host, target: Target, candidate: Candidate
) -> tuple[float, float]:
    """(CPU seconds, seconds waiting on storage) of loading one batch, where it is loaded: in a
    worker (its side of the hand-over included), or in the trainer without workers (its own
    work on the batch included)."""
    read = sample_read(costs, host, target, candidate.cache)
    worker_h, main_h = handover_seconds(costs, candidate)
    cpu = target.batch_size * (read.cpu_s + costs.transform_s + costs.collate_s) + worker_h
    if candidate.workers == 0:
        cpu += main_h
    return cpu, target.batch_size * read.wait_s


def reads_wait_most(costs: StageCosts, host: Host, target: Target, candidate: Candidate) -> bool:
    """Whether loading a batch at ``candidate`` waits on storage longer than it computes."""
    cpu, wait = loading_seconds(costs, host, target, candidate)
    return wait > cpu


def predict(costs: StageCosts, host: Host, target: Target, candidate: Candidate) -> Prediction:
    batch = target.batch_size
    read = sample_read(costs, host, target, candidate.cache)
    load_cpu, wait = loading_seconds(costs, host, target, candidate)
    _, main_h = handover_seconds(costs, candidate)
    # Other processes' load takes its share of the cores (a shared node, a noisy neighbour).
    cores = max(1.0, host.cores - host.busy_elsewhere) / max(1, target.local_ranks)
    step = target.step_s
    limits: dict[str, float] = {DEVICE: batch / step if step > 0 else math.inf}
    # A CPU step runs in the trainer process, on the cores the workers use, between batches.
    step_cpu = step if target.step_on_cpu else 0.0
    if candidate.workers == 0:
        limits[TRAINER] = batch / (load_cpu + wait + step_cpu)  # loads, then steps: serially
    else:
        limits[WORKERS] = batch * candidate.workers / (load_cpu + wait)  # one batch each
        limits[CORES] = batch * cores / (load_cpu + main_h + step_cpu)  # CPU seconds only
        if main_h > 0:
            limits[TRAINER] = batch / (main_h + step_cpu)
    storage_bytes = costs.record_bytes * read.storage_share
    if storage_bytes > 0 and math.isfinite(costs.storage_bytes_per_s):
        limits[STORAGE] = costs.storage_bytes_per_s / storage_bytes
    bound = min(limits, key=limits.get)
    loader = min(rate for name, rate in limits.items() if name != DEVICE)
    # Spread costs most when loader and device run at the same pace (closeness 1), nothing
    # when one is much faster (its queue stays full, or empty, whatever a batch takes).
    closeness = min(loader, limits[DEVICE]) / max(loader, limits[DEVICE])
    in_flight = candidate.workers * candidate.prefetch if candidate.workers else 1
    rate = limits[bound] / (1 + closeness * costs.batch_cv**2 / (2 * in_flight))
    bottleneck = _bottleneck(bound, candidate, load_cpu, wait, main_h, step_cpu)
    shm = int(target.shm_need(candidate)) if target.shm_need else 0
    lacks, why_not = cache_misfit(costs, host, target, candidate.cache)
    if shm > host.shm_free_bytes:
        lacks, why_not = SHM, f"needs {_mib(shm)} of /dev/shm"
    return Prediction(candidate, rate, bottleneck, limits, shm, not lacks, why_not, lacks)


def _bottleneck(
    bound: str, candidate: Candidate, load_cpu: float, wait: float, main_h: float, step_cpu: float
) -> str:
    """The bottleneck's name for the binding resource. The workers are held by storage when
    their reads wait longer than they compute, by the CPU otherwise; a CPU step that costs the
    binding resource more than the loading does is the device's limit; without workers, the
    trainer's serial work is named by its largest part (the step, the reads' wait, the CPU)."""
    if bound == DEVICE:
        return GPU
    if bound == STORAGE:
        return DISK
    if bound == WORKERS:
        return DISK if wait > load_cpu else CPU
    if bound == CORES:
        return GPU if step_cpu >= load_cpu + main_h else CPU
    if candidate.workers:  # the trainer's hand-over
        return GPU if step_cpu >= main_h else HANDOVER
    parts = {GPU: step_cpu, DISK: wait, CPU: load_cpu}  # on a tie, the earlier name
    return max(parts, key=parts.get)


def worker_top(costs: StageCosts | None, host: Host, target: Target) -> int:
    """The most workers per rank the grid tries: twice the cores (at most MAX_WORKERS), and
    when a sample's read waits longer than it computes, cores x (1 + wait / CPU), at most
    MAX_WORKERS_FOR_WAITS. ``costs`` None: the first rule alone."""
    cores = host.cores / max(1, target.local_ranks)
    top = min(MAX_WORKERS, max(1, int(2 * cores)))
    if costs is None:
        return top
    # The no-cache setting: its reads wait the most, and a cache is not always there to help.
    uncached = Candidate(1, PREFETCH_CHOICES[0], "none", True)
    cpu, wait = loading_seconds(costs, host, target, uncached)
    if wait > cpu > 0:
        covering = math.ceil(max(1.0, cores) * (1 + wait / cpu))
        top = max(top, min(MAX_WORKERS_FOR_WAITS, covering))
    return top


def candidates(
    host: Host, target: Target, caches=CACHE_CHOICES, costs: StageCosts | None = None
) -> list[Candidate]:
    """The grid a sweep measures: workers from 0 to :func:`worker_top` x prefetch x cache x
    ring; without workers only the cache varies."""
    top = worker_top(costs, host, target)
    grid = [Candidate(0, 1, cache, False) for cache in caches]
    for workers in range(1, top + 1):
        for prefetch in PREFETCH_CHOICES:
            for cache in caches:
                grid.extend(Candidate(workers, prefetch, cache, ring) for ring in (True, False))
    return grid


@dataclass(frozen=True)
class Plan:
    pick: Prediction  # the cheapest feasible setting within `within` of the best prediction
    best: Prediction  # the feasible setting predicted fastest
    to_verify: list[Candidate]  # the pick and its neighbours, for the measured runs
    predictions: list[Prediction]
    bottleneck: str  # of the pick; SHM when a faster setting did not fit /dev/shm

    def sentence(self) -> str:
        return BOTTLENECK_TEXT[self.bottleneck]


def cheapest_within(items, rate_of, within: float):
    """The cheapest item (Candidate.cost order) whose rate is within ``within`` of the best."""
    best = max(rate_of(item) for item in items)
    good = [item for item in items if rate_of(item) >= (1 - within) * best]
    return min(good, key=lambda item: _candidate_of(item).cost())


def _candidate_of(item) -> Candidate:
    return item if isinstance(item, Candidate) else item.candidate


def plan(
    costs: StageCosts, host: Host, target: Target, within: float = 0.03, caches=CACHE_CHOICES
) -> Plan:
    grid = candidates(host, target, caches, costs)
    predictions = [predict(costs, host, target, c) for c in grid]
    feasible = [p for p in predictions if p.feasible]
    if not feasible:
        raise ValueError("no loader setting fits this host (not even 0 workers)")
    best = max(feasible, key=lambda p: p.samples_per_s)
    pick = cheapest_within(feasible, lambda p: p.samples_per_s, within)
    bottleneck = pick.bottleneck
    faster_unfit = [
        p for p in predictions if p.lacks == SHM and p.samples_per_s > best.samples_per_s * 1.05
    ]
    if faster_unfit and bottleneck != GPU:
        bottleneck = SHM
    to_verify = neighbours(pick.candidate, feasible)
    if best.candidate not in to_verify:
        to_verify.append(best.candidate)
    return Plan(pick, best, to_verify, predictions, bottleneck)


# The dimensions of the local search, in the order it walks them: the worker count moves the
# throughput most, the ring and the prefetch depth less, the cache only where reads are slow.
DIMENSIONS = ("workers", "ring", "prefetch", "cache")


def steps(current: Candidate, dimension: str, feasible: list[Prediction]) -> list[Candidate]:
    """The feasible settings one step from ``current`` along ``dimension``: a worker more and
    less; the ring flipped; the next prefetch up and down; each other cache."""
    if dimension == "workers":
        up = replace(current, workers=current.workers + 1)
        if current.workers == 0:  # the first worker: the frameworks' default prefetch, the ring
            up = replace(up, prefetch=2, ring=True)
        moved = [up, replace(current, workers=current.workers - 1)]
    elif dimension == "ring":
        moved = [replace(current, ring=not current.ring)] if current.workers else []
    elif dimension == "prefetch":
        index = PREFETCH_CHOICES.index(current.prefetch) if current.workers else None
        moved = [
            replace(current, prefetch=PREFETCH_CHOICES[other])
            for other in ((index - 1, index + 1) if index is not None else ())
            if 0 <= other < len(PREFETCH_CHOICES)
        ]
    else:
        moved = [replace(current, cache=cache) for cache in CACHE_CHOICES if cache != current.cache]
    allowed = {p.candidate for p in feasible}
    return [m for m in map(normal, moved) if m in allowed]


def replace(candidate: Candidate, **changes) -> Candidate:
    return dataclasses.replace(candidate, **changes)


def normal(candidate: Candidate) -> Candidate:
    """Without workers, prefetch and ring do not apply: the grid holds them as 1 and off."""
    if candidate.workers == 0:
        return replace(candidate, prefetch=1, ring=False)
    return candidate


def neighbours(pick: Candidate, feasible: list[Prediction]) -> list[Candidate]:
    """The pick, then the feasible settings one step from it along each dimension."""
    ordered = [pick]
    for dimension in DIMENSIONS:
        ordered += [c for c in steps(pick, dimension, feasible) if c not in ordered]
    return ordered
