"""python -m train.tune --local-ranks N: every measured run runs the node's N loaders at once, the
tuner's own (rank 0) and N - 1 companion processes (train/tune/companions.py). A companion takes
batches within rank 0's window, leaves no process nor /dev/shm file behind, and its failure (bad
data, a worker that dies, a companion gone silent) fails the run with training's exit code
instead of hanging it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datasets.batch_ring import RING_PREFIX
from datasets.cache import MEMORY_FILE_PREFIX
from tests.test_train import ROOT, data_overrides, set_args
from tests.test_tune import EACH_FRAMEWORK
from train import errors
from train.tune import companions, model, verify

SHM = Path("/dev/shm")
STEP_S = 0.001  # the stand-in device's step, on every rank: the loaders are the limit


def session_of(leader: int) -> set[int]:
    """The live processes of the session ``leader`` started: a companion and its loader workers
    (they leave its process group, not its session). Zombies hold nothing and are left out."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, _ppid, _group, session = (
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
            )
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(session) == leader and state != "Z":
            found.add(int(entry.name))
    return found


def shm_files_of(pid: int) -> set[str]:
    """The batch rings and memory caches in /dev/shm that process ``pid`` made."""
    prefixes = (f"{RING_PREFIX}{pid}_", f"{MEMORY_FILE_PREFIX}{pid}-")
    return {name for name in os.listdir(SHM) if name.startswith(prefixes)}


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` and everything in its session have exited (within ``within_s``:
    a worker told to stop takes a moment to exit)."""
    deadline = time.monotonic() + within_s
    while session_of(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not session_of(pid)


def gone_but(leader: int, within_s: float = 10.0) -> bool:
    """Whether the session of ``leader`` is down to ``leader`` itself (within ``within_s``)."""
    deadline = time.monotonic() + within_s
    while session_of(leader) != {leader} and time.monotonic() < deadline:
        time.sleep(0.1)
    return session_of(leader) == {leader}


def small_config(framework: str, ocr_lmdb: Path):
    from tests.backends import make_config

    return make_config(framework, "ocr", ocr_lmdb, loader={"timeout_s": 20.0})


def measure_beside(config, candidate, others) -> verify.Measured:
    """One measured run at ``candidate`` with the companions ``others`` beside it, each rank's
    stand-in device taking STEP_S a step."""
    from tests.backends import start

    device = verify.DeviceStandIn(STEP_S)
    return verify.measure(
        config, start(config), candidate, device, 0.5, 2000.0, on_device=False, other_ranks=others
    )


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_two_ranks_run_two_loaders_at_once_and_leave_nothing_behind(framework, ocr_lmdb):
    """Rank 0's run, with a memory cache and the batch ring (both in /dev/shm), has a companion
    beside it: a process of its own that took batches within rank 0's window (a companion that
    was not running then reports none). After the run its loader's workers and files are gone;
    after the tuning, the companion too."""
    config = small_config(framework, ocr_lmdb)
    ours = shm_files_of(os.getpid())
    candidate = model.Candidate(workers=1, prefetch=2, cache="memory", ring=True)
    with companions.started(config, 2, STEP_S, step_on_cpu=False) as others:
        result = measure_beside(config, candidate, others)
        (member,) = others.members
        companion = member.process.pid
        assert companion != os.getpid() and member.process.poll() is None
        (rate,) = result.other_ranks_samples_per_s
        assert rate > 0, "the companion took no batch within rank 0's window"
        assert result.samples_per_s > 0
        # Between runs the companion waits alone: its workers stopped with its loader.
        assert gone_but(companion)
        assert not shm_files_of(companion)
    assert gone(companion), f"left running: {session_of(companion)}"
    assert member.process.returncode == 0
    # Nothing new left behind (an earlier test's ring of this process may go meanwhile).
    assert not shm_files_of(os.getpid()) - ours and not shm_files_of(companion)


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_a_companion_that_cannot_open_the_data_fails_the_run(framework, ocr_lmdb, tmp_path, capfd):
    """The companions were given a dataset path that does not exist: the first run fails as
    training fails on it (exit 3, the companion's error printed), naming the companion."""
    config = small_config(framework, ocr_lmdb)
    missing = dataclasses.replace(config.data, train=str(tmp_path / "missing"))
    candidate = model.Candidate(workers=0, prefetch=1, cache="none", ring=False)
    with companions.started(dataclasses.replace(config, data=missing), 2, STEP_S, False) as others:
        (member,) = others.members
        with pytest.raises(companions.CompanionFailed) as failed:
            measure_beside(config, candidate, others)
        assert not others.members  # a failure ends them all
    assert failed.value.code == errors.EXIT_DATA
    assert "local rank 1 of 2" in str(failed.value)
    assert str(tmp_path / "missing") in capfd.readouterr().err
    assert gone(member.process.pid)


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_a_companion_whose_worker_dies_fails_the_run_naming_the_sample(
    framework, ocr_lmdb, monkeypatch, capfd
):
    """A companion's worker exits on sample #3 (DATA_INJECT_FAULT, in the companion's
    environment only): the run fails with training's exit code for it (6), and the companion
    names the sample as training does."""
    config = small_config(framework, ocr_lmdb)
    candidate = model.Candidate(workers=1, prefetch=2, cache="none", ring=True)
    monkeypatch.setenv("DATA_INJECT_FAULT", "exit@3")
    with companions.started(config, 2, STEP_S, step_on_cpu=False) as others:
        monkeypatch.delenv("DATA_INJECT_FAULT")  # rank 0's workers read samples unharmed
        (member,) = others.members
        with pytest.raises(companions.CompanionFailed) as failed:
            measure_beside(config, candidate, others)
    assert failed.value.code == errors.EXIT_WORKER
    assert "local rank 1 of 2" in str(failed.value)
    assert "died while reading sample #3 (key" in capfd.readouterr().err
    assert gone(member.process.pid)
    assert not shm_files_of(member.process.pid)


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_a_silent_companion_is_killed_and_named_not_waited_for(framework, ocr_lmdb, monkeypatch):
    """A companion that hangs in its own process (on sample #3, read there at 0 workers, so no
    loader timeout catches it) is given READY_WAIT_S, or STOP_WAIT_S once it is going, and is
    then killed: the run fails (exit 6) in seconds."""
    monkeypatch.setattr(companions, "READY_WAIT_S", 12.0)  # its start: the framework's import
    monkeypatch.setattr(companions, "STOP_WAIT_S", 2.0)
    config = small_config(framework, ocr_lmdb)
    config = dataclasses.replace(config, loader=dataclasses.replace(config.loader, timeout_s=0.0))
    candidate = model.Candidate(workers=0, prefetch=1, cache="none", ring=False)
    monkeypatch.setenv("DATA_INJECT_FAULT", "hang@3")
    started = time.monotonic()
    with companions.started(config, 2, STEP_S, step_on_cpu=False) as others:
        monkeypatch.delenv("DATA_INJECT_FAULT")
        (member,) = others.members
        with pytest.raises(companions.CompanionFailed) as failed:
            measure_beside(config, candidate, others)
    assert time.monotonic() - started < 30
    assert failed.value.code == errors.EXIT_WORKER
    assert "within" in str(failed.value)
    assert member.process.returncode < 0  # killed
    assert gone(member.process.pid)
    assert not shm_files_of(member.process.pid)


@pytest.mark.parametrize("framework", EACH_FRAMEWORK)
def test_the_command_measures_each_setting_with_the_other_ranks_beside_it(
    framework, ocr_lmdb, image_h5, tmp_path
):
    """python -m train.tune --local-ranks 2: every measured run's log line gives the other
    rank's rate beside rank 0's, and the tuning ends as usual."""
    sets = [
        f"framework={framework}",
        "loader.batch_size=8",
        *data_overrides("ocr", ocr_lmdb, image_h5),
    ]
    out = tmp_path / "tune"
    tuned = subprocess.run(
        [sys.executable, "-m", "train.tune", "--config", "configs/ocr/smoke.yaml"]
        + set_args(sets)
        + ["--step-ms", "1", "--budget-s", "8", "--local-ranks", "2", "--output-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    runs = [line for line in tuned.stderr.splitlines() if "samples/s measured" in line]
    report = json.loads((out / "report.json").read_text())
    assert len(runs) == sum(len(row["runs"]) for row in report["measured"]) >= 3
    assert all("(the other ranks beside it: " in line for line in runs), runs
