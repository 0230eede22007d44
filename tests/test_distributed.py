"""Two processes on CPU through the real launchers: torchrun (DDP + gloo) runs python -m train,
only rank 0 writes the run directory's files, and each rank reads its own shard; the same with
python -m paddle.distributed.launch (DataParallel + gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import ROOT, data_overrides, set_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_settings(framework: str, task: str, ocr_lmdb, image_h5) -> list[str]:
    """Six steps, a checkpoint and an evaluation at step 6, one loader worker per rank."""
    return [
        f"framework={framework}",
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=6",
        "train.checkpoint_every=6",
        "loader.num_workers=1",
        "loader.batch_size=4",
        "optim.warmup_steps=1",
        *data_overrides(task, ocr_lmdb, image_h5),
    ]


def assert_written_once_by_rank_0(out: Path, metric: str) -> None:
    """A 6-step two-rank run: one metrics writer, the step-6 checkpoint, an evaluation with
    ``metric`` in [0, 1], and the summary."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["type"] == "train"]
    assert steps == [2, 4, 6]  # one writer: rank 0
    assert (out / "checkpoints" / "step-00000006").is_dir()
    evals = [r for r in records if r["type"] == "eval"]
    assert evals and 0.0 <= evals[-1][metric] <= 1.0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


@pytest.mark.torch
def test_torchrun_two_cpu_processes(tmp_path, ocr_lmdb, image_h5):
    out = tmp_path / "run"
    sets = two_rank_settings("torch", "resnet50", ocr_lmdb, image_h5)
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
    cmd += set_args(sets)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 rank(s)" in result.stderr
    assert_written_once_by_rank_0(out, "top1")
    assert Path(out / "config.resolved.yaml").is_file()


@pytest.mark.paddle
def test_paddle_launch_two_cpu_processes(tmp_path, ocr_lmdb, image_h5):
    """python -m paddle.distributed.launch, 2 CPU ranks over gloo, the whole of python -m train:
    DataParallel CRNN, sharded sampler, rank-0-only files, checkpoint and evaluation."""
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    out, logs = tmp_path / "run", tmp_path / "logs"
    sets = two_rank_settings("paddle", "ocr", ocr_lmdb, image_h5)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2"]
    cmd += ["--log_dir", str(logs), "train/__main__.py", "--config", "configs/ocr/smoke.yaml"]
    cmd += ["--output-dir", str(out)]
    cmd += set_args(sets)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    worker_logs = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("workerlog.*")))
    assert result.returncode == 0, result.stdout[-2000:] + worker_logs[-4000:]
    assert "2 rank(s)" in worker_logs
    assert_written_once_by_rank_0(out, "acc")
