"""Models for the Paddle backend, and the loss and decoding of each loss kind.

Which models exist, and their sizes, is train/tasks.py's; here each model family has its
builder: "crnn" (written here, layer by layer from train/backends/common.py's plan: the
paddleocr wheel ships no ppocr.modeling), "resnet" (paddle.vision's) and "ppocrv4"
(train/backends/paddle/ppocrv4.py). HEADS holds, by a task's loss kind (Task.loss), what the
backend does with the model's logits: the loss, and their decoding into the predictions the
task's metric reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from train.backends.common import Conv, CrnnPlan, Pool, build_layers, crnn_plan, pad_top_k
from train.tasks import Model


def _max_pool(step: Pool) -> nn.Layer:
    return nn.MaxPool2D(step.size, step.size)


def _conv_bn_relu(step: Conv) -> list[nn.Layer]:
    channels = (step.in_channels, step.out_channels)
    conv = nn.Conv2D(*channels, step.kernel, padding=step.padding, bias_attr=False)
    return [conv, nn.BatchNorm2D(step.out_channels), nn.ReLU()]


class Crnn(nn.Layer):
    """[N, C, H, W] float images -> [N, T, num_classes] logits (train/backends/common.py's
    plan), for images exactly plan.height high."""

    def __init__(self, plan: CrnnPlan):
        super().__init__()
        self.backbone = nn.Sequential(*build_layers(plan.backbone, _conv_bn_relu, _max_pool))
        self.rnn = nn.LSTM(*plan.rnn, direction="bidirect")
        self.head = nn.Linear(*plan.head)
        self.height = plan.height

    def forward(self, images: paddle.Tensor) -> paddle.Tensor:
        if images.shape[2] != self.height:  # the last conv is sized for this height
            raise ValueError(
                f"CRNN built for images {self.height} pixels high got {images.shape[2]}: "
                "the dataset and the model must use the same data.image_shape"
            )
        features = self.backbone(images)  # [N, C, 1, T]
        sequence = features.squeeze(2).transpose([0, 2, 1])  # [N, T, C]
        sequence, _ = self.rnn(sequence)
        return self.head(sequence)


def _crnn(model: Model, num_classes: int, input_shape, hidden_size: int) -> nn.Layer:
    return Crnn(crnn_plan(model.widths, input_shape, hidden_size, num_classes))


def _resnet(model: Model, num_classes: int, input_shape, hidden_size: int) -> nn.Layer:
    from paddle.vision import models  # deferred: the OCR path does not need it

    # No pretrained weights: training hosts may have no internet, and these are baselines.
    return getattr(models, model.name)(pretrained=False, num_classes=num_classes)


def _ppocrv4(model: Model, num_classes: int, input_shape, hidden_size: int) -> nn.Layer:
    from train.backends.paddle.ppocrv4 import PpocrV4Rec

    return PpocrV4Rec(num_classes)  # its sizes are the released model's (hidden_size unused)


FAMILIES: dict[str, Callable[[Model, int, tuple, int], nn.Layer]] = {
    "crnn": _crnn,
    "resnet": _resnet,
    "ppocrv4": _ppocrv4,
}


def build_model(
    model: Model, num_classes: int, *, input_shape: tuple[int, int, int], hidden_size: int
) -> nn.Layer:
    """``model`` (train/tasks.py) with ``num_classes`` outputs (the CTC blank included for
    OCR) for inputs [C, H, W]."""
    return FAMILIES[model.family](model, num_classes, input_shape, hidden_size)


# ---------------------------------------------------------------- per loss kind: loss and decoding
@dataclass(frozen=True)
class Head:
    loss: Callable[[paddle.Tensor, dict[str, paddle.Tensor]], paddle.Tensor]  # float32 logits
    decode: Callable[[paddle.Tensor], np.ndarray]  # logits -> int64 predictions (the contract's)
    # logits -> what an exported model outputs: probabilities over the last axis (one class of
    # several), or each output's own (multi_label: independent yes/no per tag)
    probabilities: Callable[[paddle.Tensor], paddle.Tensor] = lambda logits: F.softmax(logits, -1)


def _ctc_loss(logits: paddle.Tensor, batch: dict[str, paddle.Tensor]) -> paddle.Tensor:
    # Paddle's CTC (warp-ctc) takes unnormalized logits [T, N, C] and applies softmax itself
    # (checked against a reference CTC: log-softmaxed input gives the same loss).
    # reduction="mean" divides each sample's loss by its label length, then averages.
    logits = logits.transpose([1, 0, 2])
    steps, size = logits.shape[0], logits.shape[1]
    return F.ctc_loss(
        logits,
        batch["label"].astype("int32"),
        paddle.full([size], steps, dtype="int64"),
        batch["length"].astype("int64"),
        blank=0,
        reduction="mean",
    )


def _top5(logits: paddle.Tensor) -> np.ndarray:
    return pad_top_k(paddle.topk(logits, min(5, logits.shape[1]), axis=1)[1].numpy())


HEADS = {  # by Task.loss (train/tasks.py's LOSSES)
    # Class per time step [N, T] (0 = blank); the metric decodes CTC greedily.
    "ctc": Head(_ctc_loss, lambda logits: logits.argmax(axis=2).numpy().astype(np.int64)),
    # The mean taken here: cross_entropy's own reduction="mean" reads the ignore_index count
    # on the host (`if paddle.count_nonzero(...) > 0`), a device synchronization every step.
    "cross_entropy": Head(
        lambda logits, batch: F.cross_entropy(logits, batch["label"], reduction="none").mean(),
        _top5,
    ),
    # One independent yes/no per tag [N, tags]: a tag is predicted where its logit is > 0
    # (probability > 0.5), as train/inference.py decodes the exported sigmoid.
    "multi_label": Head(
        lambda logits, batch: F.binary_cross_entropy_with_logits(
            logits, batch["label"].astype("float32")
        ),
        lambda logits: (logits > 0).numpy().astype(np.int64),
        F.sigmoid,
    ),
}
