"""A loader worker that dies (segfault, OOM-style SIGKILL, os._exit) or hangs gives an error that
names the worker and the sample it was on, within a timeout, never a hang; both frameworks."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.test_train import ROOT, train_cmd

PAIRS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("resnet50", "torch", marks=pytest.mark.torch),
]


def run_with_fault(task, framework, tmp_path, fixtures, fault, *extra):
    ocr_lmdb, image_h5 = fixtures
    cmd = train_cmd(
        task,
        framework,
        tmp_path / "run",
        ["loader.timeout_s=10", *extra],
        ocr_lmdb=ocr_lmdb,
        image_h5=image_h5,
    )
    env = dict(os.environ, DATA_INJECT_FAULT=fault)
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return result, time.monotonic() - start


# The two ways a worker ends mid-sample: a signal (segv: a broken decoder; the OOM killer's
# SIGKILL reaches the same dead-pid path, and tests/test_failure_kinds.py kills workers with it
# mid-checkpoint and while idle) and an exit of its own (os._exit(1)).
@pytest.mark.parametrize("task, framework", PAIRS)
@pytest.mark.parametrize("kind", ["segv", "exit"])
def test_dead_worker_is_named_with_its_sample(task, framework, kind, tmp_path, ocr_lmdb, image_h5):
    result, seconds = run_with_fault(task, framework, tmp_path, (ocr_lmdb, image_h5), f"{kind}@5")
    assert result.returncode == 6, result.stderr[-3000:]
    assert "died while reading sample #5 (key" in result.stderr, result.stderr[-3000:]
    assert "error: data loader failed" in result.stderr and "HINT" in result.stderr
    assert seconds < 120


@pytest.mark.parametrize("task, framework", PAIRS)
def test_hung_worker_times_out_naming_its_sample(task, framework, tmp_path, ocr_lmdb, image_h5):
    # The hang is found when loader.timeout_s runs out: 5 s here, where a batch of the fixtures'
    # small images is read in milliseconds, so no healthy batch comes near it.
    fixtures = (ocr_lmdb, image_h5)
    result, seconds = run_with_fault(
        task, framework, tmp_path, fixtures, "hang@5", "loader.timeout_s=5"
    )
    assert result.returncode == 6, result.stderr[-3000:]
    assert "on sample #5 (key" in result.stderr and "running for" in result.stderr
    assert seconds < 120
