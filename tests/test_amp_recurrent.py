"""train.amp and the OCR CRNN's LSTM (torch): the LSTM runs in one known dtype under each
autocast, float32 under bf16 (whose run has no loss scaler) and autocast's float16 under fp16
(train/backends/torch/models.py, recurrent_dtype). Autocast on the CPU reaches the same choice
on a machine without a GPU; the trainer autocasts on CUDA with the same dtypes.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest tests/test_amp_recurrent.py
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from train import tasks  # noqa: E402
from train.backends.torch.models import build_model, recurrent_dtype  # noqa: E402

pytestmark = pytest.mark.torch


def tiny_crnn():
    spec = tasks.get("ocr").model("crnn_tiny")
    return build_model(spec, 11, input_shape=(3, 32, 64), hidden_size=16)


def autocast(dtype):
    """CPU autocast in ``dtype``; None: no autocast."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


@pytest.mark.parametrize(
    "autocast_dtype, lstm_dtype",
    [
        (None, torch.float32),
        (torch.bfloat16, torch.float32),  # autocast would give bf16 here, fp16 on cuDNN
        (torch.float16, torch.float16),  # autocast's own cast, under fp16's loss scaler
    ],
)
def test_crnn_lstm_runs_in_the_policys_dtype_forward_and_backward(autocast_dtype, lstm_dtype):
    torch.manual_seed(0)
    net = tiny_crnn()
    seen: dict[str, torch.dtype] = {}

    def record(module, inputs, outputs):
        seen["input"], seen["output"] = inputs[0].dtype, outputs[0].dtype
        outputs[0].register_hook(lambda grad: seen.update(grad=grad.dtype))

    net.rnn.register_forward_hook(record)
    with autocast(autocast_dtype):
        assert recurrent_dtype("cpu") == lstm_dtype
        scores = net(torch.rand(2, 3, 32, 64))
    scores.float().sum().backward()

    assert seen == {"input": lstm_dtype, "output": lstm_dtype, "grad": lstm_dtype}
    # The head after the LSTM still autocasts: only the recurrent layer is held back.
    assert scores.dtype == (autocast_dtype or torch.float32)
    grads = [p.grad for p in net.rnn.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_recurrent_dtype_reads_the_autocast_of_the_tensors_device_only():
    with torch.autocast("cpu", dtype=torch.float16):
        assert recurrent_dtype("cpu") == torch.float16
        assert recurrent_dtype("cuda") == torch.float32  # CUDA's autocast is off
