"""A trainer whose loader still has a worker, stuck in a read, exits all the same and leaves no
worker behind, whatever the dataset (one without RecordDataset's start_worker included).

Python's exit ends a loader's daemon workers with SIGTERM and waits for them. A worker is born
holding SIGTERM (datasets.handles.stop_signals_held) and stops holding it in its worker_init_fn:
a worker that never did lived through that SIGTERM, and the trainer waited for it forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FRAMEWORKS = [
    pytest.param("paddle", marks=pytest.mark.paddle),
    pytest.param("torch", marks=pytest.mark.torch),
]

# A trainer in small: a loader over a dataset with no start_worker whose sample 5 never comes
# (a stuck storage read); the loader's timeout ends the epoch; the process then exits with the
# loader (and its worker) still alive, writing the worker's pid to a file first. (A worker
# leaves its trainer's process group as it starts, so the test kills it by its pid.)
TRAINER = """
import sys, time
from pathlib import Path
import numpy as np
from datasets.sampler import EpochSampler
from tests.backends import make_config, start

class StuckRead:
    def __len__(self):
        return 8
    def __getitem__(self, item):
        _, index = item
        if index == 5:
            time.sleep(600)
        return {"image": np.zeros((3, 4, 4), np.uint8), "label": np.int64(index)}

config = make_config(sys.argv[1], "ocr", Path(sys.argv[2]),
                     loader={"batch_size": 2, "num_workers": 1, "timeout_s": 2})
batches = start(config).batches
loader = batches.make_loader(StuckRead(), EpochSampler(8, shuffle=False), config.loader,
                             train=True)
try:
    for _ in loader:
        pass
except (TimeoutError, RuntimeError):  # ours (Paddle), Torch's own "timed out"
    pass
def children_of(task):
    try:
        return task.read_text().split()
    except FileNotFoundError:  # a thread (a loader's) that ended since the listing
        return []
tasks = Path("/proc/self/task").glob("*/children")
Path(sys.argv[3]).write_text(" ".join(pid for task in tasks for pid in children_of(task)))
"""


def _pids(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_exit_with_a_stuck_worker_ends_the_worker_and_the_process(framework, ocr_lmdb, tmp_path):
    pids = tmp_path / "workers"
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER, framework, str(ocr_lmdb), str(pids)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,  # no pipe a surviving worker could hold open
        stderr=open(tmp_path / "stderr", "w"),  # noqa: SIM115 (closed with the process)
    )
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        for pid in _pids(pids):
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the process hung at exit on its stuck loader worker")
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == 0, stderr[-3000:]
    workers = _pids(pids)
    assert workers, stderr[-2000:]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"workers outlived their trainer: {left}"
