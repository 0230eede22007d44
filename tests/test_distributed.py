"""Two processes on CPU through the real launchers: torchrun (DDP + gloo) runs python -m train,
only rank 0 writes the run directory's files, and each rank reads its own shard."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import ROOT, data_overrides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.torch
def test_torchrun_two_cpu_processes(tmp_path, ocr_lmdb, image_h5):
    out = tmp_path / "run"
    sets = [
        "framework=torch",
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=6",
        "train.checkpoint_every=6",
        "loader.num_workers=1",
        "loader.batch_size=4",
        "optim.warmup_steps=1",
        *data_overrides("resnet50", ocr_lmdb, image_h5),
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "train",
        "--config",
        "configs/resnet50/smoke.yaml",
        "--output-dir",
        str(out),
    ]
    for item in sets:
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 rank(s)" in result.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["type"] == "train"]
    assert steps == [2, 4, 6]  # one writer: rank 0
    assert (out / "checkpoints" / "step-00000006").is_dir()
    evals = [r for r in records if r["type"] == "eval"]
    assert evals and 0.0 <= evals[-1]["top1"] <= 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert Path(out / "config.resolved.yaml").is_file()
