"""Checkpoints that fail: a truncated newest checkpoint on --resume falls back to the one before
it (exit 4 only when none is usable), and a save that runs out of disk (a small tmpfs) removes
its partial files, leaves the previous checkpoints usable and exits 4 naming the full disk.
Real `python -m train` processes, both frameworks."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import uuid

import pytest

from tests.test_train import ROOT, train_cmd

PAIRS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("ocr", "torch", marks=pytest.mark.torch),
]
EVERY_2 = ["train.checkpoint_every=2", "train.eval_every=100", "train.keep_last=5"]


def run(task, framework, run_dir, fixtures, steps, *flags):
    cmd = train_cmd(task, framework, run_dir, [f"train.max_steps={steps}", *EVERY_2], *fixtures)
    return subprocess.run([*cmd, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)


def steps_of(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def six_step_run(tmp_path_factory, ocr_lmdb, image_h5):
    """finished(task, framework): the directory of a 6-step run with checkpoints of steps 2, 4
    and 6, trained once per module for both tests: the truncation test damages a copy of it,
    the disk-full test sizes its tmpfs from its checkpoint of step 2."""

    @functools.cache
    def finished(task, framework):
        run_dir = tmp_path_factory.mktemp("six") / "run"
        first = run(task, framework, run_dir, (ocr_lmdb, image_h5), 6)
        assert first.returncode == 0, first.stderr[-3000:]
        return run_dir

    return finished


@pytest.mark.parametrize("task, framework", PAIRS)
def test_truncated_newest_checkpoint_resumes_from_the_one_before(
    task, framework, tmp_path, ocr_lmdb, image_h5, six_step_run
):
    """Every file of the newest checkpoint cut to 100 bytes: the resume falls back to the one
    before, where a plain load would die of json.decoder.JSONDecodeError (exit 1)."""
    run_dir, fixtures = tmp_path / "run", (ocr_lmdb, image_h5)
    shutil.copytree(six_step_run(task, framework), run_dir)
    newest = run_dir / "checkpoints" / "step-00000006"
    for file in newest.iterdir():
        os.truncate(file, 100)

    resumed = run(task, framework, run_dir, fixtures, 8, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000006 is unusable" in resumed.stderr, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step-00000004 (epoch 0, step 4)" in resumed.stderr

    # Only the model's weights damaged, trainer.json intact: the manifest finds it.
    weights = [f for f in newest.iterdir() if f.name.startswith("model")]
    for step in ("step-00000008", "step-00000006", "step-00000004", "step-00000002"):
        for file in (run_dir / "checkpoints" / step).iterdir():
            if file.name.startswith("model"):
                with open(file, "r+b") as f:  # same size, one byte changed
                    f.seek(file.stat().st_size // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
    assert weights
    none_left = run(task, framework, run_dir, fixtures, 10, "--resume")
    assert none_left.returncode == 4, none_left.stderr[-3000:]
    assert "error: --resume: no usable checkpoint in" in none_left.stderr
    assert "is damaged (CRC-32 differs" in none_left.stderr
    assert "Traceback" not in none_left.stderr


@contextlib.contextmanager
def small_tmpfs(path, size_bytes: int):
    """A tmpfs of ``size_bytes`` at ``path`` (needs root with CAP_SYS_ADMIN, as in this
    project's dev and CI containers when run privileged; skipped otherwise)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", f"tmpfs-{uuid.uuid4().hex[:8]}", path],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("task, framework", PAIRS)
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(
    task, framework, tmp_path, ocr_lmdb, image_h5, six_step_run
):
    fixtures = (ocr_lmdb, image_h5)
    sized = six_step_run(task, framework) / "checkpoints/step-00000002"
    one = sum(f.stat().st_size for f in sized.iterdir())
    # Room for two checkpoints and the logs, not for a third.
    with small_tmpfs(tmp_path / "small", int(2.5 * one) + (1 << 20)) as disk:
        run_dir = disk / "run"
        full = run(task, framework, run_dir, fixtures, 8)
        assert full.returncode == 4, full.stderr[-3000:]
        assert "error: disk full: the checkpoint of step 6 does not fit in" in full.stderr
        assert "Traceback" not in full.stderr
        assert steps_of(run_dir) == ["latest", "step-00000002", "step-00000004"]  # no .partial
        assert (run_dir / "checkpoints/latest").read_text().strip() == "step-00000004"
        shutil.copytree(run_dir, tmp_path / "copy")
    resumed = run(task, framework, tmp_path / "copy", fixtures, 6, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000004 (epoch 0, step 4)" in resumed.stderr
    assert "unusable" not in resumed.stderr


def test_a_worker_exit_during_a_save_is_raised_after_it_as_a_dead_worker():
    """The mechanism under the killworker test, with a stand-in for the frameworks' SIGCHLD
    handler (both raise from it when a worker they started is gone): held during the save,
    run once after it, put back; a save without a child exit raises nothing."""
    import signal

    from train.checkpoint import worker_exits_after_save
    from train.errors import WorkerDiedError

    calls = []

    def frameworks_check(signum, frame):
        calls.append(signum)
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")

    previous = signal.signal(signal.SIGCHLD, frameworks_check)
    try:
        with worker_exits_after_save(6):
            pass
        assert calls == []
        with pytest.raises(WorkerDiedError) as raised, worker_exits_after_save(8):
            subprocess.run(["true"])  # its exit is a SIGCHLD, mid-"save"
            assert calls == []  # not run inside the save
        assert calls == [signal.SIGCHLD]
        assert "during the checkpoint of step 8, which is complete" in str(raised.value)
        assert "(pid 4242) is killed by signal" in str(raised.value)
        assert raised.value.exit_code == 6
        assert signal.getsignal(signal.SIGCHLD) is frameworks_check
    finally:
        signal.signal(signal.SIGCHLD, previous)
