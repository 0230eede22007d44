"""Models for the Paddle backend: a CRNN text recognizer (written here: the paddleocr wheel ships
no ppocr.modeling) and paddle.vision's ResNets.

CRNN (Shi, Bai and Yao, 2015): a VGG-style conv stack turns a text-line image [N, C, H, W] into a
feature sequence along the width, a bidirectional LSTM reads it, and a linear layer scores every
time step for CTC. The stack shrinks the height 16x (to 1 via a last full-height conv) and the
width only 4x: a 48 x 320 line gives T = 80 steps, as in PaddleOCR's recognizers, which leaves
CTC room for 25-character labels with blanks between repeated characters.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
from paddle import nn

HEIGHT_STRIDE = 16  # pools 2x2, 2x2, 2x1, 2x1
WIDTH_STRIDE = 4  # pools 2x2, 2x2


@dataclass(frozen=True)
class CrnnWidths:
    """Output channels of the four conv stages, and how many BiLSTM layers read the sequence."""

    stages: tuple[int, int, int, int]
    lstm_layers: int


CRNN_WIDTHS = {
    # VGG widths of the original CRNN and two BiLSTM layers (PaddleOCR's EncoderWithRNN also
    # stacks two): ~8.5M parameters at hidden_size 256, PaddleOCR CRNN scale.
    "crnn": CrnnWidths(stages=(64, 128, 256, 512), lstm_layers=2),
    # About 1/20 of the compute: learns the synthetic smoke data in a few hundred CPU steps.
    "crnn_tiny": CrnnWidths(stages=(16, 32, 64, 96), lstm_layers=1),
}


def _conv_bn_relu(in_channels: int, out_channels: int, kernel=3, padding=1) -> list[nn.Layer]:
    # No conv bias: the BatchNorm right after it adds its own shift.
    return [
        nn.Conv2D(in_channels, out_channels, kernel, padding=padding, bias_attr=False),
        nn.BatchNorm2D(out_channels),
        nn.ReLU(),
    ]


class Crnn(nn.Layer):
    """[N, C, H, W] float images -> [N, T, num_classes] logits, T = W / 4 (class 0 = CTC blank)."""

    def __init__(
        self,
        num_classes: int,
        image_shape: tuple[int, int, int] = (3, 48, 320),
        widths: CrnnWidths = CRNN_WIDTHS["crnn"],
        hidden_size: int = 256,
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % HEIGHT_STRIDE or width % WIDTH_STRIDE:
            raise ValueError(
                f"CRNN needs an image height divisible by {HEIGHT_STRIDE} and a width divisible "
                f"by {WIDTH_STRIDE}, got {height} x {width}; set data.image_shape, e.g. "
                "[3, 48, 320] or [3, 32, 320]"
            )
        s1, s2, s3, s4 = widths.stages
        self.backbone = nn.Sequential(
            *_conv_bn_relu(channels, s1),
            nn.MaxPool2D(2, 2),  # H/2, W/2
            *_conv_bn_relu(s1, s2),
            nn.MaxPool2D(2, 2),  # H/4, W/4
            *_conv_bn_relu(s2, s3),
            *_conv_bn_relu(s3, s3),
            nn.MaxPool2D((2, 1), (2, 1)),  # H/8; the width is the time axis from here on
            *_conv_bn_relu(s3, s4),
            *_conv_bn_relu(s4, s4),
            nn.MaxPool2D((2, 1), (2, 1)),  # H/16
            # A learned full-height conv folds the remaining rows (3 for H = 48) into one.
            *_conv_bn_relu(s4, s4, kernel=(height // HEIGHT_STRIDE, 1), padding=0),
        )
        self.rnn = nn.LSTM(s4, hidden_size, num_layers=widths.lstm_layers, direction="bidirect")
        self.head = nn.Linear(2 * hidden_size, num_classes)
        self.height = height

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


def build_model(
    name: str, num_classes: int, *, image_shape: tuple[int, int, int], hidden_size: int
) -> nn.Layer:
    """The model config.model.name names; num_classes includes the CTC blank for OCR."""
    if name in CRNN_WIDTHS:
        return Crnn(num_classes, image_shape, CRNN_WIDTHS[name], hidden_size)
    if name in ("resnet50", "resnet18"):
        from paddle.vision import models  # deferred: the OCR path does not need it

        # No pretrained weights: training hosts may have no internet, and these are baselines.
        return getattr(models, name)(pretrained=False, num_classes=num_classes)
    raise ValueError(f"unknown model {name!r}; use crnn, crnn_tiny, resnet50 or resnet18")
