"""Models for the PyTorch backend, and the loss and decoding of each loss kind.

Which models exist, and their sizes, is train/tasks.py's; here each model family has its
builder: "crnn" (written here, layer by layer from train/backends/common.py's plan),
"resnet" (torchvision's) and "ppocrv4" (train/backends/torch/ppocrv4.py). HEADS holds, by a
task's loss kind (Task.loss), what the backend does with the model's scores: the loss, and
their decoding into the predictions the task's metric reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from train.backends.common import Conv, CrnnPlan, Pool, build_layers, crnn_plan, pad_top_k
from train.tasks import Model


def _max_pool(step: Pool) -> nn.Module:
    return nn.MaxPool2d(step.size, step.size)


def _conv_bn_relu(step: Conv) -> list[nn.Module]:
    conv = nn.Conv2d(
        step.in_channels, step.out_channels, step.kernel, padding=step.padding, bias=False
    )
    return [conv, nn.BatchNorm2d(step.out_channels), nn.ReLU(inplace=True)]


class Crnn(nn.Module):
    """[N, C, H, W] float images -> [N, T, num_classes] scores (train/backends/common.py's plan)."""

    def __init__(self, plan: CrnnPlan):
        super().__init__()
        self.backbone = nn.Sequential(*build_layers(plan.backbone, _conv_bn_relu, _max_pool))
        self.rnn = nn.LSTM(*plan.rnn, bidirectional=True, batch_first=True)
        self.head = nn.Linear(*plan.head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(images)  # [N, C, 1, T]
        sequence = features.squeeze(2).permute(0, 2, 1)  # [N, T, C]
        return self.head(self._recurrent(sequence))

    def _recurrent(self, sequence: torch.Tensor) -> torch.Tensor:
        """The LSTM over ``sequence``, in recurrent_dtype's dtype."""
        device_type = sequence.device.type
        if torch.is_autocast_enabled(device_type) and recurrent_dtype(device_type) == torch.float32:
            with torch.autocast(device_type, enabled=False):
                return self.rnn(sequence.float())[0]
        return self.rnn(sequence)[0]


def recurrent_dtype(device_type: str) -> torch.dtype:
    """The dtype the CRNN's LSTM (float32 weights) runs in under the autocast in force on
    ``device_type``: float16 under fp16 autocast, float32 under any other autocast or none.

    fp16 is autocast's own RNN path (cuDNN's fp16 LSTM), whose gradients train.amp fp16's loss
    scaler guards. Under bf16, torch 2.6 has no bf16 LSTM to hand over to: autocast gives the
    ``lstm`` op no cast of its own (ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP lists only
    the cells), so the input's dtype decides the path. A float32 input is one cuDNN takes
    (at::native::cudnn_is_acceptable: double, float and half only) and reaches ``_cudnn_rnn``,
    whose autocast wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp, _cudnn_rnn_cast_reflatten)
    casts the input, weights and states to float16 whatever the autocast dtype: fp16 gradients
    with no loss scaler (train.amp bf16 runs without one), which can underflow. A bf16 input (the
    convolutions' output under bf16) is not cuDNN's: the LSTM runs step by step in ATen's own
    kernels (linear, _thnn_fused_lstm_cell), slower, with the cell state rounded to bf16 at every
    step. float32 with autocast off is cuDNN's float32 LSTM: one known dtype, in full range."""
    autocast = torch.is_autocast_enabled(device_type)
    fp16 = autocast and torch.get_autocast_dtype(device_type) == torch.float16
    return torch.float16 if fp16 else torch.float32


def _crnn(model: Model, num_classes: int, input_shape, hidden_size: int) -> nn.Module:
    return Crnn(crnn_plan(model.widths, input_shape, hidden_size, num_classes))


def _resnet(model: Model, num_classes: int, input_shape, hidden_size: int) -> nn.Module:
    import torchvision  # deferred: the OCR path does not need it

    # No pretrained weights: training hosts may have no internet, and these are baselines.
    return getattr(torchvision.models, model.name)(weights=None, num_classes=num_classes)


def _ppocrv4(model: Model, num_classes: int, input_shape, hidden_size: int) -> nn.Module:
    from train.backends.torch.ppocrv4 import PpocrV4Rec

    return PpocrV4Rec(num_classes)  # its sizes are the released model's (hidden_size unused)


@dataclass(frozen=True)
class Family:
    build: Callable[[Model, int, Any, int], nn.Module]
    # Weights and batches in channels_last on CUDA (memory_format below): cuDNN's tensor-core
    # convolutions prefer it (the CRNN's LSTM gains nothing).
    channels_last: bool


FAMILIES = {
    "crnn": Family(_crnn, channels_last=False),
    "resnet": Family(_resnet, True),
    "ppocrv4": Family(_ppocrv4, channels_last=False),  # depthwise convs: not measured on GPU
}


def memory_format(device_type: str, family: str | None) -> torch.memory_format:
    """The one layout of a family's weights and of its batches on ``device_type``: the backend
    gives both the same, so no convolution converts its input or its weights on each call.
    channels_last on CUDA for the families marked so; plain NCHW everywhere else (the CPU
    kernels here are tuned for it), and before a model is built (``family`` None)."""
    if device_type == "cuda" and family is not None and FAMILIES[family].channels_last:
        return torch.channels_last
    return torch.contiguous_format


def build_model(
    model: Model, num_classes: int, *, input_shape: tuple[int, int, int], hidden_size: int
) -> nn.Module:
    """``model`` (train/tasks.py) with ``num_classes`` outputs (the CTC blank included for
    OCR) for inputs [C, H, W]."""
    return FAMILIES[model.family].build(model, num_classes, input_shape, hidden_size)


# ---------------------------------------------------------------- per loss kind: loss and decoding
@dataclass(frozen=True)
class Head:
    loss: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]  # float32 scores
    decode: Callable[[torch.Tensor], np.ndarray]  # scores -> int64 predictions (the contract's)
    # scores -> what an exported model outputs: probabilities over the last axis (one class of
    # several), or each output's own (multi_label: independent yes/no per tag)
    probabilities: Callable[[torch.Tensor], torch.Tensor] = lambda scores: scores.softmax(-1)


# zero_infinity: a label too long for the T time steps gives an infinite loss; count it as zero
# instead of poisoning the batch with NaN gradients.
_CTC = nn.CTCLoss(blank=0, zero_infinity=True)


def _ctc_loss(scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    log_probs = scores.log_softmax(2).permute(1, 0, 2)  # [T, N, C] as CTCLoss wants
    steps, size = log_probs.shape[:2]
    input_lengths = torch.full((size,), steps, dtype=torch.long, device=log_probs.device)
    return _CTC(log_probs, batch["label"].long(), input_lengths, batch["length"].long())


def _top5(scores: torch.Tensor) -> np.ndarray:
    top = scores.topk(min(5, scores.shape[1]), dim=1).indices
    return pad_top_k(top.cpu().numpy())


HEADS = {  # by Task.loss (train/tasks.py's LOSSES)
    # Class per time step [N, T] (0 = blank); the metric decodes CTC greedily.
    "ctc": Head(_ctc_loss, lambda scores: scores.argmax(2).cpu().numpy().astype(np.int64)),
    "cross_entropy": Head(lambda scores, batch: F.cross_entropy(scores, batch["label"]), _top5),
    # One independent yes/no per tag [N, tags]: a tag is predicted where its score is > 0
    # (probability > 0.5), as train/inference.py decodes the exported sigmoid.
    "multi_label": Head(
        lambda scores, batch: F.binary_cross_entropy_with_logits(scores, batch["label"].float()),
        lambda scores: (scores > 0).cpu().numpy().astype(np.int64),
        torch.sigmoid,
    ),
}
