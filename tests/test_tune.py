"""The loader tuner (python -m train.tune): its model on synthetic stage costs with known
answers, its summary of measured stages, and the command end to end on the smoke configs in
both frameworks, whose tuned.yaml validates and trains."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time

import pytest
import yaml

from tests.test_train import ROOT, data_overrides, set_args
from train.tune import model
from train.tune.measure import LoaderCpu, StageSample, summarize

MS = 1e-3
COSTS = model.StageCosts(
    read_s=0.0,
    read_cpu_s=0.0,
    reread_s=0.0,
    reread_cpu_s=0.0,
    decode_s=1 * MS,
    augment_s=1 * MS,
    collate_s=0.0,
    trainer_alone_s=10 * MS,
    worker_handover_s={True: 0.0, False: 0.0},
    trainer_handover_s={True: 10 * MS, False: 10 * MS},
    sample_bytes=1,
    record_bytes=1.0,
    batch_cv=0.0,
    storage_bytes_per_s=math.inf,
)
HOST = model.Host(
    cores=4,
    shm_free_bytes=1 << 40,
    memory_available_bytes=1 << 40,
    dataset_bytes=1 << 20,
    cache_dir_free_bytes=1 << 40,
    copy_bytes_per_s=1e12,  # a cache hit costs nothing
)


def target(step_s: float, shm_need=None) -> model.Target:
    return model.Target("torch", batch_size=100, step_s=step_s, shm_need=shm_need)


def test_a_cpu_bound_pipeline_gets_the_fewest_workers_that_fill_the_cores():
    # A batch costs a worker 100 x 2 ms = 0.2 s and the trainer 10 ms: w workers make 500 w
    # samples/s until the 4 cores are full at 100 x 4 / 0.21 = 1905 samples/s (w = 4).
    plan = model.plan(COSTS, HOST, target(step_s=0.001))
    assert plan.pick.candidate == model.Candidate(4, 1, "none", True)
    assert plan.pick.samples_per_s == pytest.approx(400 / 0.21)
    assert plan.pick.bottleneck == model.CPU and plan.bottleneck == model.CPU
    three = model.predict(COSTS, HOST, target(0.001), model.Candidate(3, 1, "none", True))
    assert three.samples_per_s == pytest.approx(1500)
    alone = model.predict(COSTS, HOST, target(0.001), model.Candidate(0, 1, "none", False))
    assert alone.samples_per_s == pytest.approx(100 / 0.21)  # load and hand over, serially


def test_a_slow_device_gets_fewer_workers_and_is_named_the_limit():
    # 0.5 s steps take 200 samples/s. Loading in the trainer (476 samples/s) keeps up while the
    # device runs the step before, when batch times do not vary.
    plan = model.plan(COSTS, HOST, target(step_s=0.5))
    assert plan.pick.candidate.workers == 0
    assert plan.pick.samples_per_s == pytest.approx(200)
    assert plan.bottleneck == model.GPU
    assert "device" in plan.sentence()
    # With cv 1, a stall costs the device: 2 workers x 2 batches (loader at 1000 samples/s,
    # closeness 0.2, Q 4: 200 / 1.025) are the cheapest within 3% of the best (8 x 4: 199.7).
    plan = model.plan(dataclasses.replace(COSTS, batch_cv=1.0), HOST, target(step_s=0.5))
    assert plan.pick.candidate == model.Candidate(2, 2, "none", True)
    assert plan.pick.samples_per_s == pytest.approx(200 / 1.025)
    assert plan.bottleneck == model.GPU


def test_a_cpu_step_shares_the_trainer_and_the_cores_with_the_loader():
    # A 0.3 s step on the CPU: without workers loading is serial with it (100 / 0.51); with
    # workers the trainer still computes each step after taking its batch (100 / 0.31).
    cpu_target = dataclasses.replace(target(step_s=0.3), step_on_cpu=True)
    alone = model.predict(COSTS, HOST, cpu_target, model.Candidate(0, 1, "none", False))
    assert alone.samples_per_s == pytest.approx(100 / 0.51)
    plan = model.plan(COSTS, HOST, cpu_target)
    assert plan.pick.candidate == model.Candidate(1, 1, "none", True)
    assert plan.pick.samples_per_s == pytest.approx(100 / 0.31)
    assert plan.bottleneck == model.GPU


def test_prefetch_grows_with_the_spread_of_batch_times():
    # A device as fast as the 4 cores' loader (closeness 1 from 4 workers on), cv 1: Q batches
    # in flight cost a factor 1 / (1 + 1 / 2Q). The fastest is 8 workers x 4 (Q 32, 0.985);
    # 4 x 4 (Q 16, 0.970) is within 3% of it and the cheapest that is.
    costs = dataclasses.replace(COSTS, batch_cv=1.0)
    plan = model.plan(costs, HOST, target(step_s=0.21 / 4))
    assert plan.best.candidate.workers == 8 and plan.best.candidate.prefetch == 4
    assert plan.pick.candidate == model.Candidate(4, 4, "none", True)
    assert plan.pick.samples_per_s == pytest.approx(400 / 0.21 / (1 + 1 / 32))
    # Against a device 50 times faster, the spread costs nothing: prefetch 1 does.
    assert model.plan(costs, HOST, target(step_s=0.001)).pick.candidate.prefetch == 1


def test_slow_storage_is_named_and_a_memory_cache_that_fits_is_picked():
    # 5 ms reads of a dataset larger than the page cache can keep; the memory cache holds it
    # all (cache_max_bytes 2 GiB), the disk cache is memory-mapped from the same slow disk.
    costs = dataclasses.replace(COSTS, read_s=5 * MS, reread_s=5 * MS)
    host = dataclasses.replace(HOST, dataset_bytes=1 << 30, memory_available_bytes=1 << 30)
    plan = model.plan(costs, host, target(step_s=0.001))
    uncached = model.predict(costs, host, target(0.001), model.Candidate(4, 1, "none", True))
    assert uncached.bottleneck == model.DISK
    assert plan.pick.candidate == model.Candidate(4, 1, "memory", True)
    assert plan.pick.samples_per_s == pytest.approx(400 / 0.21, rel=1e-3)


def test_a_faster_setting_that_does_not_fit_dev_shm_is_named():
    # Reads that cost 5 ms of CPU (a wait would be overlapped by more workers instead).
    costs = dataclasses.replace(
        COSTS, read_s=5 * MS, read_cpu_s=5 * MS, reread_s=5 * MS, reread_cpu_s=5 * MS
    )
    host = dataclasses.replace(
        HOST, dataset_bytes=1 << 30, memory_available_bytes=1 << 30, shm_free_bytes=1 << 29
    )

    def need(candidate: model.Candidate) -> int:  # the memory cache counts against /dev/shm
        return (1 << 30) if candidate.cache == "memory" else 0

    plan = model.plan(costs, host, target(0.001, shm_need=need))
    assert plan.pick.candidate.cache != "memory"
    assert plan.bottleneck == model.SHM
    unfit = [p for p in plan.predictions if p.candidate.cache == "memory"]
    assert unfit and not any(p.feasible for p in unfit)
    assert "/dev/shm" in unfit[0].why_not


def test_the_measured_runs_cover_the_pick_and_its_neighbours():
    plan = model.plan(COSTS, HOST, target(step_s=0.001))
    pick = plan.pick.candidate
    assert plan.to_verify[0] == pick
    assert dataclasses.replace(pick, workers=5) in plan.to_verify
    assert dataclasses.replace(pick, workers=3) in plan.to_verify
    assert dataclasses.replace(pick, ring=False) in plan.to_verify
    assert dataclasses.replace(pick, prefetch=2) in plan.to_verify
    assert {c.cache for c in plan.to_verify} == {"none", "memory", "disk"}
    assert len(plan.to_verify) == len(set(plan.to_verify))


def test_when_the_device_is_the_limit_the_search_only_tries_fewer_workers(monkeypatch):
    """The model's pick (4 workers) measures at the device's rate (100 samples a 50 ms step):
    nothing can run faster, so the search walks the worker count down while the device stays
    fed (3, 2), stops at the first count that falls short (1) and tries no other knob; the
    cheapest setting at the device's rate is chosen. The runs are stand-ins here, with the
    rates a host would measure: the search's branch does not depend on how fast this host is."""
    from train.tune import run as tune_run
    from train.tune import verify

    step = target(step_s=0.05)
    plan = model.plan(COSTS, HOST, step)
    assert plan.pick.candidate == model.Candidate(4, 1, "none", True)
    tuning = tune_run.Tuning(
        HOST, COSTS, {}, {"step_s": 0.05}, step, plan, configured=plan.pick.candidate
    )
    device_rate = step.batch_size / step.step_s

    def measure(config, backend, candidate, device, window_s, expected, on_device=True):
        rate = device_rate if candidate.workers >= 2 else device_rate / 2
        return verify.Measured(candidate, rate, batches=10, seconds=0.1)

    monkeypatch.setattr(verify, "measure", measure)
    deadline = time.perf_counter() + 60
    tune_run.search(tuning, None, None, None, 1.0, deadline, on_device=False)
    walk = [m.candidate.workers for m in tuning.measured]
    # The walk down, then the pick (2) and the fastest (4) confirmed to MIN_RUNS runs each.
    assert walk[:4] == [4, 3, 2, 1] and sorted(walk[4:]) == [2, 2, 4, 4]
    assert {
        (m.candidate.prefetch, m.candidate.cache, m.candidate.ring) for m in tuning.measured
    } == {(1, "none", True)}
    tune_run.choose(tuning)
    assert tuning.pick == model.Candidate(2, 1, "none", True)


def _measured_tuning(runs: dict) -> object:
    """A Tuning whose measured runs are ``runs`` ({candidate: [samples/s, ...]})."""
    from train.tune import run as tune_run
    from train.tune import verify

    plan = model.plan(COSTS, HOST, target(step_s=0.001))
    tuning = tune_run.Tuning(HOST, COSTS, {}, {"step_s": 0.001}, target(0.001), plan)
    for candidate, rates in runs.items():
        tuning.measured += [verify.Measured(candidate, rate, 10, 0.1) for rate in rates]
    return tuning


def test_more_workers_are_picked_only_when_their_gain_beats_the_noise():
    from train.tune import run as tune_run

    two, four = model.Candidate(2, 1, "none", True), model.Candidate(4, 1, "none", True)
    # 4 workers read 6% faster by their medians, but the runs spread +-15%: not measurably
    # faster, so the cheaper 2 workers are as good.
    noisy = _measured_tuning({two: [1000, 1150, 850], four: [1060, 1220, 900]})
    tune_run.choose(noisy)
    assert noisy.pick == two
    low, high = noisy.interval(four)
    assert low < 1000 < high  # two's mean lies inside four's interval
    # The same 6% gain with runs that agree to 1%: beyond the noise and the 3% margin.
    steady = _measured_tuning({two: [1000, 1005, 995], four: [1060, 1065, 1055]})
    tune_run.choose(steady)
    assert steady.pick == four
    # Within the 3% margin, the cheaper setting however steady the runs.
    close = _measured_tuning({two: [1000, 1001, 999], four: [1020, 1021, 1019]})
    tune_run.choose(close)
    assert close.pick == two


def test_a_setting_measured_once_is_neither_picked_nor_the_yardstick():
    """One lucky run of 8 workers does not decide: the settings measured more than once are
    compared, and the pick is measured again until it has MIN_RUNS runs."""
    from train.tune import run as tune_run
    from train.tune import verify

    two, eight = model.Candidate(2, 1, "none", True), model.Candidate(8, 1, "none", True)
    tuning = _measured_tuning({two: [1000, 1002], eight: [1500]})  # 8 workers: one outlier
    assert tune_run.current_pick(tuning) == (two, two)  # the single run is no yardstick
    again = []

    def run(candidate):
        again.append(candidate)
        tuning.measured.append(verify.Measured(candidate, 1001, batches=10, seconds=0.1))

    tune_run.confirm_pick(tuning, run)
    assert again == [two] and len(tuning.rates()[two]) == tune_run.MIN_RUNS
    tune_run.choose(tuning)
    assert tuning.pick == two


def test_a_measured_window_covers_rounds_of_every_worker():
    from train.tune.verify import MIN_WINDOW_BATCHES, ROUNDS_PER_WINDOW, window_batches

    assert window_batches(0, 0.1, 100.0, 10) == MIN_WINDOW_BATCHES  # 1 batch by time
    assert window_batches(8, 0.1, 100.0, 10) == ROUNDS_PER_WINDOW * 8  # rounds, not seconds
    assert window_batches(2, 5.0, 1000.0, 10) == 500  # a long window by time stays long


def test_summarize_takes_medians_and_the_handover_beyond_making_the_batch():
    sample = StageSample(
        read_s=[0.004, 0.002, 0.003],
        read_cpu_s=[0.001, 0.001, 0.001],
        reread_s=[0.001, 0.001, 0.001],
        reread_cpu_s=[0.001, 0.001, 0.001],
        decode_s=[0.002, 0.002, 0.050],  # one slow outlier does not move the median
        transform_s=[0.005, 0.005, 0.005],
        batch_s=[0.5, 0.5, 0.5],
        batch_size=100,
        sample_bytes=30,
        record_bytes=1000.0,
        storage_bytes_per_s=math.inf,
    )
    runs = {
        "alone": LoaderCpu(trainer_s=0.6, workers_s=0.0, batches=4),
        True: LoaderCpu(trainer_s=0.02, workers_s=0.51, batches=4),
        False: LoaderCpu(trainer_s=0.01, workers_s=0.55, batches=4),
    }
    costs = summarize(sample, runs)
    assert costs.read_s == pytest.approx(0.003)
    assert costs.decode_s == pytest.approx(0.002)
    assert costs.augment_s == pytest.approx(0.003)
    # 5 ms a sample in a batch, less the 1 ms read's CPU: 4 ms, under the transform's 5 ms
    assert costs.collate_s == 0.0
    assert costs.trainer_alone_s == pytest.approx(0.1)
    assert costs.worker_handover_s == {True: pytest.approx(0.01), False: pytest.approx(0.05)}
    assert costs.trainer_handover_s == {True: 0.02, False: 0.01}
    assert costs.batch_cv == pytest.approx(0.0)


FRAMEWORKS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("resnet50", "torch", marks=pytest.mark.torch),
]
EACH_FRAMEWORK = [
    pytest.param("paddle", marks=pytest.mark.paddle),
    pytest.param("torch", marks=pytest.mark.torch),
]


def run_tune(task: str, sets: list[str], budget_s: float, out) -> subprocess.CompletedProcess:
    """python -m train.tune on the task's smoke scenario with ``sets``, writing into ``out``."""
    return subprocess.run(
        [sys.executable, "-m", "train.tune", "--config", f"configs/{task}/smoke.yaml"]
        + set_args(sets)
        + ["--budget-s", f"{budget_s:g}", "--output-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(("task", "framework"), FRAMEWORKS)
def test_tune_writes_a_tuned_config_that_validates_and_trains(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    # Batches of 8: the CPU step of each measured run (3 runs of the pick, at least 8 batches
    # each) then fits a 20 s budget.
    sets = [
        f"framework={framework}",
        "loader.batch_size=8",
        *data_overrides(task, ocr_lmdb, image_h5),
    ]
    out = tmp_path / "tune"
    tuned = run_tune(task, sets, 20, out)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["step"]["source"] == "measured"  # the smoke configs train on the CPU
    assert report["step"]["step_s"] > 0
    settings = {row["setting"] for row in report["measured"]}
    assert report["pick"]["setting"] in settings and report["configured"] in settings
    (pick_row,) = [row for row in report["measured"] if row["setting"] == report["pick"]["setting"]]
    assert len(pick_row["runs"]) >= 3 and pick_row["interval_95"] is not None  # never one run
    assert all(row["samples_per_s"] > 0 for row in report["measured"])
    assert report["bottleneck"] in model.BOTTLENECK_TEXT
    assert (out / "throughput.png").stat().st_size > 0
    assert report["bottleneck_text"] in (out / "report.md").read_text()

    text = (out / "tuned.yaml").read_text()
    written = yaml.safe_load(text)
    assert set(written) == {"extends", "framework", "data", "loader"}
    assert written["loader"]["num_workers"] == report["pick"]["loader"]["num_workers"]
    checked = subprocess.run(
        [sys.executable, "-m", "train.config", str(out / "tuned.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    run_dir = tmp_path / "run"
    trained = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(out / "tuned.yaml")]
        + set_args(["train.max_steps=2", "optim.warmup_steps=1", "train.eval_every=2"])
        + ["--output-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["loader"]["num_workers"] == written["loader"]["num_workers"]
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_a_worker_that_dies_in_a_measured_run_is_named_with_its_sample(
    framework, ocr_lmdb, monkeypatch, capsys
):
    """A measured run whose worker dies (here it exits on sample #3; in a tuning run, the kernel
    killing workers for memory at a large setting) ends the tuner as it ends training: the
    report names the sample and the worker, and the exit code is training's (6)."""
    from tests.backends import make_config, start
    from train import errors
    from train.tune import verify

    config = make_config(framework, "ocr", ocr_lmdb)
    backend = start(config)
    monkeypatch.setenv("DATA_INJECT_FAULT", "exit@3")  # read in the workers this run forks
    candidate = model.Candidate(workers=1, prefetch=2, cache="none", ring=True)
    device = verify.DeviceStandIn(0.0)
    with pytest.raises(verify.LoaderFailed) as failed:
        verify.measure(config, backend, candidate, device, 0.1, 100.0, on_device=False)
    assert failed.value.code == errors.EXIT_WORKER
    stderr = capsys.readouterr().err
    assert "died while reading sample #3 (key" in stderr, stderr[-2000:]
    assert "HINT" in stderr


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_a_budget_too_small_to_search_is_a_config_error_with_the_budget_that_fits(
    framework, tmp_path, ocr_lmdb, image_h5
):
    """The stage and step measurements take their share whatever the budget; a budget that
    then cannot measure even the model's pick and the scenario's setting once is refused, with
    a budget that would, instead of a report of a search that did not happen."""
    sets = [f"framework={framework}", *data_overrides("ocr", ocr_lmdb, image_h5)]
    out = tmp_path / "tune"
    result = run_tune("ocr", sets, 1, out)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert "--budget-s: 1 s leaves" in line and "Give --budget-s " in line
    suggested = int(line.split("Give --budget-s ")[1].split()[0])
    assert suggested > 1 and not (out / "tuned.yaml").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--step-ms", "-1"], "--step-ms must be > 0"),
        (["--set", "loader.num_wokers=2"], "num_workers"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "train.tune", "--config", "configs/ocr/smoke.yaml", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
