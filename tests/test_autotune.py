"""loader.autotune: the climb's decisions from measured windows (pure), and training runs that
tune their loader while they train, in both frameworks: the changes logged and recorded, the
tuned.yaml a config, the run the same bit for bit as one at a fixed setting, and a resume across
a change that starts where the tuning had got to."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_resume import final_weights, wait_for_step
from tests.test_train import ROOT, train_cmd
from train.autotune import DRIFT_WINDOWS, Climb, Setting, Window
from train.config.load import load_config

BATCH = 64


def window(setting: Setting, samples_per_s: float, wait_fraction: float, steps: int = 20):
    wall = steps * BATCH / samples_per_s
    return Window(setting, steps, steps * BATCH, wall, wait_fraction * wall)


def climb(start: Setting | None = None, cores=2, fits=None) -> Climb:
    start = start or Setting(0, 2)
    return Climb(start, cores=cores, keeps_up_wait=0.05, min_gain=0.05, stall_wait=0.3, fits=fits)


def test_a_loader_that_keeps_up_stays_as_it_is():
    tuner = climb(Setting(2, 2))
    following, why = tuner.observe(window(Setting(2, 2), 1000, 0.01))
    assert following is None and tuner.settled
    assert "keeps up" in why


def test_from_no_workers_it_jumps_to_the_workers_that_keep_up_at_most_a_core_each():
    # A step of 100 ms of which the trainer spent 60 ms loading the batch: a worker makes a
    # batch while 1.5 steps (40 ms each) run, so 2 workers keep up.
    tuner = climb(cores=4)
    following, _ = tuner.observe(window(Setting(0, 2), BATCH / 0.1, 0.6))
    assert following == Setting(2, 2)
    # Loading 20 times the step: capped at a worker per core.
    tuner = climb(cores=4)
    following, _ = tuner.observe(window(Setting(0, 2), 100, 0.95))
    assert following == Setting(4, 2)


def test_the_jump_from_no_workers_keeps_the_scenarios_cache():
    tuner = climb(Setting(0, 2, "disk"))
    following, _ = tuner.observe(window(Setting(0, 2, "disk"), 100, 0.6))
    assert following == Setting(2, 2, "disk")


def test_workers_are_added_while_each_beats_the_last_by_the_margin_then_prefetch_is_tried():
    tuner = climb()
    assert tuner.observe(window(Setting(0, 2), 100, 0.6))[0] == Setting(2, 2)
    assert tuner.observe(window(Setting(2, 2), 200, 0.4))[0] == Setting(3, 2)
    # 3 workers: 3% faster, within the margin: back to 2, and a deeper prefetch is tried.
    following, why = tuner.observe(window(Setting(3, 2), 206, 0.3))
    assert following == Setting(2, 4) and "not faster" in why
    # The deeper prefetch loses too: back to the best, settled.
    following, why = tuner.observe(window(Setting(2, 4), 201, 0.3))
    assert following == Setting(2, 2) and tuner.settled
    assert "settled on num_workers=2 prefetch_factor=2" in why


def test_when_one_more_worker_does_not_help_one_fewer_that_is_as_fast_is_kept():
    tuner = climb(Setting(3, 2))
    assert tuner.observe(window(Setting(3, 2), 300, 0.3))[0] == Setting(4, 2)
    assert tuner.observe(window(Setting(4, 2), 305, 0.3))[0] == Setting(2, 2)
    # As fast (within the margin) with a worker fewer: kept, and one fewer again is tried.
    assert tuner.observe(window(Setting(2, 2), 290, 0.3))[0] == Setting(1, 2)
    following, _ = tuner.observe(window(Setting(1, 2), 150, 0.6))
    assert following == Setting(2, 4)  # 1 worker is slower: the prefetch from 2 workers
    assert tuner.incumbent == Setting(2, 2)


def test_a_setting_that_does_not_fit_dev_shm_is_never_tried():
    tuner = climb(Setting(2, 2), fits=lambda s: s.workers <= 2 and s.prefetch <= 2)
    following, why = tuner.observe(window(Setting(2, 2), 300, 0.3))
    assert following is None and tuner.settled, why


def test_settled_it_climbs_again_when_the_data_slows_down():
    tuner = climb(Setting(2, 2))
    tuner.observe(window(Setting(2, 2), 300, 0.01))
    assert tuner.settled
    for _ in range(DRIFT_WINDOWS - 1):
        assert tuner.observe(window(Setting(2, 2), 150, 0.5)) == (None, "")
    following, why = tuner.observe(window(Setting(2, 2), 150, 0.5))
    assert following == Setting(3, 2) and "windows in a row" in why


def test_a_loader_still_waiting_after_workers_and_prefetch_tries_a_memory_cache():
    tuner = climb(Setting(2, 2))
    tuner.try_cache = True
    assert tuner.observe(window(Setting(2, 2), 300, 0.4))[0] == Setting(3, 2)
    assert tuner.observe(window(Setting(3, 2), 301, 0.4))[0] == Setting(1, 2)
    assert tuner.observe(window(Setting(1, 2), 150, 0.6))[0] == Setting(2, 4)
    following, _ = tuner.observe(window(Setting(2, 4), 302, 0.4))
    assert following == Setting(2, 2, "memory")
    # With reads from memory, a worker fewer while that is as fast, down to none; then the
    # best of them is judged against the best without the cache.
    assert tuner.observe(window(Setting(2, 2, "memory"), 600, 0.01))[0] == Setting(1, 2, "memory")
    assert tuner.observe(window(Setting(1, 2, "memory"), 590, 0.01))[0] == Setting(0, 2, "memory")
    following, why = tuner.observe(window(Setting(0, 2, "memory"), 400, 0.3))
    assert following == Setting(1, 2, "memory") and tuner.settled and "the cache pays" in why
    # A cache that does not pay is removed again.
    tuner = climb(Setting(2, 4))
    tuner.try_cache = True
    tuner.phase, tuner.incumbent = "prefetch", Setting(2, 2)
    tuner.rates[Setting(2, 2)] = [300]
    assert tuner.observe(window(Setting(2, 4), 290, 0.4))[0] == Setting(2, 2, "memory")
    # Judged at its best worker count: 2 (1 is slower), 2% faster than without it.
    assert tuner.observe(window(Setting(2, 2, "memory"), 306, 0.4))[0] == Setting(1, 2, "memory")
    following, why = tuner.observe(window(Setting(1, 2, "memory"), 150, 0.6))
    assert following == Setting(2, 2) and tuner.settled and "does not pay" in why


def test_no_cache_is_tried_when_the_scenario_sets_data_cache_itself():
    tuner = climb(Setting(2, 4))  # try_cache off: the scenario sets data.cache itself
    tuner.phase, tuner.incumbent = "prefetch", Setting(2, 2)
    tuner.rates[Setting(2, 2)] = [300]
    following, _ = tuner.observe(window(Setting(2, 4), 290, 0.4))
    assert following == Setting(2, 2) and tuner.settled


def test_the_climb_never_passes_twice_the_cores():
    tuner = climb(Setting(4, 2), cores=2)
    following, _ = tuner.observe(window(Setting(4, 2), 300, 0.3))
    assert following == Setting(4, 4)  # no fifth worker on 2 cores: the prefetch instead


# ---------------------------------------------------------------- training runs
FRAMEWORKS = [
    pytest.param("paddle", marks=pytest.mark.paddle),
    pytest.param("torch", marks=pytest.mark.torch),
]
STEPS = 36  # 3 epochs of the 96-line fixture at batch 8
LONG_STEPS = 84  # 7 epochs: the climb, an epoch that fills a cache, one that measures it
SETTINGS = [
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.checkpoint_every=4",
    "train.keep_last=30",  # every checkpoint of a LONG_STEPS run
    # A learning rate that does not depend on the run's length: a shorter run's weights are
    # then the fixed run's checkpoint at its last step.
    "optim.schedule=constant",
    "loader.timeout_s=60",
]
AUTOTUNE = ["loader.autotune.enabled=true", "loader.autotune.window_steps=2"]
# Reads that wait on storage (below the record cache), slow enough that loading a batch takes
# longer than a one-core step: at 0 workers torch's trainer reads each batch between steps,
# Paddle's in a background thread while the step runs (so only reads slower than the step make
# it wait: 80 ms a record is 640 ms a batch of 8, twice a Paddle step on a core that the other
# half of the suite also uses). Workers overlap the waits.
SLOW_STORAGE = {
    "torch": {"DATA_INJECT_FAULT": "latency@5"},
    "paddle": {"DATA_INJECT_FAULT": "latency@80"},
}
# Reads that 2 workers (the most on one core) cannot hide; a memory cache can.
SLOWER_STORAGE = {
    "torch": {"DATA_INJECT_FAULT": "latency@30"},
    "paddle": {"DATA_INJECT_FAULT": "latency@80"},
}


def one_core_run(framework, out, ocr_lmdb, extra, env=None, flags=()):
    """The OCR smoke run on one core (taskset): the trainer's CPU threads are then one at
    every worker count (torch gives its step the cores the workers leave), so runs at different
    loader settings may be compared bit for bit."""
    cmd = ["taskset", "-c", "0", *train_cmd("ocr", framework, out, [*SETTINGS, *extra], ocr_lmdb)]
    return cmd + list(flags), {**os.environ, **(env or {})}


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory, ocr_lmdb):
    """``fixed_run(framework)``: a LONG_STEPS run at one worker, no tuning, trained on first
    use; its checkpoints are what every tuned run must equal, bit for bit, at the same step."""

    @functools.cache
    def train(framework: str) -> Path:
        out = tmp_path_factory.mktemp(f"fixed-{framework}") / "run"
        extra = ["loader.num_workers=1", f"train.max_steps={LONG_STEPS}"]
        cmd, env = one_core_run(framework, out, ocr_lmdb, extra)
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return out

    return train


def assert_trained_as_fixed(run: Path, fixed: Path, framework: str, step: int) -> None:
    a, b = final_weights(fixed, framework, step), final_weights(run, framework, step)
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_from_no_workers_tunes_its_loader_and_trains_as_a_fixed_setting_does(
    framework, tmp_path, ocr_lmdb, fixed_run
):
    out = tmp_path / "tuned"
    cmd, env = one_core_run(
        framework, out, ocr_lmdb, ["loader.num_workers=0", *AUTOTUNE], SLOW_STORAGE[framework]
    )
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    changes = re.findall(r"loader autotune: .*trying (num_workers=\d+[^;\n]*)", result.stderr)
    assert changes and changes[0].startswith("num_workers=1"), result.stderr[-3000:]
    state = json.loads((out / "autotune.json").read_text())
    assert state["changes"][0]["from"]["num_workers"] == 0
    assert state["changes"][0]["data_wait_fraction"] > 0.05
    summary = json.loads((out / "summary.json").read_text())
    assert summary["autotune_changes"] == len(state["changes"])
    assert summary["autotune_start_samples_per_s"] > 0
    # The loader's setting changed mid-epoch; the batches, and so the weights, did not.
    assert_trained_as_fixed(out, fixed_run(framework), framework, STEPS)
    if state["settled"]:  # tuned.yaml: the scenario and the settings chosen, a valid config
        tuned = load_config(out / "tuned.yaml")
        assert tuned.loader.num_workers == state["setting"]["num_workers"]
        assert tuned.data.train == str(ocr_lmdb)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_reads_slower_than_the_workers_can_overlap_get_a_memory_cache_at_an_epoch_start(
    framework, tmp_path, ocr_lmdb, fixed_run
):
    """One core, so at most 2 workers; reads below the record cache that they cannot hide, a
    memory cache can. It is attached at an epoch's start, that epoch fills it,
    the next is measured; the weights are still those of a run at a fixed setting."""
    length = [f"train.max_steps={LONG_STEPS}", "loader.autotune.window_steps=3"]
    out = tmp_path / "tuned"
    cmd, env = one_core_run(
        framework,
        out,
        ocr_lmdb,
        ["loader.num_workers=0", "data.cache=none", *AUTOTUNE, *length],
        SLOWER_STORAGE[framework],
    )
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(
        r"trying num_workers=\d+ prefetch_factor=\d cache=memory", result.stderr
    ), result.stderr[-3000:]
    attached = re.search(r"loader autotune: epoch (\d+) runs at .*cache=memory", result.stderr)
    assert attached, result.stderr[-3000:]
    # Judged against the best setting without it, and the judgement recorded. Which way it
    # goes depends on a few short windows of a loaded host (the judging itself is the unit
    # tests' above): whichever it is, tuned.yaml says it (each judgement settles the climb, and
    # a later climb keeps the cache it judged).
    state = json.loads((out / "autotune.json").read_text())
    judged = [c for c in state["changes"] if re.search("the cache (does not )?pay", c["why"])]
    assert judged, state
    tuned = load_config(out / "tuned.yaml")  # written when it settled on the judgement
    assert tuned.data.cache == judged[-1]["to"]["cache"]
    assert_trained_as_fixed(out, fixed_run(framework), framework, LONG_STEPS)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_stopped_after_a_change_resumes_at_that_setting_and_ends_as_uninterrupted(
    framework, tmp_path, ocr_lmdb, fixed_run
):
    out = tmp_path / "run"
    cmd, env = one_core_run(
        framework, out, ocr_lmdb, ["loader.num_workers=0", *AUTOTUNE], SLOW_STORAGE[framework]
    )
    process = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    state_file = out / "autotune.json"
    wait_for_step(out, process, 1)
    deadline = time.monotonic() + 300
    while not state_file.exists():  # the first change
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no loader change in 300 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, process.stderr.read()[-3000:]
    setting = json.loads(state_file.read_text())["setting"]
    assert setting["num_workers"] >= 1
    resumed = subprocess.run(
        [*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loader autotune: resuming at num_workers={setting['num_workers']}" in resumed.stderr
    assert_trained_as_fixed(out, fixed_run(framework), framework, STEPS)
