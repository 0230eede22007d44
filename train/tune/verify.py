"""Measured runs of the real loader at a candidate setting: the backend's own loader over the
real data, its batches moved to the device as training moves them (``device_batches``), and a
step that takes as long as the device's.

The step is the model's real one when it was measured here (on a GPU, or on the CPU, where it
takes the cores the workers need, as in training). With ``--step-ms`` the device is elsewhere:
a stand-in device runs each step for ``step_s`` and, as CUDA does, accepts the next step while
it still runs one (queue depth 2), so the trainer loads the next batch meanwhile; the trainer
takes the loader's host batches, and their copy to the GPU and normalization (which run on the
GPU) are not measured.

A run measures the steady state from epoch 2 on: with a record cache the records of the measured
window are read into it first (untimed), and the window starts after the workers' first round of
batches, so neither worker start-up nor an empty cache is counted. The window is counted in
batches (:func:`window_batches`), enough for several full rounds of every worker: a window of a
few batches catches the workers' batches arriving together and reads several workers faster
than they are.

With several ranks on the node (``--local-ranks N``), each run is one rank's among N: the other
N - 1 ranks' loaders run beside it at the same setting, each in a companion process
(train/tune/companions.py), from before the window starts until it ends, and the rate measured
is this rank's. Each rank reads its own shard of the epoch and sets its CPU threads as training
sets a rank's (:func:`set_rank_threads`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

from datasets.sampler import EpochSampler
from train.data import open_split
from train.tune.model import Candidate


class DeviceStandIn:
    """A device whose every step takes ``step_s``, queued as CUDA queues work."""

    def __init__(self, step_s: float, depth: int = 2) -> None:
        self.step_s, self.depth = step_s, depth
        self.finishes: collections.deque[float] = collections.deque()

    def step(self, batch) -> None:
        now = time.perf_counter()
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        if len(self.finishes) >= self.depth:  # the queue is full: wait for its oldest step
            time.sleep(max(0.0, self.finishes.popleft() - now))
        start = max(time.perf_counter(), self.finishes[-1] if self.finishes else 0.0)
        self.finishes.append(start + self.step_s)

    def synchronize(self) -> None:
        if self.finishes:
            time.sleep(max(0.0, self.finishes[-1] - time.perf_counter()))
            self.finishes.clear()


class RealStep:
    """The backend's own train step, on the device it was measured on."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def step(self, batch) -> None:
        self.backend.trainer.train_step(batch)

    def synchronize(self) -> None:
        self.backend.trainer.read_steps()


def with_candidate(config, candidate: Candidate):
    """``config`` with the candidate's loader and cache settings."""
    loader = dataclasses.replace(
        config.loader,
        num_workers=candidate.workers,
        prefetch_factor=candidate.prefetch if candidate.workers else None,
        batch_ring=candidate.ring if candidate.workers else config.loader.batch_ring,
    )
    data = dataclasses.replace(config.data, cache=candidate.cache)
    return dataclasses.replace(config, loader=loader, data=data)


def run_config(config, candidate: Candidate):
    """``config`` as a measured run at ``candidate`` runs it, on every rank: the candidate's
    settings, and one epoch per run with workers that stop with it. Persistent ones would
    outlive the run (they belong to the loader) and take cores from the next."""
    config = with_candidate(config, candidate)
    return dataclasses.replace(
        config, loader=dataclasses.replace(config.loader, persistent_workers=False)
    )


def set_rank_threads(backend, workers: int, local_ranks: int) -> None:
    """The trainer's CPU threads as training sets them on one of ``local_ranks`` ranks of the
    node with ``workers`` loader workers (train.data.RunData.train_loader): the rank's share of the
    cores less one per worker, on a CPU device. The tuner's processes each run as a rank of
    one, so the node's rank count is theirs for this call only."""
    runtime = backend.runtime
    alone = runtime.dist
    runtime.dist = dataclasses.replace(alone, local_world_size=local_ranks)
    try:
        backend.batches.set_cpu_threads(workers)
    finally:
        runtime.dist = alone


def fill_cache(dataset, candidate: Candidate, sampler: EpochSampler) -> None:
    """With a record cache, read the records ``sampler`` gives this rank into it, untimed: a
    measured run is the steady state of epoch 2 on, after epoch 1 filled the cache."""
    if candidate.cache == "none":
        return
    # Positions past the dataset's end wrap around (RecordDataset reads position % len).
    for position in sorted({int(p) % len(dataset) for p in sampler.positions()}):
        dataset._read(dataset._source_index(position))


def close_batches(batches) -> None:
    """End an epoch's batches left mid-epoch: its workers are stopped here, the way a stop
    request stops them (with the framework's warnings)."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()


class LoaderFailed(Exception):
    """A loader run failed as a training run's can (a worker killed or hung, too many bad
    samples, a data error in a worker), and the report naming the sample and the worker is
    printed: the tuner exits with ``code``, training's exit code for it."""

    def __init__(self, code: int) -> None:
        super().__init__(f"a loader run failed (exit {code}); the report is above")
        self.code = code


@contextlib.contextmanager
def failures_named(config, dataset):
    """Around a run of the loader over ``dataset``: its failure is reported as training
    reports it (train.cli.loader_failure: which sample, which worker, the hint) and
    raised as LoaderFailed; a bug in the sample's code stays an exception with its
    traceback. A worker the kernel killed for memory at one setting is as fatal here as in
    training: the report says so and names the limit to check."""
    try:
        yield
    except Exception as exc:
        from train.cli import loader_failure

        data = SimpleNamespace(train=dataset, val=None)
        code = loader_failure(exc, data, config.loader.timeout_s or None)
        if code is None:
            raise
        raise LoaderFailed(code) from exc


def open_train_dataset(config, cache: str):
    """The training data as training opens it (train.data.open_split), with ``cache``."""
    return open_split(config, "train", cache=cache)


@dataclass
class Measured:
    candidate: Candidate
    samples_per_s: float
    batches: int
    seconds: float  # the whole run: start-up, cache fill, warm-up and window
    # With several ranks on the node: each other rank's samples/s within this rank's window.
    other_ranks_samples_per_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        row = {
            "setting": self.candidate.label(),
            "samples_per_s": round(self.samples_per_s, 1),
            "batches": self.batches,
            "run_s": round(self.seconds, 2),
        }
        if self.other_ranks_samples_per_s:
            row["other_ranks_samples_per_s"] = [
                round(rate, 1) for rate in self.other_ranks_samples_per_s
            ]
        return row


@contextlib.contextmanager
def more_workers_than_cores():
    """Without torch's warning that a loader has more workers than cores (made and started):
    whether more help is what the tuner measures."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        yield


def batches_of(backend, loader, on_device: bool):
    """The loader's batches as the trainer takes them: moved to the device and normalized
    there when the step runs here; as the loader hands them over (host tensors) when the device
    is elsewhere, whose copy and normalization run on it, asynchronously, not on this host."""
    return iter(backend.batches.device_batches(loader) if on_device else loader)


# A measured window covers this many full rounds of every worker (each worker makes one batch per
# round), and never fewer than MIN_WINDOW_BATCHES batches: the rate of a shorter window depends on
# where in a round it starts and ends.
ROUNDS_PER_WINDOW = 3
MIN_WINDOW_BATCHES = 8


def window_batches(workers: int, window_s: float, expected: float, batch_size: int) -> int:
    """The batches of a measured window: ``window_s`` at the ``expected`` samples/s, and at least
    ROUNDS_PER_WINDOW rounds of ``workers`` workers and MIN_WINDOW_BATCHES."""
    by_time = math.ceil(window_s * expected / batch_size) if expected > 0 else 0
    return max(MIN_WINDOW_BATCHES, ROUNDS_PER_WINDOW * workers, by_time)


def measure(
    config,
    backend,
    candidate: Candidate,
    device,
    window_s: float,
    expected: float,
    on_device: bool = True,
    other_ranks=None,
):
    """Samples per second of the real loader at ``candidate``, over a window of
    :func:`window_batches` batches (about ``window_s`` seconds at ``expected``, the predicted
    samples/s, and at least three rounds of every worker) after the workers' first round of
    batches. The loader then ends its epoch as in training (one left mid-epoch is stopped the
    way a stop request stops it, with the framework's warnings). A setting far slower than
    predicted ends its window after 4 x window_s, once its rounds are covered.

    ``other_ranks``: the node's other ranks (companions.Companions), whose loaders run beside
    this one at ``candidate``: they are ready (their workers up) before this rank's loader
    starts, and run until its window ends; this run is then rank 0's share of the epoch, and a
    companion's failure is this run's."""
    started = time.perf_counter()
    local_ranks = 1 if other_ranks is None else other_ranks.local_ranks
    config = run_config(config, candidate)
    batch = config.loader.batch_size
    warm = candidate.workers + 1  # the workers' first round arrives together
    window = window_batches(candidate.workers, window_s, expected, batch)
    rounds = window_batches(candidate.workers, 0.0, 0.0, batch)  # the window's least
    # Rank 0's share of an epoch of (warm + window) batches per rank.
    sampler = EpochSampler(
        local_ranks * (warm + window) * batch,
        shuffle=True,
        seed=config.seed,
        rank=0,
        world_size=local_ranks,
    )
    dataset = open_train_dataset(config, candidate.cache)
    try:
        fill_cache(dataset, candidate, sampler)
        set_rank_threads(backend, candidate.workers, local_ranks)
        with contextlib.ExitStack() as beside:
            if other_ranks is not None:  # started, and their workers up, before this rank's
                node = beside.enter_context(other_ranks.running(candidate, warm + window))
            with failures_named(config, dataset):
                with more_workers_than_cores():
                    loader = backend.batches.make_loader(
                        dataset, sampler, config.loader, train=True
                    )
                    batches = batches_of(backend, loader, on_device)
                    first = next(batches)
                try:
                    device.step(first)
                    for _ in range(warm - 1):
                        device.step(next(batches))
                    device.synchronize()
                    start, window_began = time.perf_counter(), time.monotonic()
                    done = 0
                    for item in batches:
                        device.step(item)
                        done += 1
                        if done >= rounds and time.perf_counter() - start >= 4 * window_s:
                            break
                    device.synchronize()
                    took, window_ended = time.perf_counter() - start, time.monotonic()
                finally:
                    close_batches(batches)
                    del batches, loader
            others = [] if other_ranks is None else node.stop(window_began, window_ended)
    finally:
        dataset.close()
    seconds = time.perf_counter() - started
    return Measured(candidate, done * batch / took, done, seconds, others)
