"""Storage in the loader tuner's model (python -m train.tune): a read's wait on storage holds a
worker but no core, the storage's read rate bounds a dataset read from storage, a record cache
that does not fit is refused (or partial) as the cache itself behaves, the grid reaches past
twice the cores when reads wait; and the real measurement sees an injected storage latency as
wait, not CPU."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from datasets import faults
from datasets.dataset import build_ocr_dataset
from datasets.ocr_transforms import CharDict
from tests.test_tune import COSTS as BASE_COSTS
from tests.test_tune import HOST, MS
from train.tune import measure, model, report
from train.tune.measure import LoaderCpu, StageSample, summarize

MIB = 2**20
# A sample costs 2 ms of CPU (decode and augment); reads cost nothing unless a test says so.
COSTS = dataclasses.replace(BASE_COSTS, record_bytes=1000.0)
FAST_DEVICE = model.Target("torch", batch_size=100, step_s=0.001)


def waiting(wait_s: float, costs: model.StageCosts = COSTS) -> model.StageCosts:
    """``costs`` whose every read, first or again, waits ``wait_s`` on storage and costs no CPU
    (a network volume's round trip, below the record cache)."""
    return dataclasses.replace(costs, read_s=wait_s, reread_s=wait_s)


def predict(costs, workers: int, cache: str = "none", host=HOST, target=FAST_DEVICE):
    return model.predict(costs, host, target, model.Candidate(workers, 1, cache, True))


def test_summarize_takes_the_collate_as_cpu_less_cpu_never_negative():
    """A read that waits 0.5 ms (wall) and costs 0.01 ms of CPU: the collate is a sample's CPU
    in get_batch less the re-read's CPU and the transform's, not less the re-read's wall time
    (which charged the collate minus the transform and predicted a loader of a read alone)."""
    sample = StageSample(
        read_s=[0.51 * MS] * 3,
        read_cpu_s=[0.01 * MS] * 3,
        reread_s=[0.51 * MS] * 3,
        reread_cpu_s=[0.01 * MS] * 3,
        decode_s=[0.03 * MS] * 3,
        transform_s=[0.09 * MS] * 3,
        batch_s=[0.12 * 256 * MS] * 3,  # CPU: the sleeps of the reads are not in it
        batch_size=256,
        sample_bytes=30,
        record_bytes=1000.0,
        storage_bytes_per_s=math.inf,
    )
    runs = {ring: LoaderCpu(0.04, 0.04, 4) for ring in ("alone", True, False)}
    costs = summarize(sample, runs)
    assert costs.collate_s == pytest.approx(0.02 * MS)
    assert costs.read_wait_s == pytest.approx(0.5 * MS)
    assert costs.reread_wait_s == pytest.approx(0.5 * MS)
    # A batch whose samples cost less than the transform alone: no negative collate.
    cheap = summarize(dataclasses.replace(sample, batch_s=[0.05 * 256 * MS] * 3), runs)
    assert cheap.collate_s == 0.0
    # The model's loader: 2 workers, each 256 x (0.01 + 0.09 + 0.02 ms CPU + 0.5 ms wait).
    batch_256 = dataclasses.replace(FAST_DEVICE, batch_size=256)
    two = predict(costs, 2, host=dataclasses.replace(HOST, cores=2), target=batch_256)
    per_batch = 256 * (0.12 + 0.5) * MS + costs.worker_handover_s[True]
    assert two.limits[model.WORKERS] == pytest.approx(2 * 256 / per_batch)
    assert two.samples_per_s < 10_000


def test_a_reads_wait_holds_the_workers_but_not_the_cores():
    # 1 ms of wait per read: a batch holds its worker 100 x 3 ms = 0.3 s but takes 0.2 s of CPU.
    waits = predict(waiting(1 * MS), 4)
    assert waits.limits[model.WORKERS] == pytest.approx(4 * 100 / 0.3)
    assert waits.limits[model.CORES] == pytest.approx(4 * 100 / 0.21)  # as with no wait at all
    assert waits.limits[model.CORES] == pytest.approx(predict(COSTS, 4).limits[model.CORES])
    # The same 1 ms as CPU (a read that decompresses): it takes a core too.
    computes = dataclasses.replace(waiting(1 * MS), read_cpu_s=1 * MS, reread_cpu_s=1 * MS)
    assert predict(computes, 4).limits[model.CORES] == pytest.approx(4 * 100 / 0.31)
    # Without workers the trainer waits on each read itself: serial.
    alone = predict(waiting(1 * MS), 0)
    assert alone.limits[model.TRAINER] == pytest.approx(100 / (0.3 + 0.01))


def test_storage_is_named_when_reads_wait_and_a_cache_that_fits_is_predicted_faster():
    # 5 ms waits, 2 ms of CPU: 4 workers wait most of their time (4 x 100 / 0.7 samples/s).
    costs = waiting(5 * MS)
    uncached = predict(costs, 4)
    assert uncached.bottleneck == model.DISK
    assert uncached.samples_per_s == pytest.approx(400 / 0.7)
    assert model.reads_wait_most(costs, HOST, FAST_DEVICE, uncached.candidate)
    # A memory cache skips the wait: the same 4 workers then fill the cores, named the CPU.
    cached = predict(costs, 4, "memory")
    assert cached.samples_per_s == pytest.approx(400 / 0.21)
    assert cached.bottleneck == model.CPU and cached.samples_per_s > 3 * uncached.samples_per_s
    plan = model.plan(costs, HOST, FAST_DEVICE)
    assert plan.pick.candidate.cache != "none" and plan.pick.candidate.workers == 4
    # Reads that cost CPU rather than wait: the CPU's limit, however slow the reads.
    computes = dataclasses.replace(costs, read_cpu_s=5 * MS, reread_cpu_s=5 * MS)
    assert predict(computes, 4).bottleneck == model.CPU
    assert not model.reads_wait_most(computes, HOST, FAST_DEVICE, uncached.candidate)


def test_the_storage_rate_binds_a_dataset_read_from_storage_every_epoch():
    # 1 GiB of 1000-byte records; the page cache keeps half of 1.5 GiB: every read goes to
    # storage, which serves 500 records/s, far below what the CPU makes (1905 samples/s).
    costs = dataclasses.replace(COSTS, storage_bytes_per_s=500 * 1000.0)
    host = dataclasses.replace(HOST, dataset_bytes=1 << 30, memory_available_bytes=3 << 29)
    target = dataclasses.replace(FAST_DEVICE, cache_max_bytes=4 << 30)
    uncached = predict(costs, 4, host=host, target=target)
    assert uncached.limits[model.STORAGE] == pytest.approx(500)
    assert uncached.samples_per_s == pytest.approx(500) and uncached.bottleneck == model.DISK
    # A memory cache that holds it all (1 GiB of the 1.5 available) reads nothing from storage.
    cached = predict(costs, 4, "memory", host=host, target=target)
    assert model.STORAGE not in cached.limits and cached.bottleneck == model.CPU
    # Half of it cached: half the reads go to storage, twice the samples per byte it serves.
    half = dataclasses.replace(target, cache_max_bytes=1 << 29)
    assert predict(costs, 4, "memory", host=host, target=half).limits[
        model.STORAGE
    ] == pytest.approx(1000)
    # A dataset the page cache keeps: no read reaches storage from epoch 2 on.
    assert model.STORAGE not in predict(costs, 4).limits
    # Not measured (a filesystem without O_DIRECT): no bound.
    unmeasured = dataclasses.replace(costs, storage_bytes_per_s=math.inf)
    assert model.STORAGE not in predict(unmeasured, 4, host=host, target=target).limits


def test_the_grid_reaches_past_twice_the_cores_only_when_reads_wait_longer_than_they_compute():
    host = dataclasses.replace(HOST, cores=2)

    def top(costs) -> int:
        plan = model.plan(costs, host, FAST_DEVICE)
        return max(p.candidate.workers for p in plan.predictions)

    assert top(COSTS) == 4  # twice the cores
    assert top(waiting(1 * MS)) == 4  # waits shorter than the 2 ms of CPU: no wider
    assert top(waiting(6 * MS)) == 2 * (1 + 3)  # cores x (1 + wait / CPU)
    assert top(waiting(100 * MS)) == model.MAX_WORKERS_FOR_WAITS
    # Reads that compute as long do not widen it: more workers than cores would only queue.
    computes = dataclasses.replace(waiting(6 * MS), read_cpu_s=6 * MS, reread_cpu_s=6 * MS)
    assert top(computes) == 4
    # Without the costs (the benchmark's grid), the rule of twice the cores.
    assert max(c.workers for c in model.candidates(host, FAST_DEVICE)) == 4
    # Where reads wait, the widened grid is where the model's fastest uncached setting lies.
    plan = model.plan(waiting(6 * MS), host, FAST_DEVICE, caches=("none",))
    assert plan.best.candidate.workers > 4


def test_a_cache_that_does_not_fit_is_refused_as_it_would_fail_or_is_partial():
    costs = waiting(5 * MS)
    big = dataclasses.replace(HOST, dataset_bytes=1 << 30)  # under cache_max_bytes (2 GiB)

    def refused(cache: str, host, target=FAST_DEVICE) -> model.Prediction:
        prediction = predict(costs, 4, cache, host=host, target=target)
        assert not prediction.feasible
        return prediction

    # A memory cache fills /dev/shm, whose pages are memory: more than either is refused.
    shm = refused("memory", dataclasses.replace(big, shm_free_bytes=1 << 29))
    assert shm.lacks == model.SHM and "/dev/shm" in shm.why_not
    memory = refused("memory", dataclasses.replace(big, memory_available_bytes=1 << 29))
    assert memory.lacks == model.MEMORY and "memory" in memory.why_not
    # Every local rank has its own: 1 GiB fits 1.5 GiB for one rank, not for two.
    roomy = dataclasses.replace(big, shm_free_bytes=3 << 29)
    assert predict(costs, 4, "memory", host=roomy).feasible
    refused("memory", roomy, dataclasses.replace(FAST_DEVICE, local_ranks=2))
    # A disk cache reserves its whole file at start, or the run stops: refused, not partial.
    disk = refused("disk", dataclasses.replace(big, cache_dir_free_bytes=1 << 29))
    assert disk.lacks == model.CACHE_DIR and "reserves" in disk.why_not
    # ... unless a run built it already: then it is reused.
    built = dataclasses.replace(big, cache_dir_free_bytes=1 << 29, disk_cache_built=True)
    assert predict(costs, 4, "disk", host=built).feasible
    # A dataset larger than data.cache_max_bytes: the cache stops admitting when full, and the
    # rest is read as without a cache (a quarter of 4 GiB held: 3/4 of the reads wait).
    larger = dataclasses.replace(HOST, dataset_bytes=4 << 30)
    assert model.cache_fraction(costs, larger, FAST_DEVICE, "memory") == pytest.approx(0.5)
    quarter = dataclasses.replace(FAST_DEVICE, cache_max_bytes=1 << 30)
    read = model.sample_read(costs, larger, quarter, "memory")
    assert read.wait_s == pytest.approx(0.75 * 5 * MS)
    assert predict(costs, 4, "memory", host=larger, target=quarter).feasible
    # A faster setting refused for memory (not /dev/shm) is not named /dev/shm: reads that
    # cost 5 ms of CPU, which only the memory cache would spare.
    computes = dataclasses.replace(costs, read_cpu_s=5 * MS, reread_cpu_s=5 * MS)
    short = dataclasses.replace(big, memory_available_bytes=1 << 29)
    plan = model.plan(computes, short, FAST_DEVICE)
    unfit = [p for p in plan.predictions if p.candidate.cache == "memory"]
    assert all(p.lacks == model.MEMORY for p in unfit)
    assert max(p.samples_per_s for p in unfit) > 2 * plan.best.samples_per_s
    assert plan.bottleneck == model.CPU


def test_the_disk_cache_of_this_dataset_is_found_built(ocr_lmdb, tmp_path):
    charset = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    data = SimpleNamespace(
        train=str(ocr_lmdb), cache_dir=tmp_path / "cache", cache_max_bytes=1 << 30
    )
    assert not measure.disk_cache_built(data)
    built = build_ocr_dataset(
        str(ocr_lmdb),
        charset,
        train=True,
        cache="disk",
        cache_max_bytes=data.cache_max_bytes,
        cache_dir=data.cache_dir,
        state_dir=tmp_path,
    )
    built.close()
    assert measure.disk_cache_built(data)
    # Another size is another file: a run with it would build (and reserve) its own.
    assert not measure.disk_cache_built(SimpleNamespace(**{**vars(data), "cache_max_bytes": 4096}))


LATENCY_MS = 2.0


def test_the_measurement_sees_an_injected_storage_latency_as_wait_not_cpu(
    ocr_lmdb, tmp_path, monkeypatch
):
    """time_stages over a real dataset with DATA_INJECT_FAULT=latency@2 (2 ms before each read
    from the storage): each read's wall time exceeds its CPU time by about the latency, its CPU
    stays small, and get_batch's CPU (whose reads sleep too) is no larger for it."""
    monkeypatch.setenv(faults.ENV, f"latency@{LATENCY_MS}")
    monkeypatch.setattr(faults, "_parsed", {})  # parsed once per process: parse it again
    charset = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    dataset = build_ocr_dataset(ocr_lmdb, charset, train=True, state_dir=tmp_path)
    try:
        sample = measure.time_stages(dataset, batch_size=8, seed=0, seconds=0.5)
    finally:
        dataset.close()
    runs = {ring: LoaderCpu(0.01, 0.01, 4) for ring in ("alone", True, False)}
    costs = summarize(sample, runs)
    latency = LATENCY_MS * MS
    for wait in (costs.read_wait_s, costs.reread_wait_s):
        assert 0.9 * latency <= wait <= latency + 3 * MS
    assert costs.read_cpu_s < 0.5 * MS and costs.reread_cpu_s < 0.5 * MS
    # A sample in a batch (CPU) costs what its transform does, not the latency besides.
    assert costs.transform_s + costs.collate_s < costs.transform_s + latency / 2
    assert costs.storage_bytes_per_s > 0  # math.inf where the filesystem reads no O_DIRECT


def reported(storage_bytes_per_s: float) -> tuple[dict, str]:
    """report.json's content and report.md's text of a tuning with one measured setting (4
    workers, no cache) over 1 GiB that the page cache cannot keep, reads that wait 0.5 ms."""
    from train.tune import run as tune_run
    from train.tune import verify

    costs = dataclasses.replace(
        waiting(0.5 * MS),
        read_cpu_s=0.01 * MS,
        reread_cpu_s=0.02 * MS,
        storage_bytes_per_s=storage_bytes_per_s,
    )
    host = dataclasses.replace(HOST, dataset_bytes=1 << 30, memory_available_bytes=1 << 30)
    sample = StageSample(
        *([0.51 * MS], [0.01 * MS], [0.52 * MS], [0.02 * MS], [1 * MS], [2 * MS], [0.2]),
        batch_size=100,
        sample_bytes=1,
        record_bytes=1000.0,
        storage_bytes_per_s=storage_bytes_per_s,
    )
    four = model.Candidate(4, 1, "none", True)
    step = {"step_s": 0.001, "source": "--step-ms"}
    plan = model.plan(costs, host, FAST_DEVICE)
    stages = measure.describe(sample, costs)
    tuning = tune_run.Tuning(host, costs, stages, step, FAST_DEVICE, plan, configured=four)
    tuning.measured += [verify.Measured(four, rate, 10, 0.1) for rate in (1000, 1001, 999)]
    tune_run.choose(tuning)
    written = report.as_json(tuning, "python -m train.tune", "python -m train")
    return written, report.markdown(written, tuning)


def test_the_report_shows_read_wall_and_cpu_the_storage_rate_and_its_bound():
    written, text = reported(storage_bytes_per_s=4e6)
    assert written["stages"]["read_cpu"]["median_ms"] == 0.01
    assert written["stages"]["reread"]["median_ms"] == 0.52
    assert written["stages"]["storage_records_per_s"] == 4000
    (row,) = written["measured"]
    assert row["storage_bound_samples_per_s"] == pytest.approx(4000)
    assert "0.51 / 0.01 ms" in text and "0.52 / 0.02 ms" in text
    assert "4000 records/s" in text and "| 4000.0 |" in text
    # A storage that could not be measured: no bound, said so, and report.json stays JSON.
    written, text = reported(storage_bytes_per_s=math.inf)
    assert written["measured"][0]["storage_bound_samples_per_s"] is None
    assert written["costs"]["storage_bytes_per_s"] is None
    json.dumps(written, allow_nan=False)
    assert "was not measured" in text
