"""/dev/shm sizing, the fail/adapt policy, and the doctor under a Docker-like 64 MB /dev/shm."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train import preflight
from train.config.load import load_config

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20


def config(name="configs/resnet50/single_gpu.yaml", *sets):
    return load_config(ROOT / name, list(sets))


def with_workers(cfg, workers: int):
    """``cfg`` with its loader resolved to ``workers``, as train.data.resolve leaves it."""
    return dataclasses.replace(cfg, loader=cfg.loader.resolved(workers))


def test_need_counts_batches_in_flight_loaders_ranks_and_cache():
    cfg = config()  # batch 256 x 224x224x3 uint8, prefetch 4, persistent, with val
    plan = preflight.plan(with_workers(cfg, 8), local_ranks=2)
    assert plan.batch_bytes == 256 * (3 * 224 * 224 + 8)
    assert plan.batches_in_flight == 4 * 8 + 2 and plan.loaders == 2
    assert plan.need_bytes == int(plan.batch_bytes * 34 * 2 * 2 * cfg.shm.headroom)
    cached = config("configs/resnet50/small_dataset.yaml")
    assert preflight.plan(with_workers(cached, 2), 1).cache_bytes == cached.data.cache_max_bytes
    # uint8 through IPC: a quarter of the float32 bytes of the same batch.
    assert plan.batch_bytes / 256 < 0.26 * 4 * 3 * 224 * 224
    assert preflight.plan(with_workers(cfg, 0), local_ranks=1).need_bytes == 0


def test_fail_policy_names_shm_and_the_fix():
    with pytest.raises(preflight.ShmTooSmallError) as info:
        preflight.apply_policy(with_workers(config(), 8), 1, free=64 * MB)
    message = str(info.value)
    assert "/dev/shm too small" in message and "shm_size: 8g" in message
    assert "ipc: host" in message and "shm.policy: adapt" in message


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_adapt_policy_fits_by_lowering_prefetch_then_workers(framework):
    cfg = config("configs/resnet50/single_gpu.yaml", "shm.policy=adapt", f"framework={framework}")
    cfg = with_workers(cfg, 8)
    free = 600 * MB
    adapted = preflight.apply_policy(cfg, 1, free=free)
    assert adapted.loader.prefetch_factor == 1
    assert 0 < adapted.loader.num_workers < 8
    assert preflight.plan(adapted, 1).need_bytes <= free
    # With almost no shm: torch falls back to no workers, Paddle to pipes with all workers.
    tiny = preflight.apply_policy(cfg, 1, free=1 * MB)
    if framework == "torch":
        assert tiny.loader.num_workers == 0
    else:
        assert tiny.loader.num_workers == 8 and tiny.loader.use_shared_memory is False
    assert preflight.plan(tiny, 1).need_bytes <= 1 * MB


def _doctor(shm_mb: int | None, tmp_path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "train.doctor",
        "--config",
        "configs/resnet50/single_gpu.yaml",
        "--set",
        f"output.dir={tmp_path}",
    ]
    if shm_mb is not None:
        inner = " ".join(f"'{c}'" for c in cmd)
        cmd = [
            "unshare",
            "--mount",
            "sh",
            "-c",
            f"mount -t tmpfs -o size={shm_mb}m tmpfs /dev/shm && exec {inner}",
        ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _shm_line(output: str) -> str:
    return next(line for line in output.splitlines() if "/dev/shm" in line and "need" in line)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_doctor_fails_shm_under_docker_default_and_passes_with_large_shm(tmp_path):
    small = _doctor(64, tmp_path)
    if "Operation not permitted" in small.stderr:
        pytest.skip("no permission for a private mount namespace here")
    assert small.returncode == 1
    line = _shm_line(small.stdout)
    assert line.startswith("FAIL") and "free 64 MiB" in line
    assert "fix: give the container more shared memory: shm_size: 8g" in small.stdout
    large = _doctor(8192, tmp_path)
    assert _shm_line(large.stdout).startswith("PASS")


def test_stale_batches_are_old_files_of_dead_paddle_processes_only(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, alive, hour_ago = finished.pid, os.getpid(), time.time() - 3600
    files = {
        f"paddle_{dead}_3_77": (4096, hour_ago),  # the only stale one
        f"paddle_{dead}_4_78": (10, None),  # young: its batch may still be taken
        f"paddle_{alive}_5_79": (10, hour_ago),  # creator alive (e.g. Paddle's shm cache)
        f"torch_{dead}_6_80": (10, hour_ago),  # not Paddle's
        f"paddle_{dead}_x": (10, hour_ago),  # not Paddle's pattern
    }
    for name, (size, mtime) in files.items():
        (tmp_path / name).write_bytes(b"\0" * size)
        if mtime is not None:
            os.utime(tmp_path / name, (mtime, mtime))
    stale = preflight.stale_batches(str(tmp_path))
    assert [p.name for p in stale.paths] == [f"paddle_{dead}_3_77"] and stale.bytes == 4096
    assert preflight.remove_stale_batches(str(tmp_path)) == 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(files) - {stale.paths[0].name})
    assert preflight.stale_batches(str(tmp_path / "missing")).paths == []


def test_stale_state_files_are_those_of_dead_trainers_only(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, alive = finished.pid, os.getpid()
    files = {
        f"bad-samples-{dead}-7f3a.state": 300,  # stale
        f"in-flight-{dead}-7f3b.state": 8192,  # stale
        f"bad-samples-{alive}-7f3c.state": 10,  # this process's: alive
        f"in-flight-{dead}-7f3d.tmp": 10,  # not our pattern
        f"other-{dead}-7f3e.state": 10,  # not ours
    }
    for name, size in files.items():
        (tmp_path / name).write_bytes(b"\0" * size)
        os.utime(tmp_path / name, (time.time() - 60, time.time() - 60))  # left a minute ago
    stale = preflight.stale_state_files(str(tmp_path))
    assert sorted(p.name for p in stale.paths) == sorted(list(files)[:2]) and stale.bytes == 8492
    assert preflight.remove_stale_state_files(str(tmp_path)) == 8492
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(list(files)[2:])
    assert preflight.stale_state_files(str(tmp_path / "missing")).paths == []


def test_an_unmarked_file_of_a_dead_pid_is_swept_at_once_however_recently_written(tmp_path):
    """A batch ring file and an in-flight table of a dead pid, written a moment ago (a run
    restarted right after a kill -9): our files carry their owner's mark from the moment their
    name exists, so an unmarked one is dead whatever its age, and it says nothing about another
    PID namespace: the old Paddle file of a dead pid beside it is swept too."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, hour_ago = finished.pid, time.time() - 3600
    ring = tmp_path / f"{preflight.RING_PREFIX}{dead}_0a1b2c3d_0"
    table = tmp_path / f"in-flight-{dead}-7f3a.state"
    paddle = tmp_path / f"paddle_{dead}_3_77"
    for path in (ring, table, paddle):
        path.write_bytes(b"\0" * 100)
    os.utime(paddle, (hour_ago, hour_ago))
    stale = preflight.stale_batches(str(tmp_path))
    assert sorted(p.name for p in stale.paths) == sorted([ring.name, paddle.name])
    assert [p.name for p in preflight.stale_state_files(str(tmp_path)).paths] == [table.name]


def test_a_marked_file_carries_its_mark_from_its_first_moment_and_never_replaces_a_name(
    tmp_path,
):
    """owner_lock.create_marked links an unnamed, already marked and sized file under its name:
    the name never exists unmarked. Like O_EXCL | O_NOFOLLOW it refuses any existing name, a
    symlink to a file included (which it leaves untouched)."""
    from datasets import owner_lock

    path = tmp_path / "data-cache-1-7f3a"
    fd = owner_lock.create_marked(str(path), 4096)
    try:
        assert owner_lock.held(path) is True and path.stat().st_size == 4096
        assert not [p for p in tmp_path.iterdir() if p != path]  # no temporary name left
        with pytest.raises(FileExistsError):
            owner_lock.create_marked(str(path))
        target = tmp_path / "target"
        target.write_bytes(b"keep")
        (tmp_path / "link").symlink_to(target)
        with pytest.raises(FileExistsError):
            owner_lock.create_marked(str(tmp_path / "link"), 10)
        assert target.read_bytes() == b"keep"
    finally:
        os.close(fd)
    assert owner_lock.held(path) is False  # the kernel drops the mark with the last descriptor


# A process in a PID namespace of its own, as another container sharing /dev/shm would be: it
# makes a shared file under a name whose pid is dead here, prints READY and waits for stdin.
_OTHER_NAMESPACE_OWNER = """
import sys
from datasets.shared_block import SharedBlock
block = SharedBlock(sys.argv[1], 4096)
print("READY", flush=True)
sys.stdin.read()
"""


def _start_in_other_pid_namespace(path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", _OTHER_NAMESPACE_OWNER, str(path)]
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode == 0:  # root, or user namespaces allowed: a real PID namespace
        cmd = ["unshare", "--pid", "--fork", *cmd]
    owner = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout.readline().strip() == "READY"
    return owner


def test_sweep_keeps_live_files_of_another_pid_namespace(tmp_path):
    """The pid in a file's name is dead here, but its creator lives in another PID namespace
    (a container sharing /dev/shm): its owner's mark keeps the file, and with it Paddle's files
    of pids not visible here; once the owner is gone, the file is swept."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, hour_ago = finished.pid, time.time() - 3600
    cache = tmp_path / f"data-cache-{dead}-7f3a"  # datasets/cache.py's memory-cache name
    paddle = tmp_path / f"paddle_{dead}_3_77"
    paddle.write_bytes(b"\0" * 100)
    os.utime(paddle, (hour_ago, hour_ago))

    owner = _start_in_other_pid_namespace(cache)
    try:
        os.utime(cache, (hour_ago, hour_ago))
        assert preflight.stale_batches(str(tmp_path)).paths == []
        assert preflight.stale_state_files(str(tmp_path)).paths == []
        assert preflight.remove_stale_batches(str(tmp_path)) == 0
        assert cache.exists() and paddle.exists()
    finally:
        owner.stdin.close()
        owner.wait(30)
    assert cache.exists()  # killed without cleaning up: a leftover, as after kill -9
    assert sorted(p.name for p in preflight.stale_batches(str(tmp_path)).paths) == sorted(
        [cache.name, paddle.name]
    )


def test_the_state_files_a_trainer_makes_match_the_sweeps_patterns(tmp_path):
    from datasets.bad_samples import BadSampleLog
    from datasets.in_flight import STATE_FILE as IN_FLIGHT
    from datasets.in_flight import InFlightTable

    BadSampleLog(10, state_dir=tmp_path), InFlightTable(tmp_path)
    bad_samples, in_flight = sorted(p.name for p in tmp_path.iterdir())
    for pattern, name in [(preflight.BAD_SAMPLES_FILE, bad_samples), (IN_FLIGHT, in_flight)]:
        match = pattern.fullmatch(name)
        assert match and int(match.group(1)) == os.getpid(), name
    assert preflight.stale_state_files(str(tmp_path)).paths == []  # their creator is alive
