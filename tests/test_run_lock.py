"""One run per output directory (train/run_lock.py): a second run on a locked directory fails at
once naming the holder; the lock is released however the holder ends (kill -9 included), and a
kill -9 of a run with data.cache: memory leaves a /dev/shm file, and bad-sample and in-flight state
files in the temp directory, that the next start removes."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from datasets import owner_lock
from tests.test_resume import wait_for_step
from tests.test_train import ROOT, set_args, train_cmd
from train.errors import OutputDirLockedError
from train.run_lock import RunLock

HOLD = "import sys, time; from train.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
HOLD += "print('held', flush=True); time.sleep(300)"


def test_lock_names_its_holder_and_is_free_once_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirLockedError) as raised:
            RunLock(tmp_path).acquire()
        message = str(raised.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "HINT" in message and "--output-dir" in message
        assert raised.value.exit_code == 10
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs in the holder
        holder.wait()
    lock = RunLock(tmp_path).acquire()  # stale: the kernel dropped the dead holder's lock
    lock.release()
    RunLock(tmp_path).acquire().release()


PAIRS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("resnet50", "torch", marks=pytest.mark.torch),
]
LONG = ["train.max_steps=400", "train.checkpoint_every=100000", "train.eval_every=100000"]


@pytest.mark.parametrize("task, framework", PAIRS)
def test_second_run_on_a_locked_directory_fails_and_a_killed_run_blocks_nothing(
    task, framework, tmp_path, ocr_lmdb, image_h5
):
    run_dir = tmp_path / "run"
    cmd = train_cmd(task, framework, run_dir, [*LONG, "data.cache=memory"], ocr_lmdb, image_h5)
    first = subprocess.Popen(
        [*cmd, "--auto-resume"], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    try:
        wait_for_step(run_dir, first, 2)
        cache_files = glob.glob(f"/dev/shm/data-cache-{first.pid}-*")
        assert cache_files, "the memory cache is not in /dev/shm"
        temp = tempfile.gettempdir()
        state_files = [
            *glob.glob(f"{temp}/bad-samples-{first.pid}-*.state"),
            *glob.glob(f"{temp}/in-flight-{first.pid}-*.state"),
        ]
        assert len(state_files) >= 2, "no bad-sample counters or in-flight table in the temp dir"

        second = subprocess.run(
            [*cmd, "--auto-resume"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 10, second.stderr[-3000:]
        assert f"is in use by another run (pid {first.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the holder was left alone
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert all(os.path.exists(f) for f in cache_files + state_files)  # kill -9: no cleanup
    # The killed trainer's workers die of PR_SET_PDEATHSIG a moment after it, and until the last
    # of them has closed the files they hold their owner's mark: a start in that moment rightly
    # keeps them. A restart comes after the old run is gone: wait for that (seen: < 1 s).
    deadline = time.monotonic() + 30
    while any(owner_lock.held(f) for f in cache_files + state_files):
        assert time.monotonic() < deadline, "the killed run's workers still hold its files"
        time.sleep(0.1)

    third = subprocess.run(
        [*cmd, "--auto-resume", *set_args(["train.max_steps=3"])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert third.returncode == 0, third.stderr[-3000:]
    # Removed by this start's sweep, or by another trainer's starting on this host meanwhile
    # (the sweep is host-wide: /dev/shm is shared, e.g. by parallel test runs).
    assert not any(os.path.exists(f) for f in cache_files + state_files)
