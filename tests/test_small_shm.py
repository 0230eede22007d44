"""Docker's default 64 MB /dev/shm, reproduced with a private mount namespace: a ResNet-50 smoke
run whose batches overflow it either adapts (shm.policy adapt) and finishes, or stops at once
with a message naming /dev/shm and the fix (policy fail). Never a bus error or a hang."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest

from tests.test_train import ROOT, train_cmd

FRAMEWORKS = [
    pytest.param("paddle", marks=pytest.mark.paddle),
    pytest.param("torch", marks=pytest.mark.torch),
]
# 24 x 112 x 112 x 3 uint8 = 0.9 MB per batch; x (2 workers x prefetch 30 + 2) x 1.5 = 84 MB > 64.
# Many small batches in flight overflow /dev/shm as a few large ones would, for a quarter of
# the compute per step; adapt's prefetch_factor=1 then needs 5 MB. Two steps, an evaluation
# and a checkpoint carry the adapted run's batches through the 64 MB /dev/shm.
OVERFLOW = [
    "data.image_size=112",
    "data.eval_resize=128",
    "loader.batch_size=24",
    "loader.prefetch_factor=30",
    "train.max_steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "optim.warmup_steps=1",
]


def run_in_64mb_shm(cmd: list[str]) -> subprocess.CompletedProcess:
    inner = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec " + shlex.join(cmd)
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", inner],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(autouse=True)
def _needs_unshare():
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_policy_fail_stops_with_the_fix(framework, tmp_path, ocr_lmdb, image_h5):
    cmd = train_cmd("resnet50", framework, tmp_path / "run", OVERFLOW, image_h5=image_h5)
    result = run_in_64mb_shm(cmd)
    assert result.returncode == 5, result.stderr[-3000:]
    line = next(x for x in result.stderr.splitlines() if x.startswith("error:"))
    assert "/dev/shm too small" in line and "only 64 MiB is free" in line
    assert "shm_size: 8g" in line and "shm.policy: adapt" in line


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_policy_adapt_finishes_with_a_loud_warning(framework, tmp_path, ocr_lmdb, image_h5):
    cmd = train_cmd(
        "resnet50", framework, tmp_path / "run", [*OVERFLOW, "shm.policy=adapt"], image_h5=image_h5
    )
    result = run_in_64mb_shm(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shm.policy=adapt: continuing with prefetch_factor=1" in result.stderr
    assert "EXPECT SLOWER INPUT" in result.stderr
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_batch_files_of_dead_paddle_processes_are_removed_at_start(framework, tmp_path, image_h5):
    """/dev/shm holds 60 MB that a killed Paddle run left behind, and a batch ring slot (1 MB)
    of a killed trainer. Without the sweep this run would stop with exit 5: the free space
    before it (1 MiB) is below the run's need (8 MiB at the default prefetch). The doctor, run
    first, counts the two files as free and says so. A young Paddle file and one of a live
    process stay."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = finished.pid
    fits_when_clean = [x for x in OVERFLOW if not x.startswith("loader.prefetch_factor")]
    cmd = train_cmd("resnet50", framework, tmp_path / "run", fits_when_clean, image_h5=image_h5)
    plant = " && ".join(
        [
            f"head -c 60M /dev/zero > /dev/shm/paddle_{dead}_7_11",
            f"touch -d '1 hour ago' /dev/shm/paddle_{dead}_7_11",
            f"head -c 1M /dev/zero > /dev/shm/paddle_{dead}_8_12",  # young: may be in flight
            "head -c 1M /dev/zero > /dev/shm/paddle_1_9_13",  # pid 1 is alive
            "touch -d '1 hour ago' /dev/shm/paddle_1_9_13",
            f"head -c 1M /dev/zero > /dev/shm/starved_ring_{dead}_0a1b2c3d_0",  # young, owner dead
        ]
    )
    doctor = [cmd[0], "-m", "train.doctor", *cmd[3:]]  # the same config, data and run dir
    inner = (
        f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {plant} && "
        "echo FREE: $(df --output=avail -m /dev/shm | tail -n 1) MiB; "
        f"{shlex.join(doctor)}; echo DOCTOR-END; {shlex.join(cmd)}; "
        "rc=$?; echo LEFT: $(ls /dev/shm); exit $rc"
    )
    result = subprocess.run(
        ["unshare", "--mount", "sh", "-c", inner],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removed 2 file(s), 61 MiB, left by processes that died" in result.stderr
    need = int(re.search(r"/dev/shm: need (\d+) MiB", result.stderr).group(1))
    free_before = int(result.stdout.split("FREE:")[1].split()[0])
    assert free_before < need, result.stdout  # the start-up check's exit 5, but for the sweep
    doctor_out = result.stdout.split("FREE:")[1].split("DOCTOR-END")[0]
    shm_line = next(line for line in doctor_out.splitlines() if "/dev/shm" in line)
    assert shm_line.lstrip().startswith("PASS"), doctor_out
    assert "counting 61 MiB in 2 file(s) that dead processes left" in shm_line, shm_line
    left = result.stdout.split("LEFT:")[-1].split()
    assert sorted(left) == sorted([f"paddle_{dead}_8_12", "paddle_1_9_13"])
