"""Handles are opened lazily, once per worker process, never in the parent for iteration, with
real PyTorch and PaddlePaddle DataLoaders, fork, spawn and forkserver, persistent workers or not."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from datasets.lmdb_ocr import LmdbOcrWriter
from datasets.synthetic import LATIN, ocr_samples, write_all

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "probes" / "loader_probe.py"
CASES = [
    f"{k}-{c}-{p}"
    for k in ("ocr", "h5")
    for c in ("fork", "spawn", "forkserver")
    for p in ("persistent", "fresh")
]


@pytest.fixture(scope="module")
def ocr_tree(tmp_path_factory):
    """Two LMDBs in one tree, so 'each file' means something."""
    root = tmp_path_factory.mktemp("tree")
    write_all(LmdbOcrWriter(root / "part_a"), ocr_samples(24, LATIN, None, seed=5))
    write_all(LmdbOcrWriter(root / "part_b"), ocr_samples(16, LATIN, None, seed=6))
    (root / "charset.txt").write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    return root


def _probe(framework, ocr_tree, image_h5, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"probe-{framework}")
    args = [
        sys.executable,
        str(PROBE),
        framework,
        str(ocr_tree),
        str(ocr_tree / "charset.txt"),
        str(image_h5),
        str(out),
    ]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def torch_probe(ocr_tree, image_h5, tmp_path_factory):
    return _probe("torch", ocr_tree, image_h5, tmp_path_factory)


@pytest.fixture(scope="module")
def paddle_probe(ocr_tree, image_h5, tmp_path_factory):
    return _probe("paddle", ocr_tree, image_h5, tmp_path_factory)


def check_opens(result: dict, case: str) -> None:
    epochs, workers = 2, 2  # the probe's EPOCHS and WORKERS
    files = 2 if case.startswith("ocr") else 1
    parent = str(result["parent"])
    by_pid = collections.defaultdict(list)
    for pid, purpose, path in result["opens"]:
        by_pid[pid].append((purpose, path))
    # The parent only opened each file once, briefly, to read its header and index.
    assert sorted(p for p, _ in by_pid.pop(parent)) == ["index"] * files
    worker_pids = list(by_pid)
    expected_workers = workers if "persistent" in case else workers * epochs
    assert len(worker_pids) == expected_workers, by_pid
    for pid, events in by_pid.items():
        counts = collections.Counter(events)
        # Each worker opened each file exactly once, for reading, whatever the epoch count.
        assert all(purpose == "read" for purpose, _ in events)
        assert len(counts) == files and set(counts.values()) == {1}, (pid, counts)
    assert result["batches"] == epochs * (40 // 8 if case.startswith("ocr") else 24 // 8)


@pytest.mark.torch
@pytest.mark.parametrize("case", CASES)
def test_torch_workers_open_each_file_once(torch_probe, case):
    check_opens(torch_probe[case], case)


@pytest.mark.paddle
@pytest.mark.parametrize("case", CASES)
def test_paddle_workers_open_each_file_once(paddle_probe, case):
    check_opens(paddle_probe[case], case)
