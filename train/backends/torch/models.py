"""Models for the PyTorch backend: a CRNN text recognizer (written here) and torchvision ResNets.

CRNN (Shi et al., 2015): a VGG-style conv stack turns a text-line image [N, C, H, W] into a
feature sequence along the width, a bidirectional LSTM reads it, and a linear layer gives
per-time-step class scores for CTC. With the default input of 48 x 320 the conv stack reduces
the height to 1 and the width to 80 time steps (stride 4 along W, like PaddleOCR's recognizers),
enough for the 25-character labels CTC needs room for (repeats are separated by blanks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# The conv stack halves the height four times (pool 2x2, 2x2, 2x1, 2x1) before the last conv
# collapses what is left, so the input height must be a multiple of this.
HEIGHT_STRIDE = 16
WIDTH_STRIDE = 4


@dataclass(frozen=True)
class CrnnSize:
    """Channel widths of the four conv stages and the number of stacked BiLSTM layers."""

    channels: tuple[int, int, int, int]
    lstm_layers: int


CRNN_SIZES = {
    # The original CRNN's VGG widths and two BiLSTM layers: about 8M parameters with
    # hidden_size 256, between PaddleOCR's MobileNetV3 CRNN and its ResNet34-vd CRNN.
    "crnn": CrnnSize(channels=(64, 128, 256, 512), lstm_layers=2),
    # A quarter of the widths and one BiLSTM layer (~0.5M parameters, about 1/20 of the
    # compute): a batch-32 step takes a fraction of a second on two CPU cores. Like any CTC
    # model trained from scratch it first sits on the all-blank plateau (loss ~4.4 per character
    # on the Latin smoke data); there it started reading after ~850 steps, not within 300.
    "crnn_tiny": CrnnSize(channels=(16, 32, 64, 96), lstm_layers=1),
}


def _conv_bn_relu(
    in_channels: int, out_channels: int, kernel: tuple[int, int], padding: tuple[int, int]
) -> list[nn.Module]:
    # No conv bias: the BatchNorm right after it has its own shift.
    return [
        nn.Conv2d(in_channels, out_channels, kernel, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    ]


class Crnn(nn.Module):
    """[N, C, H, W] float images -> [N, T, num_classes] scores, T = W / 4 (class 0 = CTC blank)."""

    def __init__(
        self,
        num_classes: int,
        image_shape: tuple[int, int, int] = (3, 48, 320),
        size: CrnnSize = CRNN_SIZES["crnn"],
        hidden_size: int = 256,
    ) -> None:
        super().__init__()
        in_channels, height, width = image_shape
        if height % HEIGHT_STRIDE or width % WIDTH_STRIDE:
            raise ValueError(
                f"CRNN needs an input height divisible by {HEIGHT_STRIDE} and a width divisible "
                f"by {WIDTH_STRIDE}, got {height} x {width}; set data.image_shape, e.g. "
                "[3, 48, 320] or [3, 32, 320]"
            )
        c1, c2, c3, c4 = size.channels
        same = (1, 1)
        layers: list[nn.Module] = [
            *_conv_bn_relu(in_channels, c1, (3, 3), same),
            nn.MaxPool2d(2, 2),  # H/2, W/2
            *_conv_bn_relu(c1, c2, (3, 3), same),
            nn.MaxPool2d(2, 2),  # H/4, W/4
            *_conv_bn_relu(c2, c3, (3, 3), same),
            *_conv_bn_relu(c3, c3, (3, 3), same),
            nn.MaxPool2d((2, 1), (2, 1)),  # H/8: keep the width, it becomes the time axis
            *_conv_bn_relu(c3, c4, (3, 3), same),
            *_conv_bn_relu(c4, c4, (3, 3), same),
            nn.MaxPool2d((2, 1), (2, 1)),  # H/16
            # A learned collapse of the remaining rows (3 for H=48) to one, instead of adaptive
            # pooling, whose CUDA backward has no deterministic kernel.
            *_conv_bn_relu(c4, c4, (height // HEIGHT_STRIDE, 1), (0, 0)),
        ]
        self.backbone = nn.Sequential(*layers)
        self.rnn = nn.LSTM(
            c4, hidden_size, num_layers=size.lstm_layers, bidirectional=True, batch_first=True
        )
        self.head = nn.Linear(2 * hidden_size, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(images)  # [N, C, 1, T]
        sequence = features.squeeze(2).permute(0, 2, 1)  # [N, T, C]
        sequence, _ = self.rnn(sequence)
        return self.head(sequence)


def build_model(
    name: str, num_classes: int, *, image_shape: tuple[int, int, int], hidden_size: int
) -> nn.Module:
    """The model config.model.name names; num_classes includes the CTC blank for OCR."""
    if name in CRNN_SIZES:
        return Crnn(num_classes, image_shape, CRNN_SIZES[name], hidden_size)
    if name in ("resnet50", "resnet18"):
        import torchvision  # deferred: the OCR path does not need it

        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    raise ValueError(f"unknown model {name!r}; use crnn, crnn_tiny, resnet50 or resnet18")
