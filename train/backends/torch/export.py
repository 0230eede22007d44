"""A trained torch model out of the repository: ONNX, checked with ONNX Runtime by the tests.

The exported graph takes the normalized NCHW float32 batch of the preprocessing contract
(train/inference.py, preprocess.json) and returns probabilities (softmax, or a sigmoid per tag
for multi-label tasks). For OCR it also reads an input of exactly 0 as the padding the model was
trained with (see Deployed), and the batch and the line width are dynamic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from train.backends.common import ExporterBase

ONNX_FILE = "model.onnx"
FORMATS = ("onnx",)


class Deployed(nn.Module):
    """The trained network with what inference needs around it: its loss kind's probabilities
    (softmax over the classes, a sigmoid per tag), and for OCR the padding value. Training
    pads lines with uint8 128, which normalizes to ``pad`` (1/255); PaddleOCR's
    resize_norm_img pads with 0 after normalization, a value no pixel normalizes to
    ((p / 255 - 0.5) / 0.5 is never 0 for an integer p), so 0 is read as padding and both
    preprocessings give the model the inputs it was trained on."""

    def __init__(self, net: nn.Module, pad: float | None, probabilities) -> None:
        """``probabilities``: the task's loss kind's (HEADS' Head.probabilities)."""
        super().__init__()
        self.net, self.pad, self.probabilities = net, pad, probabilities

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.pad is not None:
            images = torch.where(images == 0, torch.full_like(images, self.pad), images)
        return self.probabilities(self.net(images))


def export(
    net: nn.Module, fmt: str, directory: Path, input_shape, pad: float | None, probabilities
) -> list[Path]:
    if fmt not in FORMATS:
        raise ValueError(f"torch models export to {', '.join(FORMATS)}, not {fmt}")
    deployed = Deployed(net, pad, probabilities).eval().cpu()
    path = Path(directory) / ONNX_FILE
    sequence = pad is not None  # OCR: [N, T, classes], T follows the line width
    dynamic = {"images": {0: "batch"}, "probabilities": {0: "batch"}}
    if sequence:
        dynamic["images"][3] = "width"
        dynamic["probabilities"][1] = "steps"
    example = torch.rand(2, *input_shape)
    with torch.no_grad():
        torch.onnx.export(
            deployed,
            (example,),
            str(path),
            input_names=["images"],
            output_names=["probabilities"],
            dynamic_axes=dynamic,
            opset_version=17,
            dynamo=False,  # the TorchScript exporter: no onnxscript needed
        )
    return [path]


class TorchExporter(ExporterBase):
    """The torch backend's Exporter (train/backends/base.py): the Trainer's bare model on a
    host batch, or written as ONNX (export above)."""

    def __init__(self, runtime, trainer) -> None:
        super().__init__(trainer, export)
        self.runtime = runtime

    @torch.no_grad()
    def scores(self, images: np.ndarray) -> np.ndarray:
        scores = self.trainer.net(torch.from_numpy(images).to(self.runtime.device))
        return scores.float().cpu().numpy()
