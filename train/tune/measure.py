"""The tuner's measurements: what each stage of the input pipeline costs on a sample of the real
data, what this host (this container) gives the loader, and the step the loader must keep up
with. Framework-free except :func:`step_seconds`, which builds the model with the backend.

Each stage is timed where a worker runs it, with the dataset's own calls:
- read: ``source.read`` of a record, the first time (storage) and again (the page cache), in
  wall time (a read may wait on storage);
- decode: the image decode alone (``datasets.decode.decode_bgr``, the full image, under the
  transform's pixel budget, checked from the header as training does), CPU time;
- augment: the rest of the transform (augmentation, crop and resize, label encoding), CPU time;
- batched: what a sample costs inside ``get_batch``, the call a worker makes per batch (the
  transform writes into the batch's rows, so it may cost less than the transform alone), CPU
  time; the model uses this figure, read excluded;
- hand-over: the CPU seconds per batch of the backend's real loader, in the trainer process and
  in the workers, without workers and with one (ring on and off): what a batch costs beyond
  making it, on each side.
CPU time (not wall time) is what a stage demands of a core: on a busy host the wall time of
the same work grows with what else runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets import decode
from datasets.dataset import SampleRng
from datasets.errors import BadSampleError, DatasetError
from train.cpus import usable_cores
from train.stall import host_cpu, process_tree_cpu
from train.tune.model import Host, StageCosts
from train.tune.verify import batches_of, failures_named, more_workers_than_cores

SHM_PATH = "/dev/shm"


def path_bytes(path: str | Path) -> int:
    """Bytes of a dataset on storage: a file, or every file under a folder (an LMDB's)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def memory_available() -> int:
    """Bytes this process could still fill with page cache: the host's available memory, capped
    by the container's cgroup limit less what the cgroup already uses."""
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        available = 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def writable_free_bytes(folder: str) -> int:
    """Free bytes where ``folder`` is or would be created; 0 when it cannot be written."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not os.access(path, os.W_OK):
        return 0
    return shutil.disk_usage(path).free


def copy_rate(nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of a copy of ``nbytes`` into pages already mapped: what a cache hit costs per
    byte of its record."""
    nbytes = max(nbytes, 1 << 16)
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the target's pages in once
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        took.append(time.perf_counter() - start)
    return nbytes / min(took)


class OtherLoad:
    """Cores that processes outside this one's tree keep busy, between ``start`` and ``stop``:
    the host's busy CPU seconds less this process tree's, over the wall time."""

    def start(self) -> OtherLoad:
        self.began, self.host = time.perf_counter(), host_cpu()[0]
        self.ours = sum(process_tree_cpu())
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self.began
        others = (host_cpu()[0] - self.host) - (sum(process_tree_cpu()) - self.ours)
        return max(0.0, others / wall) if wall > 0 else 0.0


def host_facts(data, copy_nbytes: int, busy_elsewhere: float = 0.0) -> Host:
    try:
        shm_free = shutil.disk_usage(SHM_PATH).free
    except OSError:
        shm_free = 0
    return Host(
        cores=usable_cores(),
        busy_elsewhere=busy_elsewhere,
        shm_free_bytes=shm_free,
        memory_available_bytes=memory_available(),
        dataset_bytes=path_bytes(data.train),
        cache_dir_free_bytes=writable_free_bytes(data.cache_dir),
        copy_bytes_per_s=copy_rate(copy_nbytes),
    )


@dataclass
class StageSample:
    """Per-sample timings of the sampled records, for the report's spread."""

    read_s: list[float]
    reread_s: list[float]
    decode_s: list[float]
    transform_s: list[float]
    batch_s: list[float]  # whole get_batch calls
    batch_size: int
    sample_bytes: int  # one collated sample
    record_bytes: float  # mean stored record


def _timed(call, *args):
    """(result, wall seconds)."""
    start = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - start


def _cpu_timed(call, *args):
    """(result, CPU seconds of this thread)."""
    start = time.thread_time()
    result = call(*args)
    return result, time.thread_time() - start


def time_stages(dataset, batch_size: int, seed: int, seconds: float) -> StageSample:
    """Time each stage on records drawn at random from ``dataset`` (a RecordDataset with no
    cache) for about ``seconds``: per-sample stages first (16 to 512 records), then whole
    batches as a worker makes them (2 to 32). A bad sample (a record training would skip: an
    image over the pixel budget is refused from its header, never decoded) is skipped here too."""
    order = np.random.default_rng(seed).permutation(len(dataset))
    max_pixels = getattr(dataset.transform, "max_pixels", decode.MAX_IMAGE_PIXELS)
    sample = StageSample([], [], [], [], [], batch_size, 0, 0.0)
    record_bytes = []
    deadline = time.perf_counter() + seconds / 2
    for count, position in enumerate(order[:512]):
        if count >= 16 and time.perf_counter() > deadline:
            break
        index = dataset._source_index(int(position))
        (data, label), read = _timed(dataset.source.read, index)
        _, reread = _timed(dataset.source.read, index)
        try:
            _, decoded = _cpu_timed(decode.decode_bgr, data, max_pixels)
            rng = SampleRng((seed, 0, index))
            transformed, transform = _cpu_timed(dataset.transform, data, label, rng)
        except BadSampleError:
            continue
        sample.read_s.append(read)
        sample.reread_s.append(reread)
        sample.decode_s.append(decoded)
        sample.transform_s.append(transform)
        record_bytes.append(len(data))
    if not sample.decode_s:
        raise DatasetError(
            "every record drawn to time the input pipeline is a bad sample",
            "check the dataset with scripts/validate_data.py",
        )
    sample.sample_bytes = int(sum(np.asarray(v).nbytes for v in transformed.values()))
    sample.record_bytes = statistics.fmean(record_bytes)
    deadline = time.perf_counter() + seconds / 2
    start = 0
    while len(sample.batch_s) < 2 or (time.perf_counter() < deadline and len(sample.batch_s) < 32):
        items = [(0, int(p)) for p in np.resize(order, start + batch_size)[start:]]
        _, took = _cpu_timed(dataset.get_batch, items)
        sample.batch_s.append(took)
        start = (start + batch_size) % len(dataset)
    return sample


@dataclass(frozen=True)
class LoaderCpu:
    """CPU seconds per batch of a real loader run: the trainer process's (all its threads) and
    its workers' (0 without workers)."""

    trainer_s: float
    workers_s: float
    batches: int


def loader_cpu(
    config, backend, dataset, workers: int, ring: bool, on_device: bool, batches: int
) -> LoaderCpu:
    """The backend's loader at ``workers`` (default prefetch, ``ring``), one epoch of ``batches``
    taken as the measured runs take them (train/tune/verify.py, batches_of) after the workers'
    first round: CPU seconds per batch on each side."""
    from datasets.sampler import EpochSampler
    from train.config.schema import DEFAULT_PREFETCH_FACTOR

    loader_cfg = dataclasses.replace(
        config.loader,
        num_workers=workers,
        prefetch_factor=DEFAULT_PREFETCH_FACTOR,
        batch_ring=ring,
        persistent_workers=False,
    )
    batch_size = config.loader.batch_size
    warm, measured = workers + 1, max(batches, 2 * workers)
    sampler = EpochSampler((warm + measured) * batch_size, shuffle=True, seed=config.seed)
    with failures_named(config, dataset):
        with more_workers_than_cores():
            loader = backend.batches.make_loader(dataset, sampler, loader_cfg, train=True)
            iterator = batches_of(backend, loader, on_device)
            next(iterator)
        for _ in range(warm - 1):  # the first batches allocate what the later ones reuse
            next(iterator)
        trainer, children = process_tree_cpu()
        count = sum(1 for _ in iterator)
        trainer_end, children_end = process_tree_cpu()
    workers_s = (children_end - children) / count if workers else 0.0
    return LoaderCpu((trainer_end - trainer) / count, workers_s, count)


def handover(config, backend, dataset, on_device: bool, batch_s: float) -> dict:
    """What a batch costs beyond making it, measured on the real loader: without workers
    (the trainer's own work on a batch it made) and with one worker, ring on and off (the
    worker's side and the trainer's). {"alone": LoaderCpu, True: LoaderCpu, False: LoaderCpu}.
    ``batch_s``: a batch's CPU time in a worker, which sizes each run to about half a second
    (the kernel counts CPU time in 10 ms ticks: 2% at most)."""
    batches = min(200, max(4, math.ceil(0.5 / max(batch_s, 1e-3))))
    runs = {"alone": loader_cpu(config, backend, dataset, 0, False, on_device, batches)}
    for ring in (True, False):
        runs[ring] = loader_cpu(config, backend, dataset, 1, ring, on_device, batches)
    return runs


def _cv(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean > 0 else 0.0


def summarize(sample: StageSample, runs: dict) -> StageCosts:
    """Medians per stage (one slow outlier must not move the mean the model sees; its spread
    is the cv). A batch's cv is the larger of the batches' measured spread and the samples'
    spread averaged over a batch (independent samples: cv / sqrt(batch)). The hand-over's
    costs are the loader runs' (``handover``) beyond making the batch."""
    median = statistics.median
    reread = median(sample.reread_s)
    decoded = median(sample.decode_s)
    transform = median(sample.transform_s)
    batch = median(sample.batch_s)
    batched = max(0.0, batch / sample.batch_size - reread)
    per_sample = [r + t for r, t in zip(sample.reread_s, sample.transform_s, strict=True)]
    cv = max(_cv(sample.batch_s), _cv(per_sample) / sample.batch_size**0.5)
    return StageCosts(
        read_s=median(sample.read_s),
        reread_s=reread,
        decode_s=min(decoded, transform),
        augment_s=max(0.0, transform - decoded),
        collate_s=batched - transform,
        trainer_alone_s=max(0.0, runs["alone"].trainer_s - batch),
        worker_handover_s={ring: max(0.0, runs[ring].workers_s - batch) for ring in (True, False)},
        trainer_handover_s={ring: runs[ring].trainer_s for ring in (True, False)},
        sample_bytes=sample.sample_bytes,
        record_bytes=sample.record_bytes,
        batch_cv=cv,
    )


def describe(sample: StageSample, costs: StageCosts) -> dict:
    def ms(values):
        return {
            "median_ms": round(statistics.median(values) * 1e3, 4),
            "p90_ms": round(float(np.percentile(values, 90)) * 1e3, 4),
        }

    return {
        "samples_timed": len(sample.read_s),
        "batches_timed": len(sample.batch_s),
        "read": ms(sample.read_s),
        "reread": ms(sample.reread_s),
        "decode": ms(sample.decode_s),
        "transform": ms(sample.transform_s),
        "batch": ms(sample.batch_s),
        "batched_per_sample_ms": round((costs.transform_s + costs.collate_s) * 1e3, 4),
        "trainer_alone_per_batch_ms": round(costs.trainer_alone_s * 1e3, 3),
        "handover_per_batch_ms": {
            ("ring" if ring else "framework"): {
                "worker": round(costs.worker_handover_s[ring] * 1e3, 3),
                "trainer": round(costs.trainer_handover_s[ring] * 1e3, 3),
            }
            for ring in (True, False)
        },
        "batch_cv": round(costs.batch_cv, 4),
        "sample_bytes": costs.sample_bytes,
        "record_bytes": round(costs.record_bytes),
    }


def step_seconds(config, backend, dataset, batch_size: int, seconds: float) -> dict:
    """The model's train step on the configured device with a real batch held on the device:
    the rate the loader must reach. On a GPU at the run's batch size; on the CPU at a smaller
    batch (at most 8), scaled to the run's (a CPU step is linear in the batch, and a full one
    of ResNet-50 takes minutes). Returns {"step_s", "device", "measured_batch", "steps"}."""
    from datasets.sampler import EpochSampler
    from train import tasks

    on_gpu = backend.runtime.uses_gpu
    measured_batch = batch_size if on_gpu else min(batch_size, 8)
    loader_cfg = dataclasses.replace(
        config.loader, batch_size=measured_batch, num_workers=0, prefetch_factor=None
    )
    task = tasks.get(config.task)
    num_classes = task.num_classes(config.model, dataset)
    backend.build(config.model, config.optim, task.input_shape(config.data), num_classes, 1_000_000)
    loader = backend.batches.make_loader(
        dataset, EpochSampler(measured_batch), loader_cfg, train=True
    )
    batch = next(iter(backend.batches.device_batches(loader)))
    for _ in range(2):  # warm-up: kernels chosen, memory allocated
        backend.trainer.train_step(batch)
    backend.trainer.read_steps()
    steps, start = 0, time.perf_counter()
    while steps < 3 or (time.perf_counter() - start < seconds and steps < 50):
        backend.trainer.train_step(batch)
        steps += 1
        if not on_gpu or steps % 5 == 0:
            backend.trainer.read_steps()
    backend.trainer.read_steps()
    took = (time.perf_counter() - start) / steps
    return {
        "step_s": took * batch_size / measured_batch,
        "device": backend.runtime.device_name,
        "measured_batch": measured_batch,
        "steps": steps,
    }
