"""The backends' GPU-only branches, reached on the CPU through seams: each test stands in for
the one thing only a GPU has (an enabled fp16 loss scaler, the number of visible GPUs, CUDA
tensors, NCCL, the launcher's device reset) and checks what the backend does with it.
scripts/gpu_check.sh runs the same paths on a real GPU.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" tests/test_gpu_paths.py
    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" tests/test_gpu_paths.py
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tests.backends import build, first_batches, make_config, start


@pytest.fixture
def data_of(ocr_lmdb, image_h5):
    return {"ocr": ocr_lmdb, "resnet50": image_h5}


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
@pytest.mark.parametrize("task", ["ocr", "resnet50"])
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
    backend.amp_dtype = "float16"
    backend.scaler = paddle_fp16_scaler(monkeypatch, init_loss_scaling=1024.0)
    assert isinstance(backend.optimizer._param_groups[0], dict)  # decay / no-decay groups

    def weights():
        return [p.numpy().copy() for p in backend.net.parameters() if p.trainable]

    before = weights()
    losses = [backend.to_float(backend.train_step(batch)) for batch in batches]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert any((a != b).any() for a, b in zip(before, weights()))  # the optimizer stepped
    assert backend.scaler.is_enable()  # still scaling: fp16 is the AMP dtype
    assert backend.scaler._scale.item() == 1024.0  # no overflow: the scale stays

    # Overflowing gradients: the step is skipped and the scale halves.
    stepped = weights()
    poisoned = dict(batches[0], image=batches[0]["image"] * float("nan"))
    backend.train_step(poisoned)
    assert backend.scaler._scale.item() == 512.0
    for a, b in zip(stepped, weights()):
        np.testing.assert_array_equal(a, b)
