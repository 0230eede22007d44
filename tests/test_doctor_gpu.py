"""The doctor's GPU checks (train/backends/gpu_verdicts.py) on GPUs this host does not have: NVML
and the framework probe (train/backends/gpu_probe.py) replaced through their seams,
``gpu_probe.nvml_gpus`` and ``gpu_probe.framework_probe_command``; and the real probe with this
environment's framework.
"""

from __future__ import annotations

import json
import sys

import pytest

from train import doctor
from train.backends import gpu_probe
from train.backends import gpu_verdicts as doctor_gpu
from train.config.load import load_config

H200 = gpu_probe.Gpu(0, "NVIDIA H200", (9, 0), "550.54.15", "12.4")


def gpu_config(tmp_path, device: str, framework: str = "paddle"):
    """A standalone config; only train.device and framework matter to the GPU checks."""
    path = tmp_path / "doctor.yaml"
    path.write_text(
        f"task: ocr\nframework: paddle\ndata:\n  train: {tmp_path / 'unused' / 'train'}\n"
        f"  char_dict: {tmp_path / 'unused' / 'charset.txt'}\n  image_shape: [3, 32, 160]\n"
        "  max_text_length: 10\n"
        "loader:\n  batch_size: 8\n  num_workers: 0\ntrain:\n  device: cpu\n"
        f"output:\n  dir: {tmp_path / 'runs'}/{{config_name}}\n"
    )
    return load_config(path, [f"train.device={device}", f"framework={framework}"])


def fake_probe(monkeypatch, build: dict | None, *devices: dict, exit_code: int = 0):
    """Replace the framework probe by a python that prints these facts, as the real one does."""
    facts = ([{"kind": "build", **build}] if build else []) + [
        {"kind": "device", **d} for d in devices
    ]
    lines = "".join(f"print('DOCTOR-PROBE ' + {json.dumps(json.dumps(f))})\n" for f in facts)
    code = lines + f"raise SystemExit({exit_code})\n"
    monkeypatch.setattr(
        gpu_probe, "framework_probe_command", lambda fw: [sys.executable, "-c", code]
    )


def paddle_build(cuda: str | None, count: int) -> dict:
    return {"version": "2.6.1", "cuda": cuda, "compiled": cuda is not None, "count": count}


def by_name(checks):
    return {c.name: c for c in checks}


def test_hopper_with_paddle_cuda118_build_fails_with_the_cuda12_base_fix(tmp_path, monkeypatch):
    """Paddle's CUDA 11.8 build on an H200: a FAIL although its tiny op ran (on Hopper, so does
    paddle.utils.run_check(), and training then aborts)."""
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200])
    fake_probe(
        monkeypatch,
        paddle_build("11.8", 1),
        {"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "op": "ok"},
    )
    checks = by_name(doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu")))
    assert checks["GPU"].status == "PASS" and "NVIDIA H200 (sm_90, driver 550.54.15)" in (
        checks["GPU"].detail
    )
    arch = checks["GPU vs paddle"]
    assert arch.status == "FAIL"
    assert "Paddle's CUDA 11.8 build cannot run on Hopper and newer (sm_90)" in arch.detail
    assert "FAIL  GPU vs paddle  NVIDIA H200 (sm_90): Paddle" in doctor.render([*checks.values()])
    assert arch.fix == (
        "use the CUDA 12 Paddle base: PADDLE_BASE_IMAGE=paddlepaddle/paddle:2.6.1-gpu-cuda12.0-"
        "cudnn8.9-trt8.6 docker compose build train-ocr"
    )
    # The tiny op failing on the GPU: training would crash at its first kernel.
    fake_probe(
        monkeypatch,
        paddle_build("11.8", 1),
        {
            "index": 0,
            "name": "NVIDIA H200",
            "capability": [9, 0],
            "op": "OSError: (External) CUDA error(209), no kernel image is available",
        },
    )
    arch = by_name(doctor_gpu.check_gpu(gpu_config(tmp_path, "auto")))["GPU vs paddle"]
    assert arch.status == "FAIL" and "no kernel image is available" in arch.detail
    assert "PADDLE_BASE_IMAGE=paddlepaddle/paddle:2.6.1-gpu-cuda12.0" in arch.fix
    # The CUDA 12 build on the same GPU: fine.
    fake_probe(
        monkeypatch,
        paddle_build("12.0", 1),
        {"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "op": "ok"},
    )
    checks = doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu"))
    assert [c.status for c in checks] == ["PASS", "PASS"], doctor.render(checks)


def test_torch_build_without_the_gpus_arch_fails_when_its_op_fails(tmp_path, monkeypatch):
    blackwell = gpu_probe.Gpu(0, "NVIDIA B200", (10, 0), "570.86", "12.8")
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [blackwell])
    build = {
        "version": "2.6.0+cu124",
        "cuda": "12.4",
        "compiled": True,
        "count": 1,
        "archs": ["sm_50", "sm_80", "sm_86", "sm_90"],
    }
    op = "RuntimeError: CUDA error: no kernel image is available for execution on the device"
    fake_probe(monkeypatch, build, {"index": 0, "name": "B200", "capability": [10, 0], "op": op})
    arch = by_name(doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu", "torch")))["GPU vs torch"]
    assert arch.status == "FAIL" and "sm_100" in arch.detail and "no kernel image" in arch.detail
    assert "not sm_100" in arch.detail and "TORCH_BASE_IMAGE=" in arch.fix


@pytest.mark.parametrize("device", ["gpu", "auto"])
def test_gpus_seen_but_framework_without_cuda(device, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200])
    fake_probe(monkeypatch, paddle_build(None, 0))
    [check] = doctor_gpu.check_gpu(gpu_config(tmp_path, device))
    assert "1 visible (NVML): NVIDIA H200" in check.detail
    assert "but paddle cannot use CUDA: paddle 2.6.1 is a CPU build" in check.detail
    assert "install paddlepaddle-gpu" in check.fix
    if device == "gpu":
        assert check.status == "FAIL" and "training would stop at start" in check.detail
    else:
        assert check.status == "WARN" and "TRAINING WOULD RUN ON THE CPU" in check.detail


def test_cuda_build_that_sees_no_gpu_says_why(tmp_path, monkeypatch):
    old_driver = gpu_probe.Gpu(0, "Tesla V100", (7, 0), "470.82", "11.4")
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [old_driver])
    fake_probe(monkeypatch, paddle_build("12.0", 0))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    [check] = doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu"))
    assert check.status == "FAIL" and "driver too old" in check.detail
    assert "supports CUDA up to 11.4" in check.detail and "update the host's NVIDIA" in check.fix
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    [check] = doctor_gpu.check_gpu(gpu_config(tmp_path, "auto"))
    assert check.status == "WARN" and "CUDA_VISIBLE_DEVICES='' hides every GPU" in check.detail


def test_device_cpu_never_fails_on_gpus_and_asks_no_framework(tmp_path, monkeypatch):
    def no_probe(framework):
        raise AssertionError("train.device: cpu must not start the framework probe")

    monkeypatch.setattr(gpu_probe, "framework_probe_command", no_probe)
    for gpus in ([], [H200]):
        monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda gpus=gpus: gpus)
        [check] = doctor_gpu.check_gpu(gpu_config(tmp_path, "cpu"))
        assert check.status == "PASS" and check.detail.startswith("train.device is cpu")


def test_no_nvml_but_framework_sees_cuda_passes(tmp_path, monkeypatch):
    """Containers where libnvidia-ml is not injected: training works, only telemetry is lost."""
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [])
    fake_probe(
        monkeypatch,
        paddle_build("12.0", 1),
        {"index": 0, "name": "NVIDIA H100", "capability": [9, 0], "op": "ok"},
    )
    checks = doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu"))
    assert [c.status for c in checks] == ["PASS", "PASS"], doctor.render(checks)
    assert "NVML not available" in checks[0].detail and "NVIDIA H100 (sm_90)" in checks[0].detail


def test_a_probe_that_dies_on_the_gpu_fails_and_one_that_cannot_start_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200])
    fake_probe(monkeypatch, paddle_build("12.0", 1), exit_code=-11 % 256)
    arch = by_name(doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu")))["GPU vs paddle"]
    assert arch.status == "FAIL" and "probe did not finish (exit 245" in arch.detail
    fake_probe(monkeypatch, None)  # prints nothing: e.g. the framework is not installed
    [check] = doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu"))
    assert check.status == "WARN" and "could not ask paddle about CUDA" in check.detail


def test_real_probe_with_this_environments_framework(tmp_path, monkeypatch):
    """The probe itself, with whichever framework this venv has (a CPU host): NVML reporting an
    H200 that the build cannot use is a FAIL for train.device: gpu."""
    import importlib.util

    framework = next((f for f in ("paddle", "torch") if importlib.util.find_spec(f)), None)
    if framework is None:
        pytest.skip("no framework in this environment")
    imported_before = framework in sys.modules  # by another test of this session
    found = gpu_probe.ask_framework(framework)
    assert imported_before or framework not in sys.modules  # asked in a subprocess
    assert found.error is None, found.error
    assert found.version and found.count == 0  # no GPU on this host
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200])
    [check] = doctor_gpu.check_gpu(gpu_config(tmp_path, "gpu", framework))
    assert check.status == "FAIL", check
    # The reason is the build's: a CPU build or a CUDA build that sees no GPU, or a build for a
    # newer CUDA than the H200's driver here supports (12.4), which is named first.
    assert f"but {framework} cannot use CUDA: " in check.detail, check.detail
    assert f"{framework} {found.version}" in check.detail, check.detail
