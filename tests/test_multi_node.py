"""Two "nodes" on one host, for real: each node is its own launcher process (torchrun with c10d
rendezvous on 127.0.0.1; python -m paddle.distributed.launch with --nnodes 2) running one rank
of python -m train, with its own node-local cache directory for s3:// data and one shared run
directory (what a cluster's shared volume is). Shown: the s3:// data is staged once per node
(counted on the S3 server), only global rank 0 writes the run's files, a SIGTERM to one node
stops both after the same step with one checkpoint, and --auto-resume on both continues it.

What differs from two machines: one network namespace and one /dev/shm, so nothing here tests
NIC selection or cross-host /dev/shm; both are the launchers' and NCCL's business on GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_distributed import free_port
from tests.test_remote import _bucket, s3, s3_server  # noqa: F401  (fixtures)
from tests.test_stop_signals import ANY_STOP, only_checkpoint_step
from tests.test_stop_signals import SETTINGS as STOP_SETTINGS
from tests.test_train import ROOT, set_args
from train.launch import launch_command

# As test_stop_signals: the stopped run's only checkpoint is the one its stop wrote.
SETTINGS = [*STOP_SETTINGS, "loader.num_workers=1", "data.val=null"]


def node_env(s3_server) -> dict[str, str]:  # noqa: F811  (the fixture's name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env.update(s3_server.env())
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_nodes(commands: list[list[str]], logs: list[Path], env) -> list[subprocess.Popen]:
    processes = []
    for command, log in zip(commands, logs, strict=True):
        with log.open("w") as sink:
            processes.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True
                )
            )
    return processes


def wait_for_step(run_dir: Path, nodes: list[subprocess.Popen], step: int, logs) -> None:
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if any(node.poll() is not None for node in nodes):
            pytest.fail("a node ended early:\n" + tail(logs))
        if metrics.exists():
            steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines() if x]
            if steps and max(steps) >= step:
                return
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached:\n" + tail(logs))


def finish(nodes: list[subprocess.Popen], timeout: float) -> list[int]:
    try:
        return [node.wait(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()


def tail(logs: list[Path], chars: int = 2500) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "train"]


def stop_and_auto_resume(commands, rank_logs, tmp_path, run_dir, s3_server, object_path):  # noqa: F811
    """Both nodes run until step 5, one SIGTERM to node 1's launcher; then both again with
    --auto-resume for three more steps. ``commands(max_steps)`` gives the nodes' commands,
    ``rank_logs(attempt)`` the files holding each node's rank output."""
    env = node_env(s3_server)
    launcher_logs = [tmp_path / f"node{k}.out" for k in (0, 1)]
    nodes = start_nodes(commands(None), launcher_logs, env)
    try:
        wait_for_step(run_dir, nodes, 5, launcher_logs)
        nodes[1].send_signal(signal.SIGTERM)  # Kubernetes preempting one node's pod
        finish(nodes, timeout=120)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    logs = [path.read_text(errors="replace") for path in rank_logs(0)]
    context = tail(launcher_logs) + "".join(x[-2500:] for x in logs)
    stops = [int(step) for log in logs for step in ANY_STOP.findall(log)]
    assert len(stops) == 2 and len(set(stops)) == 1, context  # both nodes, the same step
    step = only_checkpoint_step(run_dir)
    assert step == stops[0] >= 5, context
    steps = [r["step"] for r in train_records(run_dir)]
    assert steps == sorted(set(steps)), "two writers of metrics.jsonl"  # global rank 0 only

    # Staged once per node: one GET of the data object into each node's own cache.
    gets = s3_server.requests("GET", object_path)
    assert len(gets) == 2, gets
    for k in (0, 1):
        assert any((tmp_path / f"cache{k}").rglob("*")), f"node {k} staged nothing"

    launcher_logs = [tmp_path / f"node{k}.resumed.out" for k in (0, 1)]
    nodes = start_nodes(commands(step + 3), launcher_logs, env)
    codes = finish(nodes, timeout=300)
    logs = [path.read_text(errors="replace") for path in rank_logs(1)]
    context = tail(launcher_logs) + "".join(x[-2500:] for x in logs)
    assert codes == [0, 0], context
    assert any(f"step-{step:08d}" in log and "resumed from" in log for log in logs), context
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == step + 3
    assert len(s3_server.requests("GET", object_path)) == 2  # the node caches were reused


@pytest.mark.torch
def test_two_nodes_through_torchrun_c10d_stop_together_and_auto_resume(
    s3,  # noqa: F811
    tmp_path,
    image_h5,
):
    bucket = _bucket(s3, {"imagenet/train.h5": image_h5.read_bytes()})
    run_dir, port = tmp_path / "run", free_port()

    def commands(max_steps):
        result = []
        for k in (0, 1):
            args = ["-m", "train", "--config", "configs/resnet50/smoke.yaml"]
            # Both nodes are this host: say which one serves the rendezvous store.
            rdzv = {"rdzv_id": f"job-{max_steps}", "rdzv_conf": f"is_host={str(k == 0).lower()}"}
            cmd = launch_command(
                "torch", sys.executable, 1, args, master=f"127.0.0.1:{port}", nnodes=2, **rdzv
            )
            cmd += ["--output-dir", str(run_dir), "--auto-resume"]
            sets = ["framework=torch", *SETTINGS, "loader.batch_size=4"]
            sets += [f"data.train=s3://{bucket}/imagenet/train.h5", "data.image_size=32"]
            sets += [f"data.remote_cache_dir={tmp_path / f'cache{k}'}"]
            if max_steps:
                sets.append(f"train.max_steps={max_steps}")
            result.append(cmd + set_args(sets))
        return result

    def rank_logs(attempt):  # torchrun passes its rank's output through
        suffix = ".resumed.out" if attempt else ".out"
        return [tmp_path / f"node{k}{suffix}" for k in (0, 1)]

    stop_and_auto_resume(commands, rank_logs, tmp_path, run_dir, s3, "/imagenet/train.h5")


@pytest.mark.paddle
def test_two_nodes_through_paddle_launch_stop_together_and_auto_resume(
    s3,  # noqa: F811
    tmp_path,
    ocr_lmdb,
):
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    objects = {f"ocr/train/{p.name}": p.read_bytes() for p in ocr_lmdb.iterdir() if p.is_file()}
    objects["ocr/charset.txt"] = (ocr_lmdb.parent / "charset.txt").read_bytes()
    bucket = _bucket(s3, objects)
    run_dir = tmp_path / "run"
    ports = {}

    def commands(max_steps):
        port = ports.setdefault(max_steps, free_port())  # a new job for each attempt
        result = []
        for k in (0, 1):
            args = ["train/__main__.py", "--config", "configs/ocr/smoke.yaml"]
            node = {"master": f"127.0.0.1:{port}", "nnodes": 2, "node_rank": k}
            logs = tmp_path / f"logs{k}-{max_steps}"
            cmd = launch_command("paddle", sys.executable, 1, args, **node, log_dir=logs)
            cmd += ["--output-dir", str(run_dir), "--auto-resume"]
            sets = ["framework=paddle", *SETTINGS, "loader.batch_size=8"]
            sets += [f"data.train=s3://{bucket}/ocr/train"]
            sets += [f"data.char_dict=s3://{bucket}/ocr/charset.txt"]
            sets += [f"data.remote_cache_dir={tmp_path / f'cache{k}'}"]
            if max_steps:
                sets.append(f"train.max_steps={max_steps}")
            result.append(cmd + set_args(sets))
        return result

    def rank_logs(attempt):
        max_steps = list(ports)[attempt]
        return [tmp_path / f"logs{k}-{max_steps}" / "workerlog.0" for k in (0, 1)]

    stop_and_auto_resume(commands, rank_logs, tmp_path, run_dir, s3, "/ocr/train/data.mdb")
