"""The tuner's measurements: what each stage of the input pipeline costs on a sample of the real
data, what this host (this container) gives the loader, and the step the loader must keep up
with. Framework-free except :func:`step_seconds`, which builds the model with the backend.

Each stage is timed where a worker runs it, with the dataset's own calls:
- read: the dataset's read of a record (``RecordDataset._read``, below where a record cache
  would sit), the first time (storage) and again (the page cache), in wall time and in the
  thread's CPU time: the CPU time is what the read demands of a core, the rest of its wall time
  is what it waits on storage (its latency), which holds a worker but no core;
- storage: the read rate of the data's storage for reads the page cache does not serve
  (:func:`storage_read_rate`), which bounds a dataset read from storage every epoch;
- decode: the image decode alone (``datasets.decode.decode_bgr``, the full image, under the
  transform's pixel budget, checked from the header as training does), CPU time;
- augment: the rest of the transform (augmentation, crop and resize, label encoding), CPU time;
- batched: what a sample costs inside ``get_batch``, the call a worker makes per batch, CPU
  time; less the re-read's and the transform's CPU, the collate's cost (never below 0: a batch
  whose samples cost less than the transform alone is charged the transform);
- hand-over: the CPU seconds per batch of the backend's real loader, in the trainer process and
  in the workers, without workers and with one (ring on and off): what a batch costs beyond
  making it, on each side.
CPU time (not wall time) is what a stage demands of a core: on a busy host the wall time of
the same work grows with what else runs.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets import cache, decode
from datasets.dataset import SampleRng
from datasets.errors import BadSampleError, DatasetError
from train.cpus import usable_cores
from train.stall import host_cpu, process_tree_cpu
from train.tune.model import Host, StageCosts
from train.tune.verify import batches_of, failures_named, more_workers_than_cores

SHM_PATH = "/dev/shm"
# The storage probe (storage_read_rate): reads in flight at once, about a loader's workers, and
# how long it reads.
STORAGE_PROBE_THREADS = 8
STORAGE_PROBE_S = 0.3
# O_DIRECT wants the offset, the length and the buffer aligned to the device's logical block:
# 4096 covers the common ones (512 and 4096).
DIRECT_IO_ALIGN = 4096


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
    # cgroup v2, then v1 (whose "no limit" is a huge number, which min() leaves alone)
    for limit_file, used_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            used = int(Path(used_file).read_text())
        except (OSError, ValueError):
            continue
        if limit != "max":
            available = min(available, max(0, int(limit) - used))
        break
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


def disk_cache_built(data) -> bool:
    """Whether ``data.cache_dir`` holds a finished ``data.cache: disk`` file of this dataset
    version at this cache size: its header names the dataset's fingerprint and the capacity a
    run would give it (datasets/cache.py), so a run reuses it and reserves nothing more."""
    source = str(data.train)
    dataset_bytes = path_bytes(source)
    try:
        entries = list(os.scandir(data.cache_dir))
    except OSError:
        return False
    for entry in entries:
        if not (entry.name.startswith("records-") and entry.name.endswith(".cache")):
            continue
        try:
            header = np.fromfile(entry.path, dtype=np.int64, count=cache.H_FINGERPRINT + 1)
        except (OSError, ValueError):
            continue
        if len(header) <= cache.H_FINGERPRINT:
            continue
        items = int(header[cache.H_ITEMS])
        capacity = min(data.cache_max_bytes, dataset_bytes + cache.RECORD_FRAMING_BYTES * items)
        fingerprint = cache.fingerprint(source, items)
        if (header[cache.H_CAPACITY], header[cache.H_FINGERPRINT]) == (capacity, fingerprint):
            return True
    return False


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
        disk_cache_built=disk_cache_built(data),
    )


def storage_read_rate(
    paths,
    record_bytes: float,
    seconds: float = STORAGE_PROBE_S,
    threads: int = STORAGE_PROBE_THREADS,
) -> float:
    """Bytes of records per second that the storage under ``paths`` (files, or folders of
    files) serves to reads the page cache does not: ``threads`` threads at once, each reading
    blocks of a record's size (rounded up to DIRECT_IO_ALIGN) at random offsets of the files
    (weighted by size) with O_DIRECT, which the page cache neither serves nor keeps, for
    ``seconds``. The rate is the reads per second x ``record_bytes``: the samples/s a dataset
    read from storage can get is this over the record's bytes.

    What it cannot see: it reads the files' blocks, not records through their format (an LMDB
    record may span two pages; a B-tree lookup may read more); at one depth of reads in flight
    (``threads``); a drive's own cache may serve a block read twice; and the latency a network
    volume adds per request beyond the blocks (the stage timings' read wait measures that). A
    filesystem that cannot read around the page cache (tmpfs, whose data is memory; some
    overlay and network filesystems refuse O_DIRECT) gives math.inf: no storage bound."""
    if not hasattr(os, "O_DIRECT"):  # no read around the page cache on this system
        return math.inf
    block = max(DIRECT_IO_ALIGN, math.ceil(record_bytes / DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN)
    files = []
    for path in dict.fromkeys(Path(p) for p in paths):
        found = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in found:
            size = file.stat().st_size
            if size < block:
                continue
            try:
                fd = os.open(file, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                continue
            files.append((fd, (size - block) // DIRECT_IO_ALIGN))
    if not files:
        return math.inf
    # A file is drawn in proportion to its blocks: each block as likely as any other.
    ends = np.cumsum([last + 1 for _, last in files])
    reads = [0] * threads
    failed: list[OSError] = []
    deadline = time.perf_counter() + seconds

    def read(thread: int) -> None:
        rng = np.random.default_rng(thread)
        buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
        try:
            while time.perf_counter() < deadline and not failed:
                drawn = int(rng.integers(0, ends[-1]))
                which = int(np.searchsorted(ends, drawn, side="right"))
                first = int(ends[which - 1]) if which else 0
                os.preadv(files[which][0], [buffer], (drawn - first) * DIRECT_IO_ALIGN)
                reads[thread] += 1
        except OSError as error:  # EINVAL: this filesystem takes no O_DIRECT read
            failed.append(error)
        finally:
            buffer.close()

    started = time.perf_counter()
    try:
        running = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join()
    finally:
        for fd, _ in files:
            os.close(fd)
    took = time.perf_counter() - started
    if failed or sum(reads) == 0:
        return math.inf
    return sum(reads) * record_bytes / took


@dataclass
class StageSample:
    """Per-sample timings of the sampled records, for the report's spread."""

    read_s: list[float]  # wall time
    read_cpu_s: list[float]  # the same reads' CPU time
    reread_s: list[float]  # wall time
    reread_cpu_s: list[float]
    decode_s: list[float]
    transform_s: list[float]
    batch_s: list[float]  # whole get_batch calls, CPU time
    batch_size: int
    sample_bytes: int  # one collated sample
    record_bytes: float  # mean stored record
    storage_bytes_per_s: float  # storage_read_rate: math.inf when not measured


def _cpu_timed(call, *args):
    """(result, CPU seconds of this thread)."""
    start = time.thread_time()
    result = call(*args)
    return result, time.thread_time() - start


def _wall_and_cpu_timed(call, *args):
    """(result, wall seconds, CPU seconds of this thread)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    result = call(*args)
    return result, time.perf_counter() - wall, time.thread_time() - cpu


def time_stages(dataset, batch_size: int, seed: int, seconds: float) -> StageSample:
    """Time each stage on records drawn at random from ``dataset`` (a RecordDataset with no
    cache) for about ``seconds``: per-sample stages first (16 to 512 records), the storage's
    read rate (:func:`storage_read_rate`, a fraction of a second), then whole batches as a
    worker makes them (2 to 32). A bad sample (a record training would skip: an image over the
    pixel budget is refused from its header, never decoded) is skipped here too."""
    order = np.random.default_rng(seed).permutation(len(dataset))
    max_pixels = getattr(dataset.transform, "max_pixels", decode.MAX_IMAGE_PIXELS)
    sample = StageSample([], [], [], [], [], [], [], batch_size, 0, 0.0, math.inf)
    record_bytes, stored_in = [], set()
    deadline = time.perf_counter() + seconds / 2
    for count, position in enumerate(order[:512]):
        if count >= 16 and time.perf_counter() > deadline:
            break
        index = dataset._source_index(int(position))
        (data, label), read, read_cpu = _wall_and_cpu_timed(dataset._read, index)
        _, reread, reread_cpu = _wall_and_cpu_timed(dataset._read, index)
        try:
            _, decoded = _cpu_timed(decode.decode_bgr, data, max_pixels)
            rng = SampleRng((seed, 0, index))
            transformed, transform = _cpu_timed(dataset.transform, data, label, rng)
        except BadSampleError:
            continue
        sample.read_s.append(read)
        sample.read_cpu_s.append(read_cpu)
        sample.reread_s.append(reread)
        sample.reread_cpu_s.append(reread_cpu)
        sample.decode_s.append(decoded)
        sample.transform_s.append(transform)
        record_bytes.append(len(data))
        stored_in.add(dataset.source.source_of(index))
    if not sample.decode_s:
        raise DatasetError(
            "every record drawn to time the input pipeline is a bad sample",
            "check the dataset with scripts/validate_data.py",
        )
    sample.sample_bytes = int(sum(np.asarray(v).nbytes for v in transformed.values()))
    sample.record_bytes = statistics.fmean(record_bytes)
    sample.storage_bytes_per_s = storage_read_rate(sorted(stored_in), sample.record_bytes)
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
    spread averaged over a batch (independent samples: cv / sqrt(batch)), a sample's time in a
    worker being its re-read's wall time and its transform. The collate's cost is CPU less CPU:
    a sample's CPU in ``get_batch`` (whose reads are re-reads of the sampled records) less the
    re-read's and the transform's, never below 0. The hand-over's costs are the loader runs'
    (``handover``, CPU) beyond making the batch (CPU)."""
    median = statistics.median
    reread_cpu = median(sample.reread_cpu_s)
    decoded = median(sample.decode_s)
    transform = median(sample.transform_s)
    batch = median(sample.batch_s)
    collate = max(0.0, batch / sample.batch_size - reread_cpu - transform)
    per_sample = [r + t for r, t in zip(sample.reread_s, sample.transform_s, strict=True)]
    cv = max(_cv(sample.batch_s), _cv(per_sample) / sample.batch_size**0.5)
    return StageCosts(
        read_s=median(sample.read_s),
        read_cpu_s=median(sample.read_cpu_s),
        reread_s=median(sample.reread_s),
        reread_cpu_s=reread_cpu,
        decode_s=min(decoded, transform),
        augment_s=max(0.0, transform - decoded),
        collate_s=collate,
        trainer_alone_s=max(0.0, runs["alone"].trainer_s - batch),
        worker_handover_s={ring: max(0.0, runs[ring].workers_s - batch) for ring in (True, False)},
        trainer_handover_s={ring: runs[ring].trainer_s for ring in (True, False)},
        sample_bytes=sample.sample_bytes,
        record_bytes=sample.record_bytes,
        batch_cv=cv,
        storage_bytes_per_s=sample.storage_bytes_per_s,
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
        "read": ms(sample.read_s),  # wall time
        "read_cpu": ms(sample.read_cpu_s),
        "reread": ms(sample.reread_s),  # wall time
        "reread_cpu": ms(sample.reread_cpu_s),
        "read_wait_ms": {
            "first": round(costs.read_wait_s * 1e3, 4),
            "again": round(costs.reread_wait_s * 1e3, 4),
        },
        # records' bytes per second from storage, past the page cache; None: not measurable
        "storage_mb_per_s": (
            round(costs.storage_bytes_per_s / 2**20, 1)
            if math.isfinite(costs.storage_bytes_per_s)
            else None
        ),
        "storage_records_per_s": (
            round(costs.storage_bytes_per_s / max(costs.record_bytes, 1.0))
            if math.isfinite(costs.storage_bytes_per_s)
            else None
        ),
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
