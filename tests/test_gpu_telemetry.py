"""NVML telemetry (train/telemetry.py) on GPUs this host does not have: a stand-in pynvml
(tests/stand_ins/pynvml.py: eight GPUs, utilization NotSupported as on MIG slices) replaces
nvidia-ml-py. A refused query is logged once and reported as null without ending the run; the
GPU reported is the process's own (CUDA_VISIBLE_DEVICES mapped to NVML's physical numbering);
a run on the CPU reports no GPU.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stand_ins import pynvml as stand_in
from tests.test_train import train_cmd
from train import telemetry
from train.telemetry import GpuMonitor, Telemetry

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", stand_in)
    stand_in.CALLS.clear()
    return stand_in


def test_not_supported_is_null_logged_once_and_the_gpu_is_the_visible_one(
    nvml, monkeypatch, caplog
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monitor = GpuMonitor(1)  # cuda:1 of 4,5 is physical GPU 5
    with caplog.at_level(logging.WARNING, logger="train"):
        samples = [monitor.sample() for _ in range(3)]
    assert samples == [{"gpu_util": None, "gpu_mem_gb": 6.0}] * 3  # GPU 5 uses 6 GB
    warnings = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert len(warnings) == 1 and "utilization" in warnings[0] and "Not Supported" in warnings[0]


def test_uuids_in_cuda_visible_devices_name_the_physical_gpu(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{stand_in.uuid_of(6)},{stand_in.uuid_of(2)}")
    assert GpuMonitor(0).sample()["gpu_mem_gb"] == 7.0
    assert GpuMonitor(1).sample()["gpu_mem_gb"] == 3.0
    # CUDA accepts a unique prefix of a UUID too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", stand_in.uuid_of(3)[:12])
    assert GpuMonitor(0).sample()["gpu_mem_gb"] == 4.0


def test_nvml_target():
    nvml_target = telemetry.nvml_target
    assert nvml_target(3, None) == 3
    assert nvml_target(1, "4, 5") == 5
    assert nvml_target(0, "GPU-abc,GPU-def") == "GPU-abc"
    assert nvml_target(0, "MIG-0a1b") == "MIG-0a1b"
    with pytest.raises(ValueError, match="no entry 2"):
        nvml_target(2, "0,1")


def test_a_gpu_nvml_cannot_find_reports_null_without_ending_the_run(nvml, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-not-on-this-host")
    with caplog.at_level(logging.WARNING, logger="train"):
        monitor = GpuMonitor(0)
        assert monitor.sample() == {"gpu_util": None, "gpu_mem_gb": None}
    assert any("no handle for CUDA device 0" in r.getMessage() for r in caplog.records)


def test_training_on_the_cpu_reports_no_gpu(nvml, tmp_path):
    telemetry = Telemetry(tmp_path, True, 8, None, "knobs", 0.3)
    record = telemetry.log_window(step=1, epoch=0, loss=1.0, lr=0.1, bad=0)
    telemetry.close()
    assert not any(key.startswith("gpu_") for key in record)
    assert nvml.CALLS == []  # NVML not even initialized


@pytest.mark.torch
def test_a_cpu_run_on_a_gpu_host_with_mig_trains_and_reports_no_gpu(tmp_path, ocr_lmdb):
    """python -m train on the CPU with the stand-in NVML importable (a GPU host whose
    utilization query is NotSupported): the run ends normally and reports no GPU."""
    pytest.importorskip("torch")
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "stand_ins"), str(ROOT)]),
        "CUDA_VISIBLE_DEVICES": "4,5",
    }
    sets = ["train.device=cpu", "train.max_steps=4", "train.log_every=2", "train.eval_every=4"]
    sets += ["train.checkpoint_every=4", "optim.warmup_steps=0", "loader.num_workers=0"]
    command = train_cmd("ocr", "torch", out, sets, ocr_lmdb=ocr_lmdb)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    assert not any(key.startswith("gpu_") for r in train for key in r), train
