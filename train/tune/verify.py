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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
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

    def as_dict(self) -> dict:
        return {
            "setting": self.candidate.label(),
            "samples_per_s": round(self.samples_per_s, 1),
            "batches": self.batches,
            "run_s": round(self.seconds, 2),
        }


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
):
    """Samples per second of the real loader at ``candidate``, over a window of
    :func:`window_batches` batches (about ``window_s`` seconds at ``expected``, the predicted
    samples/s, and at least three rounds of every worker) after the workers' first round of
    batches. The loader then ends its epoch as in training (one left mid-epoch is stopped the
    way a stop request stops it, with the framework's warnings). A setting far slower than
    predicted ends its window after 4 x window_s, once its rounds are covered."""
    started = time.perf_counter()
    config = with_candidate(config, candidate)
    # One epoch per run: workers that stop with it. Persistent ones would outlive the run
    # (they belong to the loader) and take cores from the next.
    config = dataclasses.replace(
        config, loader=dataclasses.replace(config.loader, persistent_workers=False)
    )
    batch = config.loader.batch_size
    warm = candidate.workers + 1  # the workers' first round arrives together
    window = window_batches(candidate.workers, window_s, expected, batch)
    rounds = window_batches(candidate.workers, 0.0, 0.0, batch)  # the window's least
    dataset = open_train_dataset(config, candidate.cache)
    try:
        if candidate.cache != "none":  # epoch 1 filled the cache: read the window's records
            for position in range(min(len(dataset), (warm + window) * batch)):
                dataset._read(dataset._source_index(position))
        # Positions past the dataset's end wrap around (RecordDataset reads position % len).
        sampler = EpochSampler((warm + window) * batch, shuffle=True, seed=config.seed)
        with failures_named(config, dataset):
            with more_workers_than_cores():
                loader = backend.batches.make_loader(dataset, sampler, config.loader, train=True)
                batches = batches_of(backend, loader, on_device)
                first = next(batches)
            try:
                device.step(first)
                for _ in range(warm - 1):
                    device.step(next(batches))
                device.synchronize()
                start = time.perf_counter()
                done = 0
                for item in batches:
                    device.step(item)
                    done += 1
                    if done >= rounds and time.perf_counter() - start >= 4 * window_s:
                        break
                device.synchronize()
                took = time.perf_counter() - start
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()  # a loader left mid-epoch: its workers are stopped here
                del batches, loader
    finally:
        dataset.close()
    return Measured(candidate, done * batch / took, done, time.perf_counter() - started)
