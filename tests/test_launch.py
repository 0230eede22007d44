"""train/launch.py: the launcher command lines that the GPU check and the multi-process tests
start ranks with, for both frameworks, and the options a framework's launcher does not take."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.launch import launch_command


def test_torchrun_with_a_static_rendezvous_runs_a_module():
    cmd = launch_command("torch", "/py", 2, ["-m", "train", "--config", "c.yaml"], master="h:123")
    assert cmd == [
        "/py",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "h",
        "--master-port",
        "123",
        "-m",
        "train",
        "--config",
        "c.yaml",
    ]


def test_torchrun_on_two_nodes_with_a_c10d_rendezvous():
    cmd = launch_command(
        "torch",
        "/py",
        1,
        ["-m", "train"],
        master="127.0.0.1:9",
        nnodes=2,
        node_rank=1,
        rdzv_id="job-1",
        rdzv_conf="is_host=false",
    )
    assert cmd[3:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:9",
        "--rdzv-id",
        "job-1",
        "--rdzv-conf",
        "is_host=false",
        "-m",
        "train",
    ]


def test_paddle_launch_runs_a_script_with_its_own_spelling():
    cmd = launch_command(
        "paddle", Path("/py"), 2, ["train/__main__.py", "--resume"], log_dir=Path("/l")
    )
    assert cmd == [
        "/py",
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        "2",
        "--log_dir",
        "/l",
        "train/__main__.py",
        "--resume",
    ]
    two_nodes = launch_command(
        "paddle", "/py", 1, ["s.py"], master="h:7", nnodes=2, node_rank=0, devices="0,1"
    )
    assert two_nodes[3:] == [
        "--nnodes",
        "2",
        "--rank",
        "0",
        "--nproc_per_node",
        "1",
        "--master",
        "h:7",
        "--devices",
        "0,1",
        "s.py",
    ]


@pytest.mark.parametrize(
    "framework, options",
    [
        ("torch", {"log_dir": "/l"}),
        ("torch", {"devices": "0"}),
        ("torch", {"rdzv_id": "job"}),  # a c10d rendezvous needs its endpoint
        ("torch", {"master": "h:1", "rdzv_conf": "x=y"}),  # a conf without a rendezvous
        ("paddle", {"master": "h:1", "rdzv_id": "job"}),
        ("tensorflow", {}),
    ],
)
def test_an_option_the_launcher_does_not_take_is_refused(framework, options):
    with pytest.raises(ValueError):
        launch_command(framework, "/py", 2, ["s.py"], **options)
