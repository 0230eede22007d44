"""Each kind of failure ends `python -m train` with its own exit code and message (train/errors.py),
never as "a loader worker died" unless one did: an exception in a sample's code, an out-of-memory
in a step, a NaN loss (train.nonfinite: abort | skip). Real processes, both frameworks; the
faults come in through the injection seams (datasets/faults.py in loader workers,
train/faults.py in the trainer), which no production config sets."""

from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest

from datasets.sampler import EpochSampler
from tests.test_resume import final_weights, wait_for_step
from tests.test_train import LOST_WORKER, ROOT, train_cmd

PAIRS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("resnet50", "torch", marks=pytest.mark.torch),
]
SHORT = ["train.max_steps=6", "train.checkpoint_every=2", "train.eval_every=100"]
# For runs that end before their last step and assert nothing of a checkpoint (a ResNet one is
# 134 MB, written and fsync'd).
NO_CHECKPOINTS = ["train.checkpoint_every=100"]


def run(task, framework, run_dir, fixtures, env, extra=(), flags=()):
    cmd = [*train_cmd(task, framework, run_dir, [*SHORT, *extra], *fixtures), *flags]
    env = {**os.environ, **env}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def checkpoint_steps(run_dir) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("task, framework", PAIRS)
def test_exception_in_a_sample_is_not_a_dead_worker(task, framework, tmp_path, ocr_lmdb, image_h5):
    """Before: exit 6, "worker ... running for 0s on sample" naming whichever samples the
    workers happened to be on."""
    result = run(
        task, framework, tmp_path / "run", (ocr_lmdb, image_h5), {"DATA_INJECT_FAULT": "raise@5"}
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "raised on sample #5 (key" in result.stderr, result.stderr[-3000:]
    assert "a bug, not a dead worker" in result.stderr, result.stderr[-3000:]
    assert LOST_WORKER.search(result.stderr) is None, result.stderr[-3000:]
    assert "running for" not in result.stderr, result.stderr[-3000:]
    assert "Traceback" in result.stderr  # a bug: its traceback is what fixes it


@pytest.mark.parametrize("fault", ["oom", "alloc"])
@pytest.mark.parametrize("task, framework", PAIRS)
def test_out_of_memory_in_a_step_is_its_own_exit_code(
    task, framework, fault, tmp_path, ocr_lmdb, image_h5
):
    """oom: the framework's out-of-memory exception raised in place of step 3; alloc: a real
    allocation the framework's allocator refuses (256 TiB on the run's device: on the CPU
    torch reports it as a RuntimeError of its DefaultCPUAllocator, Paddle as MemoryError)."""
    env = {"TRAIN_INJECT_FAULT": f"{fault}@3"}
    result = run(task, framework, tmp_path / "run", (ocr_lmdb, image_h5), env, NO_CHECKPOINTS)
    assert result.returncode == 9, result.stderr[-3000:]
    assert "error: out of memory in a train step" in result.stderr
    if fault == "alloc":
        assert "281474976710656" in result.stderr, result.stderr[-3000:]  # the bytes asked for
    for fix in ("lower loader.batch_size", "train.amp", "smaller model.name", "nvidia-smi"):
        assert fix in result.stderr, result.stderr[-3000:]
    assert "worker" not in result.stderr.split("error: out of memory")[1]
    assert "Traceback" not in result.stderr


def assert_finite(run_dir, framework, step):
    weights = final_weights(run_dir, framework, step)
    assert weights and all(np.isfinite(w).all() for w in weights.values() if w.dtype.kind == "f")


@pytest.mark.parametrize("task, framework", PAIRS)
def test_nan_loss_aborts_naming_step_and_batch(task, framework, tmp_path, ocr_lmdb, image_h5):
    run_dir = tmp_path / "run"
    result = run(task, framework, run_dir, (ocr_lmdb, image_h5), {"TRAIN_INJECT_FAULT": "nan@3"})
    assert result.returncode == 8, result.stderr[-3000:]
    problem = "error: the loss or its gradients were not finite (loss "
    assert problem in result.stderr, result.stderr[-3000:]
    where = result.stderr.split(problem)[1]
    # The third batch of 8 in epoch 0's order, by sample index (the smoke configs' seed 0).
    size = 96 if task == "ocr" else 24
    batch = EpochSampler(size, seed=0).positions()[16:24].tolist()
    assert f") at step 3 (epoch 0, this rank's batch of samples {batch})" in where, where
    assert checkpoint_steps(run_dir) == [2]  # nothing saved after the NaN
    assert_finite(run_dir, framework, 2)


@pytest.mark.parametrize("task, framework", PAIRS)
def test_nan_losses_skipped_until_too_many_in_a_row(task, framework, tmp_path, ocr_lmdb, image_h5):
    """train.nonfinite=skip with train.nonfinite_max_skips=2: steps 3 and 4 are skipped (two in
    a row), the good step 5 resets the count, 6 and 7 are skipped again and the third in a row,
    step 8, aborts. The checkpoint of step 6, a skipped step, holds finite weights."""
    run_dir = tmp_path / "run"
    env = {"TRAIN_INJECT_FAULT": "nan@3,nan@4,nan@6,nan@7,nan@8"}
    extra = ["train.max_steps=8", "train.nonfinite=skip", "train.nonfinite_max_skips=2"]
    result = run(task, framework, run_dir, (ocr_lmdb, image_h5), env, extra)
    assert result.returncode == 8, result.stderr[-3000:]
    assert result.stderr.count("non-finite loss or gradients at step") == 4, result.stderr[-3000:]
    assert result.stderr.count("update skipped (2 in a row") == 2, result.stderr[-3000:]
    assert (
        "error: 3 steps in a row with a non-finite loss or gradients, the last at step 8"
        in result.stderr
    ), result.stderr[-3000:]
    assert checkpoint_steps(run_dir) == [2, 4, 6]  # nothing saved after the abort
    assert_finite(run_dir, framework, 6)


@pytest.mark.torch
def test_batch_larger_than_the_dataset_is_a_data_error(tmp_path, ocr_lmdb, image_h5):
    """docs/reliability.md cited this before any test had it."""
    result = run(
        "resnet50", "torch", tmp_path / "run", (ocr_lmdb, image_h5), {}, ["loader.batch_size=32"]
    )
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "loader.batch_size 32 is larger than this rank's 24 samples" in errors[0]
    assert "HINT: lower loader.batch_size" in errors[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("task, framework", PAIRS)
def test_native_crash_prints_every_threads_python_stack(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    """A crash in native code (here SIGABRT, which glibc sends itself on a corrupted heap) used
    to end the trainer with nothing after its last log line; faulthandler, armed again after
    Paddle's import replaced it, now prints where each thread was. The process still dies of
    the signal, within the test's 120 s."""
    run_dir = tmp_path / "crashed"
    extra = ["train.max_steps=200", "train.log_every=1"]
    cmd = train_cmd(task, framework, run_dir, extra, ocr_lmdb, image_h5)
    process = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(run_dir, process, 2)
    process.send_signal(signal.SIGABRT)
    _, stderr = process.communicate(timeout=120)
    # SIGABRT's default action ends the process after faulthandler's report: Paddle's own
    # handler, which printed nothing for it and could hang or die of glibc's loader assertion
    # (exit 127) where the abort landed in the dynamic loader, is no longer called for it.
    assert process.returncode == -signal.SIGABRT, stderr[-3000:]
    assert "Fatal Python error: Aborted" in stderr, stderr[-3000:]
    assert "train/loop.py" in stderr and "in train_epoch" in stderr, stderr[-3000:]


@pytest.mark.paddle
def test_a_segfault_in_a_paddle_trainer_prints_the_python_stacks_and_dies_of_it(tmp_path, ocr_lmdb):
    """SIGSEGV to a Paddle trainer at step 2: faulthandler prints every thread's Python stack on
    stderr and the process dies of the signal at once. Paddle's own crash handler, which its
    import installs, never runs: called from a crash it printed nothing, died of glibc's loader
    assertion or hung, which left the process alive past this test's two minutes."""
    run_dir = tmp_path / "crashed"
    extra = ["train.max_steps=200", "train.log_every=1"]
    cmd = train_cmd("ocr", "paddle", run_dir, extra, ocr_lmdb=ocr_lmdb)
    process = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(run_dir, process, 2)
    process.send_signal(signal.SIGSEGV)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGSEGV, stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in stderr, stderr[-3000:]
    assert "train/loop.py" in stderr and "in train_epoch" in stderr, stderr[-3000:]
    assert "C++ Traceback" not in stdout + stderr, stdout[-3000:]


def test_native_crash_report_does_not_need_a_real_stderr(monkeypatch):
    """main() called where stderr is a stream without a file descriptor (a notebook's) starts
    without the report instead of failing."""
    import io

    from train.cli import report_native_crashes

    monkeypatch.setattr("sys.stderr", io.StringIO())
    report_native_crashes()
    monkeypatch.setattr("sys.stderr", None)
    report_native_crashes()


@pytest.mark.parametrize("task, framework", PAIRS)
def test_worker_killed_during_a_checkpoint_is_a_dead_worker_and_the_checkpoint_stands(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    """A worker killed in the middle of the run's first checkpoint (step 2): the run ends as a
    dead worker (exit 6), not as "checkpoint write failed" (exit 4), which would also have
    removed the step's complete checkpoint; --resume starts from it."""
    run_dir = tmp_path / "run"
    workers = ["loader.num_workers=2", "loader.persistent_workers=true"]
    env = {"TRAIN_INJECT_FAULT": "killworker@2"}
    result = run(task, framework, run_dir, (ocr_lmdb, image_h5), env, workers)
    assert result.returncode == 6, result.stderr[-3000:]
    assert "died during the checkpoint of step 2, which is complete" in result.stderr
    assert LOST_WORKER.search(result.stderr)  # the framework's words: its pid and signal 9
    assert "checkpoint write failed" not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert checkpoint_steps(run_dir) == [2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    resumed = run(
        task,
        framework,
        run_dir,
        (ocr_lmdb, image_h5),
        {},
        [*workers, "train.max_steps=3"],
        ["--resume"],
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step-00000002" in resumed.stderr
    assert checkpoint_steps(run_dir) == [2, 3]  # and went on to its last step


@pytest.mark.parametrize("task, framework", PAIRS)
def test_worker_killed_while_idle_is_a_dead_worker(task, framework, tmp_path, ocr_lmdb, image_h5):
    """A worker killed between samples (its prefetch done, waiting for the next index): no
    sample is in flight, so no record is named. Before: no culprit, and the framework's
    RuntimeError ended the run with its traceback (exit 1)."""
    workers = ["loader.num_workers=2", "loader.persistent_workers=true", *NO_CHECKPOINTS]
    env = {"TRAIN_INJECT_FAULT": "killidle@3"}
    result = run(task, framework, tmp_path / "run", (ocr_lmdb, image_h5), env, workers)
    assert result.returncode == 6, result.stderr[-3000:]
    assert "died while it held no sample" in result.stderr, result.stderr[-3000:]
    assert LOST_WORKER.search(result.stderr)  # the framework's words: its pid and signal 9
    assert "while reading sample" not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("task, framework", PAIRS)
def test_worker_killed_during_a_stops_checkpoint_leaves_the_stop_a_stop(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    """SIGTERM once step 2 is in the metrics; the stop's checkpoint (the only one: no periodic
    ones) is of step 2 (the signal landed before the loop's stop check after step 2), 3, 4 or 5,
    each of which kills a worker mid-save. The death is logged, the checkpoint stays and the
    exit is still the stop's 143."""
    run_dir = tmp_path / "run"
    extra = [
        "train.max_steps=200",
        "train.log_every=1",
        "train.checkpoint_every=100000",
        "train.eval_every=100000",
        "loader.num_workers=2",
        "loader.persistent_workers=true",
    ]
    kills = ",".join(f"killworker@{step}" for step in (2, 3, 4, 5))
    env = {**os.environ, "TRAIN_INJECT_FAULT": kills}
    cmd = train_cmd(task, framework, run_dir, extra, ocr_lmdb, image_h5)
    process = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    wait_for_step(run_dir, process, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-3000:]
    [step] = checkpoint_steps(run_dir)
    assert step in (2, 3, 4, 5), stderr[-3000:]
    assert f"died during the checkpoint of step {step}, which is complete" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
