"""A framework build that cannot run on the visible GPU's architecture stops the doctor (FAIL,
exit 1) and training at start (DeviceUnavailableError, exit 7), with the command that builds the
right image. Paddle 2.6 lists sm_90 (H100/H200) for its CUDA 12 builds only; its CUDA 11.8
build passes paddle.utils.run_check() there and training then aborts, so the verdict comes from
the build's CUDA version against NVML's compute capability. Checked on the CPU through the
seams: FrameworkCuda facts, ``gpu_probe.nvml_gpus`` and the framework probe's command."""

from __future__ import annotations

import pytest

from tests.test_doctor_gpu import H200, fake_probe, paddle_build
from train import doctor
from train.backends import common, gpu_probe
from train.backends.gpu_probe import FrameworkCuda
from train.backends.gpu_verdicts import PADDLE_CUDA12_BASE, arch_problem, unrunnable_gpu

CUDA12_COMMAND = f"PADDLE_BASE_IMAGE={PADDLE_CUDA12_BASE} docker compose build train-ocr"
A100 = gpu_probe.Gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), "550.54.15", "12.4")
TORCH_ARCHS = ["sm_50", "sm_80", "sm_86", "sm_90"]


def build(framework: str, cuda: str, archs: list[str] | None = None) -> FrameworkCuda:
    """A CUDA build that can use one GPU, as the backends' cuda_facts describe it."""
    version = "2.6.1" if framework == "paddle" else "2.6.0+cu124"
    return FrameworkCuda(framework, version=version, cuda=cuda, compiled=True, count=1, archs=archs)


@pytest.mark.parametrize(
    "fw, capability, verdict",
    [
        (build("paddle", "11.8"), (9, 0), "fatal"),  # Hopper: sm_90 in CUDA 12 builds only
        (build("paddle", "11.2"), (9, 0), "fatal"),  # older still
        (build("paddle", "11.8"), (10, 0), "fatal"),  # Blackwell
        (build("paddle", "12.0"), (9, 0), None),  # the CUDA 12 base
        (build("paddle", "11.8"), (8, 0), None),  # A100
        (build("paddle", "11.8"), (8, 9), None),  # L4, L40S: CUDA 11.8 builds for sm_89
        (build("paddle", "12.0"), (10, 0), "warn"),  # no CUDA 12.8 Paddle 2.6: PTX may JIT
        (build("torch", "12.4", TORCH_ARCHS), (10, 0), "fatal"),  # no sm_10x cubin, no PTX
        (build("torch", "12.4", [*TORCH_ARCHS, "compute_90"]), (10, 0), "warn"),  # PTX JIT
        (build("torch", "12.4", TORCH_ARCHS), (9, 0), None),
    ],
)
def test_which_builds_cannot_run_on_which_gpus(fw, capability, verdict):
    problem = arch_problem(fw, capability)
    assert (None if problem is None else "fatal" if problem.fatal else "warn") == verdict


def test_paddle_cuda11_on_hopper_names_the_problem_and_the_command():
    reason, fix = unrunnable_gpu(build("paddle", "11.8"), [A100, H200])
    assert reason.startswith("Paddle's CUDA 11.8 build cannot run on Hopper and newer (sm_90)")
    assert "CUDA 12 builds only" in reason and reason.endswith("GPU: NVIDIA H200")
    assert fix == f"use the CUDA 12 Paddle base: {CUDA12_COMMAND}"
    assert unrunnable_gpu(build("paddle", "12.0"), [H200]) is None
    assert unrunnable_gpu(build("paddle", "11.8"), [A100]) is None
    assert unrunnable_gpu(build("paddle", "11.8"), []) is None  # nothing known: no verdict
    # The framework's own view of its devices counts too (the doctor's probe describes them).
    described = build("paddle", "11.8")
    described.devices = [{"index": 0, "name": "NVIDIA H100", "capability": [9, 0], "op": "ok"}]
    assert unrunnable_gpu(described, [])[0].endswith("GPU: NVIDIA H100")


# ---------------------------------------------------------------- training's start
@pytest.mark.parametrize("wanted", ["gpu", "auto"])
def test_start_refuses_a_gpu_the_build_cannot_run_on(wanted, monkeypatch):
    """choose_gpu, where both backends decide on the device: a usable CUDA build that cannot
    run on the GPU stops the run (auto too: the GPU needs another image, not the CPU)."""
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200] * 8)
    with pytest.raises(RuntimeError) as raised:
        common.choose_gpu(wanted, build("paddle", "11.8"))
    assert type(raised.value).__name__ == "DeviceUnavailableError"
    said = str(raised.value)
    assert f"train.device is {wanted} but Paddle's CUDA 11.8 build cannot run on Hopper" in said
    assert CUDA12_COMMAND in said and "or set train.device: cpu" in said
    assert common.choose_gpu(wanted, build("paddle", "12.0")) is True
    assert common.choose_gpu("cpu", build("paddle", "11.8")) is False
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [A100])
    assert common.choose_gpu(wanted, build("paddle", "11.8")) is True


@pytest.mark.paddle
def test_paddle_backend_with_a_cuda118_build_on_an_h200_stops_at_start(ocr_lmdb, monkeypatch):
    """The Paddle backend's start (the seam: the build facts paddle reports in this process),
    before it places anything on a GPU."""
    import paddle

    from tests.backends import make_config, start

    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200])
    monkeypatch.setattr(paddle.device, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(paddle.version, "cuda", lambda: "11.8")
    config = make_config("paddle", "ocr", ocr_lmdb, train={"device": "gpu"})
    with pytest.raises(RuntimeError) as raised:
        start(config)
    assert type(raised.value).__name__ == "DeviceUnavailableError"
    assert "Paddle's CUDA 11.8 build cannot run on Hopper and newer (sm_90)" in str(raised.value)
    assert CUDA12_COMMAND in str(raised.value)


# ---------------------------------------------------------------- the doctor's exit code
def test_doctor_exits_1_naming_the_gpu_check(ocr_lmdb, tmp_path, monkeypatch, capsys):
    """python -m train.doctor on an H200 with Paddle's CUDA 11.8 build (its tiny op ran): a
    FAIL line with the command, exit 1; the CUDA 12 build on the same GPU passes that check.
    The rest is this host's: a real config over the fixture data."""
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [H200])
    device = {"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "op": "ok"}
    args = ["--config", "configs/ocr/smoke.yaml", "--output-dir", str(tmp_path / "run")]
    for item in (
        "framework=paddle",
        "train.device=gpu",
        f"data.train={ocr_lmdb}",
        f"data.val={ocr_lmdb}",
        f"data.char_dict={ocr_lmdb.parent / 'charset.txt'}",
    ):
        args += ["--set", item]

    fake_probe(monkeypatch, paddle_build("11.8", 1), device)
    assert doctor.main(args) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("FAIL  GPU vs paddle")]
    assert "NVIDIA H200 (sm_90): Paddle's CUDA 11.8 build cannot run on Hopper" in line
    assert f"fix: use the CUDA 12 Paddle base: {CUDA12_COMMAND}" in out
    assert "GPU vs paddle" in out.splitlines()[-1]  # doctor: N FAIL, ... (the failed checks)

    fake_probe(monkeypatch, paddle_build("12.0", 1), device)
    doctor.main(args)  # this host's other checks decide the exit code
    out = capsys.readouterr().out
    assert "PASS  GPU vs paddle" in out and "GPU vs paddle" not in out.splitlines()[-1]
