"""The backends' GPU-only branches, reached on the CPU through seams: each test stands in for
the one thing only a GPU has (an enabled fp16 loss scaler, the number of visible GPUs, CUDA
tensors, NCCL, the launcher's device reset) and checks what the backend does with it.
scripts/gpu_check.sh runs the same paths on a real GPU.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" tests/test_gpu_paths.py
    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" tests/test_gpu_paths.py
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.backends import build, first_batches, make_config, start
from tests.test_train import train_cmd

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def data_of(ocr_lmdb, image_h5):
    return {"ocr": ocr_lmdb, "classification": image_h5}


# ---------------------------------------------------------------- Paddle: fp16 loss scaling
class _GpuPlace:
    """What GradScaler asks of the expected place: on the CPU it disables itself."""

    def is_gpu_place(self) -> bool:
        return True

    def is_xpu_place(self) -> bool:
        return False

    def is_custom_place(self) -> bool:
        return False


def paddle_fp16_scaler(monkeypatch, init_loss_scaling: float):
    """paddle.amp.GradScaler enabled as on a GPU (the seam: the tracer's place while it is
    built); its scaling, unscaling and overflow check then run on CPU tensors."""
    paddle = pytest.importorskip("paddle")
    from paddle.amp import grad_scaler

    with monkeypatch.context() as patch:
        place = SimpleNamespace(_expected_place=_GpuPlace())
        patch.setattr(grad_scaler, "_dygraph_tracer", lambda: place)
        scaler = paddle.amp.GradScaler(init_loss_scaling=init_loss_scaling)
    assert scaler.is_enable()
    return scaler


@pytest.mark.paddle
@pytest.mark.parametrize("task", ["ocr", "classification"])
def test_paddle_fp16_loss_scaling_steps_with_parameter_groups_and_clipping(
    task, data_of, monkeypatch
):
    optim = {"name": "adamw", "lr": 1e-3, "grad_clip": 5.0, "weight_decay": 1e-4}
    config = make_config("paddle", task, data_of[task], optim=optim)
    backend = start(config)
    batches, num_classes = first_batches(backend, config, 3)
    build(backend, config, num_classes, total_steps=10)
    # As build() sets them for train.amp: fp16 on a GPU. On the CPU auto_cast computes in
    # float32, but records float16 as the AMP dtype, which the scaler checks in scale().
    backend.trainer.amp_dtype = "float16"
    backend.trainer.scaler = paddle_fp16_scaler(monkeypatch, init_loss_scaling=1024.0)
    assert isinstance(backend.trainer.optimizer._param_groups[0], dict)  # decay / no-decay groups

    def weights():
        return [p.numpy().copy() for p in backend.trainer.net.parameters() if p.trainable]

    before = weights()
    losses = [backend.trainer.to_float(backend.trainer.train_step(batch)) for batch in batches]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert any((a != b).any() for a, b in zip(before, weights()))  # the optimizer stepped
    assert backend.trainer.scaler.is_enable()  # still scaling: fp16 is the AMP dtype
    assert backend.trainer.scaler._scale.item() == 1024.0  # no overflow: the scale stays

    # Overflowing gradients: the step is skipped and the scale halves.
    stepped = weights()
    poisoned = dict(batches[0], image=batches[0]["image"] * float("nan"))
    backend.trainer.train_step(poisoned)
    assert backend.trainer.scaler._scale.item() == 512.0
    for a, b in zip(stepped, weights()):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- torch: CUDA RNG on resume
class _Generator:
    """A CUDA generator's stand-in: remembers the state it is given."""

    def __init__(self) -> None:
        self.state = None

    def set_state(self, state) -> None:
        self.state = state


def visible_cuda_generators(monkeypatch, count: int) -> list[_Generator]:
    """``count`` GPUs as torch.cuda.set_rng_state sees them (the seam: torch.cuda's device
    count and generator tuple, and its lazy-init queue run at once as on an initialized GPU)."""
    torch = pytest.importorskip("torch")
    cuda_random = pytest.importorskip("torch.cuda.random")

    generators = [_Generator() for _ in range(count)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "default_generators", tuple(generators), raising=False)
    monkeypatch.setattr(cuda_random, "_lazy_call", lambda callback, **kw: callback())
    return generators


@pytest.mark.torch
@pytest.mark.parametrize("visible", [2, 4, 8])
def test_torch_resume_restores_the_cuda_rng_of_the_gpus_there_are(visible, monkeypatch, caplog):
    """Saved on 4 GPUs (get_rng_state_all: one state per visible GPU), resumed where 2, 4 or 8
    are visible: the first min(saved, visible) are restored, and the log says so."""
    torch = pytest.importorskip("torch")
    from train.backends.torch import state as torch_state

    saved = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]
    state = {**torch_state._rng_state(torch.device("cpu")), "torch_cuda": saved}
    generators = visible_cuda_generators(monkeypatch, visible)
    with caplog.at_level("INFO"):
        torch_state._set_rng_state(state, torch.device("cuda", 0))
    restored = min(4, visible)
    for index, generator in enumerate(generators):
        if index < restored:
            assert torch.equal(generator.state, saved[index]), index
        else:
            assert generator.state is None, index
    said = [r.getMessage() for r in caplog.records if "CUDA RNG states" in r.getMessage()]
    assert len(said) == (visible != 4), said
    if visible != 4:
        assert f"of 4 GPU(s), {visible} are visible: restoring GPUs 0-{restored - 1}" in said[0]


# ---------------------------------------------------------------- process group start
def launcher_env(monkeypatch, framework: str) -> None:
    """Rank 0 of 2, as torchrun or paddle.distributed.launch (on a GPU host) sets it."""
    for name in ("PADDLE_PG_TIMEOUT", "PADDLE_DISTRI_BACKEND"):  # the backend sets them
        monkeypatch.setenv(name, "")  # restored (removed) after the test...
        monkeypatch.delenv(name)  # ...and absent during it
    if framework == "torch":
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
    else:
        env = {"PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "0", "PADDLE_LOCAL_RANK": "0"}
        for name, value in {**env, "FLAGS_selected_gpus": "0"}.items():
            monkeypatch.setenv(name, value)


@pytest.mark.torch
def test_torch_process_group_gets_the_configured_timeout(ocr_lmdb, monkeypatch):
    """train.dist_timeout_s reaches init_process_group (NCCL's own default is 10 minutes)."""
    pytest.importorskip("torch")
    from datetime import timedelta

    from train.backends.torch import backend as torch_backend
    from train.backends.torch import runtime as torch_runtime

    calls = []
    monkeypatch.setattr(torch_runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch_runtime.dist, "init_process_group", lambda **kw: calls.append(kw))
    launcher_env(monkeypatch, "torch")
    config = make_config("torch", "ocr", ocr_lmdb, train={"device": "cpu", "dist_timeout_s": 5400})
    info = torch_backend.TorchBackend(config.task, config.train).runtime.init_distributed()
    assert info.world_size == 2
    assert len(calls) == 1 and calls[0]["backend"] == "gloo"
    assert calls[0]["timeout"] == timedelta(seconds=5400)


@pytest.mark.paddle
def test_paddle_cpu_rank_under_the_launcher_stays_on_the_cpu(ocr_lmdb, monkeypatch):
    """device: cpu under paddle.distributed.launch on a GPU host: init_parallel_env resets the
    expected place (to the launcher's GPU on a CUDA build), so the backend sets the CPU again
    after it, and asks for gloo, not NCCL; the process group gets train.dist_timeout_s."""
    paddle = pytest.importorskip("paddle")
    from train.backends.paddle import backend as paddle_backend
    from train.backends.paddle import runtime as paddle_runtime

    events = []

    def init_parallel_env():
        events.append(
            (
                "init_parallel_env",
                os.environ.get("PADDLE_DISTRI_BACKEND"),
                os.environ.get("PADDLE_PG_TIMEOUT"),
            )
        )

    monkeypatch.setattr(paddle_runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(paddle_runtime.dist, "init_parallel_env", init_parallel_env)
    monkeypatch.setattr(paddle, "set_device", lambda device: events.append(("set_device", device)))
    launcher_env(monkeypatch, "paddle")
    config = make_config("paddle", "ocr", ocr_lmdb, train={"device": "cpu", "dist_timeout_s": 5400})
    info = paddle_backend.PaddleBackend(config.task, config.train).runtime.init_distributed()
    assert info.world_size == 2
    assert events[-2:] == [
        ("init_parallel_env", "gloo", "5400000"),
        ("set_device", "cpu"),
    ], events


# ---------------------------------------------------------------- torch: Adam state on resume
@pytest.mark.torch
def test_torch_resume_keeps_adam_step_counts_on_the_cpu(ocr_lmdb, tmp_path, monkeypatch):
    """A checkpoint resumed on a GPU: whatever torch.load maps onto cuda:0 stands in as a
    tensor that says it lives there (a CPU build has no CUDA tensor). Adam's "step" counts must
    end as plain tensors beside their parameters (here the CPU), where the fused Adam reads them
    on the device: never counts of an unfused Adam on CUDA, which syncs on each one's .item()
    every step."""
    torch = pytest.importorskip("torch")
    from torch.utils._pytree import tree_map

    class OnCuda(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def device(self):
            return torch.device("cuda", 0)

    real_load = torch.load

    def load(path, map_location=None, **kwargs):
        state = real_load(path, map_location="cpu", **kwargs)
        if map_location is not None and torch.device(map_location).type == "cuda":
            state = tree_map(lambda v: v.as_subclass(OnCuda) if torch.is_tensor(v) else v, state)
        return state

    config = make_config("torch", "ocr", ocr_lmdb, optim={"name": "adam"})
    backend = start(config)
    batches, num_classes = first_batches(backend, config, 2)
    build(backend, config, num_classes, total_steps=4)
    for batch in batches:
        backend.trainer.train_step(batch)
    steps = [state["step"] for state in backend.trainer.optimizer.state.values()]
    assert steps and all(s.device.type == "cpu" for s in steps)  # with their parameters
    backend.state.save_state(tmp_path)

    monkeypatch.setattr(torch, "load", load)
    backend.runtime.device = torch.device(
        "cuda", 0
    )  # the resumed run's device, as torch.load sees it
    backend.state.load_state(tmp_path)
    steps = [state["step"] for state in backend.trainer.optimizer.state.values()]
    assert steps and all(type(s) is torch.Tensor and s.device.type == "cpu" for s in steps)
    assert all(float(s) == 2.0 for s in steps)


# ---------------------------------------------------------------- train.device: gpu and auto
FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]


def smoke_command(framework: str, out: Path, ocr_lmdb: Path, *sets: str) -> list[str]:
    """Two OCR smoke steps in the main process (no workers), then ``sets``."""
    fast = ["train.max_steps=2", "train.log_every=1", "loader.num_workers=0"]
    fast += ["optim.warmup_steps=0", "loader.batch_size=8"]
    return train_cmd("ocr", framework, out, [*fast, *sets], ocr_lmdb=ocr_lmdb)


def on_a_gpu_host() -> dict[str, str]:
    """The environment of a python -m train whose pynvml is the stand-in: NVML sees 8 H200s."""
    path = os.pathsep.join([str(ROOT / "tests" / "stand_ins"), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path}


def framework_can_use_cuda(framework: str) -> bool:
    if framework == "torch":
        import torch

        return torch.cuda.is_available()
    import paddle

    return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def as_a_cpu_build(framework: str, monkeypatch) -> None:
    """The framework in this process says it is a CPU build (the seam: its own build facts)."""
    if framework == "torch":
        import torch

        monkeypatch.setattr(torch.version, "cuda", None)
    else:
        import paddle

        monkeypatch.setattr(paddle.device, "is_compiled_with_cuda", lambda: False)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_device_gpu_without_a_usable_gpu_fails_fast_with_the_reason(framework, ocr_lmdb, tmp_path):
    """python -m train with train.device: gpu where the framework can use no GPU (this host's
    build: a CPU build, or a CUDA build without a GPU) while NVML sees 8: exit 7 at the start,
    one line naming the cause and the fix, no traceback."""
    pytest.importorskip(framework)
    if framework_can_use_cuda(framework):
        pytest.skip(f"{framework} can use a GPU here: train.device: gpu would train")
    command = smoke_command(framework, tmp_path / "run", ocr_lmdb, "train.device=gpu")
    result = subprocess.run(
        command, cwd=ROOT, env=on_a_gpu_host(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 7, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    # The reason is the build's: a CPU build or a CUDA build that sees no GPU, or a build for a
    # newer CUDA than the stand-in's driver supports (12.4, as NVML reports it), named first.
    assert line.startswith("error: train.device is gpu but ") and f"{framework} " in line, line
    assert any(why in line for why in ("is a CPU build", "sees no GPU", "driver too old")), line
    assert "(8 GPU(s) visible to the driver). HINT: " in line, line


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_device_auto_on_the_cpu_while_nvml_sees_gpus_says_so_loudly(
    framework, ocr_lmdb, monkeypatch, caplog
):
    pytest.importorskip(framework)
    from train.backends import gpu_probe

    h200 = gpu_probe.Gpu(0, "NVIDIA H200", (9, 0), "550.54.15", "12.4")
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [h200] * 8)
    as_a_cpu_build(framework, monkeypatch)
    config = make_config(framework, "ocr", ocr_lmdb, train={"device": "auto"})
    with caplog.at_level("WARNING"):
        backend = start(config)
    assert not backend.runtime.uses_gpu
    (said,) = [r for r in caplog.records if "TRAINING ON THE CPU" in r.getMessage()]
    assert said.levelname == "WARNING"
    assert "8 GPU(s) idle" in said.getMessage() and "is a CPU build" in said.getMessage()


@pytest.mark.torch
@pytest.mark.parametrize(
    "visible, driver_cuda, reason",
    [
        ("", "12.4", "CUDA_VISIBLE_DEVICES='' hides every GPU"),
        (None, "11.8", "supports CUDA up to 11.8, torch 2.6.0 (CUDA 12.4 build) needs CUDA 12.4"),
    ],
)
def test_device_gpu_with_a_cuda_build_that_sees_no_gpu_names_the_cause(
    visible, driver_cuda, reason, ocr_lmdb, monkeypatch
):
    """A CUDA build of torch (the seam: torch.version.cuda, torch.cuda.is_available) that
    cannot use the GPUs NVML sees: hidden by CUDA_VISIBLE_DEVICES, or a driver too old."""
    torch = pytest.importorskip("torch")
    from train.backends import gpu_probe

    h200 = gpu_probe.Gpu(0, "NVIDIA H200", (9, 0), "535.104", driver_cuda)
    monkeypatch.setattr(gpu_probe, "nvml_gpus", lambda: [h200] * 8)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = make_config("torch", "ocr", ocr_lmdb, train={"device": "gpu"})
    with pytest.raises(RuntimeError) as raised:
        start(config)
    assert type(raised.value).__name__ == "DeviceUnavailableError"
    assert reason in str(raised.value)


# ---------------------------------------------------------------- torch: the prefetcher knob
@pytest.mark.torch
@pytest.mark.parametrize("prefetch", [True, False])
def test_torch_device_prefetch_knob_picks_the_cuda_path(prefetch, ocr_lmdb, monkeypatch):
    """loader.device_prefetch on CUDA (the seam: the backend's device and its side-stream
    prefetcher, recorded): on, batches come from _cuda_prefetch; off, a plain copy each."""
    torch = pytest.importorskip("torch")
    from datasets.sampler import EpochSampler
    from tests.backends import open_dataset

    config = make_config("torch", "ocr", ocr_lmdb, loader={"device_prefetch": prefetch})
    backend = start(config)
    dataset, _ = open_dataset(config)
    loader = backend.batches.make_loader(dataset, EpochSampler(len(dataset)), config.loader, True)
    used = []
    monkeypatch.setattr(
        backend.batches, "_cuda_prefetch", lambda loader: used.append("side stream") or []
    )
    monkeypatch.setattr(backend.batches, "_to_device", lambda batch: used.append("copy") or batch)
    backend.runtime.device = torch.device("cuda", 0)
    list(backend.batches.device_batches(loader))
    assert used == (["side stream"] if prefetch else ["copy"] * len(loader))


# ---------------------------------------------------------------- TF32, alike in both
def _set_torch_tf32(matmul: bool, cudnn: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tf32_is_on_for_matmuls_and_convolutions_in_both_frameworks(
    framework, ocr_lmdb, monkeypatch, request
):
    """Paddle 2.6 uses TF32 for cuBLAS and cuDNN by default; torch, for convolutions only.
    Both backends now ask for it in both (the seam for Paddle: its CUDA build's switches)."""
    pytest.importorskip(framework)
    switched = {}
    if framework == "torch":
        import torch

        # Set and restored by hand: torch.backends.cuda.matmul answers allow_tf32 through
        # __getattr__/__setattr__, with no attribute of its own, so pytest 9's monkeypatch
        # would undo its set with delattr, which that object refuses.
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        request.addfinalizer(lambda: _set_torch_tf32(*before))
        _set_torch_tf32(False, False)
    else:
        import paddle

        for name in ("set_cublas_switch", "set_cudnn_switch"):
            recorder = lambda on, name=name: switched.__setitem__(name, on)  # noqa: E731
            monkeypatch.setattr(paddle.base.core, name, recorder, raising=False)
    start(make_config(framework, "ocr", ocr_lmdb))
    if framework == "torch":
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    else:
        assert switched == {"set_cublas_switch": True, "set_cudnn_switch": True}
