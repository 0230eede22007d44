"""The tuner's model of an input pipeline: from measured stage costs and host facts to the
predicted throughput of every loader setting, and the bottleneck that holds each.

Operational analysis, as Plumber (Kuchnik et al., MLSys 2022) does for tf.data: each resource
a batch passes through has a service demand per batch (CPU seconds in a worker, CPU seconds in
the trainer process, seconds of the device), and the pipeline cannot run faster than its most
loaded resource:

    rate <= workers / worker_s            the workers, each one batch at a time
    rate <= cores / (worker_s + main_s)   every CPU second, the trainer's included, shares cores
    rate <= 1 / main_s                    the trainer's own hand-over of each batch
    rate <= 1 / step_s                    the device (the GPU's step, or --step-ms)

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

from datasets.cache import DEFAULT_CACHE_MAX_BYTES

# Bottlenecks, by name, and the sentence the tuner's report and tuned.yaml give each.
GPU, CPU, DISK, SHM, HANDOVER = "gpu", "cpu", "disk", "shm", "handover"
BOTTLENECK_TEXT = {
    GPU: "none in the input pipeline: the device's step is the limit",
    CPU: "CPU: the workers' decode and augmentation use every core this process may use",
    DISK: "storage: reading records takes more of a sample's time than decoding it",
    SHM: "/dev/shm: a faster setting needs more shared memory than is free",
    HANDOVER: "hand-over: the trainer process's work on each batch it receives (taking it from "
    "the workers, moving it to the device, normalizing it) takes longer than the workers need",
}

PREFETCH_CHOICES = (1, 2, 4)
CACHE_CHOICES = ("none", "memory", "disk")
MAX_WORKERS = 8  # past 8, workers rarely help one device (train/cpus.py's rule of thumb)


@dataclass(frozen=True)
class StageCosts:
    """What one sample costs, measured on the real data (seconds; bytes)."""

    read_s: float  # the first read of a record from storage
    reread_s: float  # the same record read again (the page cache's speed)
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

    @property
    def transform_s(self) -> float:
        return self.decode_s + self.augment_s


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
    limits: dict  # {resource: samples/s it allows}
    shm_bytes: int
    feasible: bool
    why_not: str = ""  # for an infeasible candidate: what it lacks


def cache_fraction(costs: StageCosts, host: Host, target: Target, cache: str) -> float:
    """The share of the dataset a cache of this kind holds: the cache stops admitting when full
    (datasets/cache.py), so a dataset larger than the bound is partly cached."""
    if cache == "none" or host.dataset_bytes <= 0:
        return 0.0
    room = target.cache_max_bytes
    if cache == "disk":
        room = min(room, host.cache_dir_free_bytes)
    return max(0.0, min(1.0, room / host.dataset_bytes))


def read_seconds(costs: StageCosts, host: Host, target: Target, cache: str) -> float:
    """A sample's read from epoch 2 on. Without a cache, the page cache keeps a dataset that
    fits in half the available memory, so reads cost what a re-read did; a larger one is read
    from storage each epoch. A cache serves what it holds at a copy of the record."""
    fits_page_cache = host.dataset_bytes <= host.memory_available_bytes / 2
    uncached = costs.reread_s if fits_page_cache else costs.read_s
    if cache == "none":
        return uncached
    hit = costs.record_bytes / host.copy_bytes_per_s
    if cache == "disk" and not fits_page_cache:
        hit = max(hit, costs.reread_s)  # the cache file is memory-mapped: a hit may be a read
    held = cache_fraction(costs, host, target, cache)
    return held * hit + (1 - held) * uncached


def handover_seconds(costs: StageCosts, candidate: Candidate) -> tuple[float, float]:
    """(a worker's, the trainer's) seconds per batch besides making it."""
    if candidate.workers == 0:
        return 0.0, costs.trainer_alone_s
    return costs.worker_handover_s[candidate.ring], costs.trainer_handover_s[candidate.ring]


def predict(costs: StageCosts, host: Host, target: Target, candidate: Candidate) -> Prediction:
    batch = target.batch_size
    read = read_seconds(costs, host, target, candidate.cache)
    per_sample = read + costs.transform_s + costs.collate_s
    worker_h, main_h = handover_seconds(costs, candidate)
    worker_s = batch * per_sample + worker_h
    # Other processes' load takes its share of the cores (a shared node, a noisy neighbour).
    cores = max(1.0, host.cores - host.busy_elsewhere) / max(1, target.local_ranks)
    step = target.step_s
    limits: dict[str, float] = {GPU: batch / step if step > 0 else math.inf}
    # A CPU step runs in the trainer process, on the cores the workers use, between batches.
    step_cpu = step if target.step_on_cpu else 0.0
    if candidate.workers == 0:
        limits[CPU] = batch / (worker_s + main_h + step_cpu)
    else:
        limits[CPU] = min(
            batch * candidate.workers / worker_s,  # each worker makes one batch at a time
            batch * cores / (worker_s + main_h + step_cpu),  # every CPU second shares the cores
        )
        if main_h > 0:
            limits[HANDOVER] = batch / (main_h + step_cpu)
    bound = min(limits, key=limits.get)
    loader = min(rate for name, rate in limits.items() if name != GPU)
    # Spread costs most when loader and device run at the same pace (closeness 1), nothing
    # when one is much faster (its queue stays full, or empty, whatever a batch takes).
    closeness = min(loader, limits[GPU]) / max(loader, limits[GPU])
    in_flight = candidate.workers * candidate.prefetch if candidate.workers else 1
    rate = limits[bound] / (1 + closeness * costs.batch_cv**2 / (2 * in_flight))
    # A CPU step that costs the binding resource more than the loading does is the limit.
    if bound == HANDOVER and step_cpu >= main_h or bound == CPU and step_cpu >= worker_s + main_h:
        bound = GPU
    if bound == CPU and read > costs.transform_s + costs.collate_s:
        bound = DISK
    shm = int(target.shm_need(candidate)) if target.shm_need else 0
    feasible, why_not = True, ""
    if shm > host.shm_free_bytes:
        feasible, why_not = False, f"needs {shm / 2**20:.0f} MiB of /dev/shm"
    elif candidate.cache == "disk" and host.cache_dir_free_bytes <= 0:
        feasible, why_not = False, "the cache folder is not writable"
    return Prediction(candidate, rate, bound, limits, shm, feasible, why_not)


def candidates(host: Host, target: Target, caches=CACHE_CHOICES) -> list[Candidate]:
    """The grid a sweep measures: workers from 0 to twice the cores (at most MAX_WORKERS) x
    prefetch x cache x ring; without workers only the cache varies."""
    top = min(MAX_WORKERS, max(1, 2 * host.cores // max(1, target.local_ranks)))
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
    bottleneck: str  # of the pick; SHM when a faster setting did not fit

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
    predictions = [predict(costs, host, target, c) for c in candidates(host, target, caches)]
    feasible = [p for p in predictions if p.feasible]
    if not feasible:
        raise ValueError("no loader setting fits this host (not even 0 workers)")
    best = max(feasible, key=lambda p: p.samples_per_s)
    pick = cheapest_within(feasible, lambda p: p.samples_per_s, within)
    bottleneck = pick.bottleneck
    faster_unfit = [
        p for p in predictions if not p.feasible and p.samples_per_s > best.samples_per_s * 1.05
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
