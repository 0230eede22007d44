"""Two processes on CPU through the real launchers: torchrun (DDP + gloo) runs python -m train,
only rank 0 writes the run directory's files, and each rank reads its own shard; the same with
python -m paddle.distributed.launch (DataParallel + gloo)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_train import ROOT, data_overrides, set_args
from train.launch import launch_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_master() -> str:
    """torchrun's rendezvous on this host, at a free port."""
    return f"127.0.0.1:{free_port()}"


def rendezvous(framework: str, logs: Path) -> dict:
    """What a single-node launch of ``framework`` is given: torchrun a free port on this host,
    paddle.distributed.launch a folder for its workers' logs (it picks its own port)."""
    return {"master": local_master()} if framework == "torch" else {"log_dir": logs}


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
        "output.plots=false",  # rank 0's plots cost 0.6-0.9 CPU-s; test_train draws them
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
    args = ["-m", "train", "--config", "configs/resnet50/smoke.yaml", "--output-dir", str(out)]
    cmd = launch_command("torch", sys.executable, 2, args + set_args(sets), master=local_master())
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
    args = ["train/__main__.py", "--config", "configs/ocr/smoke.yaml", "--output-dir", str(out)]
    cmd = launch_command("paddle", sys.executable, 2, args + set_args(sets), log_dir=logs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    worker_logs = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("workerlog.*")))
    assert result.returncode == 0, result.stdout[-2000:] + worker_logs[-4000:]
    assert "2 rank(s)" in worker_logs
    assert_written_once_by_rank_0(out, "acc")


# ---------------------------------------------------------------- resume on another world size
def launch(framework: str, nproc: int, out: Path, sets: list[str], logs: Path, *extra: str):
    """python -m train on ``nproc`` CPU ranks: torchrun or paddle.distributed.launch, or plainly
    for one rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    if nproc == 1:
        cmd = [sys.executable, "-m", "train"]
    elif framework == "torch":
        cmd = launch_command("torch", sys.executable, nproc, ["-m", "train"], master=local_master())
    else:
        cmd = launch_command("paddle", sys.executable, nproc, ["train/__main__.py"], log_dir=logs)
    cmd += ["--config", "configs/ocr/smoke.yaml", "--output-dir", str(out), *extra]
    result = subprocess.run(
        cmd + set_args(sets), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    worker_logs = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("workerlog.*")))
    assert result.returncode == 0, result.stderr[-3000:] + worker_logs[-3000:]
    return result.stderr + worker_logs


def records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def lr_at(out: Path, step: int, after: int = 0) -> float:
    """The logged learning rate after ``step``, among the records after the first ``after``."""
    return next(r["lr"] for r in records(out, "train")[after:] if r["step"] == step)


def rewind_to(out: Path, step: int) -> None:
    """The run directory as if the run had stopped at ``step``'s checkpoint."""
    checkpoints = out / "checkpoints"
    for path in checkpoints.glob("step-????????"):
        if int(path.name[5:]) > step:
            shutil.rmtree(path)
    (checkpoints / "latest").write_text(f"step-{step:08d}\n")


def reshard_settings(framework: str, ocr_lmdb, image_h5) -> list[str]:
    """2 epochs of the 96 OCR lines at 8 per rank, a checkpoint every 3 steps, cosine LR, no
    warmup. The CRNN's checkpoints (6 MB) cost the eleven saves little; what is tested, the
    step count, the data position and the LR curve across world sizes, is the task's alone."""
    return [
        f"framework={framework}",
        *data_overrides("ocr", ocr_lmdb, image_h5),
        "loader.batch_size=8",
        "loader.num_workers=1",
        "train.epochs=2",
        "train.max_steps=1000",  # epochs decide
        "train.log_every=1",
        "train.checkpoint_every=3",
        "train.keep_last=10",
        "optim.warmup_steps=0",
        "output.plots=false",
    ]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, ocr_lmdb, image_h5):
    """``two_rank_run(framework)``: the run directory of a finished 2-rank reshard_settings run,
    trained on first use; the resume tests copy it and never write to it."""

    @functools.cache
    def train(framework: str) -> Path:
        root = tmp_path_factory.mktemp(f"two-ranks-{framework}")
        sets = reshard_settings(framework, ocr_lmdb, image_h5)
        launch(framework, 2, root / "run", sets, root / "logs")
        return root / "run"

    return train


RESHARD_CASES = [
    pytest.param("torch", 1, marks=pytest.mark.torch),
    pytest.param("torch", 3, marks=pytest.mark.torch),
    pytest.param("paddle", 1, marks=pytest.mark.paddle),
]


@pytest.mark.parametrize("framework, new_world", RESHARD_CASES)
def test_resume_on_another_world_size_continues_the_same_training(
    framework, new_world, tmp_path, ocr_lmdb, image_h5, two_rank_run
):
    """A 2-rank run of 2 epochs over 96 lines (global batch 16: 6 steps an epoch), stopped at
    step 3 (half of epoch 0 read), resumes on 1 rank (global batch 8) or 3 ranks (24): the step
    count converts (3 -> 6 or 2), the rest of epoch 0 is read once (6 or 2 more steps) and
    epoch 1 whole, the run ends at 2 epochs (24 or 8 steps), and the learning rate after the
    same samples equals the 2-rank run's (cosine over the run, no warmup)."""
    if framework == "paddle":
        import paddle

        if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    sets = reshard_settings(framework, ocr_lmdb, image_h5)
    first = two_rank_run(framework)  # one 2-rank run for every new world size
    assert [r["step"] for r in records(first, "epoch")] == [6, 12]

    resumed = tmp_path / f"resumed-on-{new_world}"
    shutil.copytree(first, resumed)
    rewind_to(resumed, 3)
    copied = len(records(resumed, "train"))
    logs = launch(framework, new_world, resumed, sets, tmp_path / "logs-n", "--resume")

    scale = 2 / new_world  # steps of the new global batch per step of the old
    assert f"resuming a checkpoint of 2 rank(s) on {new_world}" in logs
    assert f"step 3 -> {round(3 * scale)}" in logs
    epoch_ends = [r["step"] for r in records(resumed, "epoch")][2:]  # after the copied two
    assert epoch_ends == [round(6 * scale), round(12 * scale)]
    assert json.loads((resumed / "summary.json").read_text())["steps"] == round(12 * scale)
    resumed_steps = [r["step"] for r in records(resumed, "train")[copied:]]
    assert resumed_steps == list(range(round(3 * scale) + 1, round(12 * scale) + 1))
    # The same samples seen, the same point of the LR curve: after epoch 0 and mid-epoch 1.
    for old_step in (6, 9):
        if (old_step * scale) % 1 == 0:
            new_step = round(old_step * scale)
            assert lr_at(resumed, new_step, after=copied) == pytest.approx(lr_at(first, old_step))


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("torch", marks=pytest.mark.torch),
        pytest.param("paddle", marks=pytest.mark.paddle),
    ],
)
def test_sync_buffers_gives_every_rank_rank_0s_batchnorm_statistics(framework, tmp_path):
    """Ranks train BatchNorm running statistics on their own batches (Paddle's DataParallel never
    syncs them): before an evaluation the backend makes them rank 0's, so all ranks evaluate
    the model the checkpoint holds."""
    result = run_two_ranks(framework, tmp_path, "tests/probes/sync_buffers_probe.py", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (np.load(tmp_path / f"rank{r}.npy") for r in (0, 1))
    assert rank0.size > 0 and np.all(rank0 == 1.0)  # rank 0 kept its own
    assert np.array_equal(rank1, rank0)  # rank 1's (2.0) replaced by rank 0's


def skip_paddle_launch_on_gpus() -> None:
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")


def run_two_ranks(
    framework: str, tmp_path: Path, script: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``script framework *args`` on 2 CPU ranks over gloo: torchrun, or
    paddle.distributed.launch (its worker logs under tmp_path/logs, appended to stderr)."""
    if framework == "paddle":
        skip_paddle_launch_on_gpus()
    options = rendezvous(framework, tmp_path / "logs")
    cmd = launch_command(framework, sys.executable, 2, [script, framework, *args], **options)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    logs = sorted((tmp_path / "logs").glob("workerlog.*"))
    result.stderr += "".join(path.read_text(errors="replace") for path in logs)
    return result
