"""A trained Paddle model out of the repository: a Paddle inference model (what PaddleOCR's
``tools/infer/predict_rec.py`` TextRecognizer and ``PaddleOCR(rec_model_dir=...)`` load) or a
``paddle.load``-able ``.pdparams``; and the predictor train.predict runs an inference model with.

The inference model takes the normalized NCHW float32 batch of the preprocessing contract
(train/inference.py, preprocess.json) and returns probabilities (softmax, or a sigmoid per tag
for multi-label tasks), as PaddleOCR's CTC head does in eval mode (its CTCLabelDecode reads the
argmax and max of probabilities). For OCR the batch and the line width are dynamic:
TextRecognizer pads a batch to its widest line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
from paddle import nn
from paddle.static import InputSpec

from train.backends.common import ExporterBase

INFERENCE_PREFIX = "inference"  # inference.pdmodel / inference.pdiparams, PaddleOCR's names
PDPARAMS_FILE = "model.pdparams"
FORMATS = ("paddle-inference", "pdparams")


class Deployed(nn.Layer):
    """The trained network with its loss kind's probabilities (softmax, sigmoid per tag) after it
    and, for OCR, the padding value: training pads lines with uint8 128, which normalizes to
    ``pad`` (1/255); PaddleOCR's resize_norm_img pads with 0 after normalization, a value no
    pixel normalizes to ((p / 255 - 0.5) / 0.5 is never 0 for an integer p), so 0 is read as
    padding and both preprocessings give the model the inputs it was trained on."""

    def __init__(self, net: nn.Layer, pad: float | None, probabilities) -> None:
        """``probabilities``: the task's loss kind's (HEADS' Head.probabilities)."""
        super().__init__()
        self.net, self.pad, self.probabilities = net, pad, probabilities

    def forward(self, images: paddle.Tensor) -> paddle.Tensor:
        if self.pad is not None:
            images = paddle.where(images == 0, paddle.full_like(images, self.pad), images)
        return self.probabilities(self.net(images))


def export(
    net: nn.Layer, fmt: str, directory: Path, input_shape, pad: float | None, probabilities
) -> list[Path]:
    directory = Path(directory)
    if fmt == "pdparams":
        path = directory / PDPARAMS_FILE
        paddle.save(net.state_dict(), str(path))
        return [path]
    if fmt != "paddle-inference":
        raise ValueError(f"paddle models export to {', '.join(FORMATS)}, not {fmt}")
    deployed = Deployed(net, pad, probabilities)
    deployed.eval()
    channels, height, width = input_shape
    shape = [None, channels, height, None if pad is not None else width]
    prefix = str(directory / INFERENCE_PREFIX)
    paddle.jit.save(deployed, prefix, input_spec=[InputSpec(shape, "float32", name="x")])
    return [Path(prefix + ".pdmodel"), Path(prefix + ".pdiparams")]


class InferenceModel:
    """Paddle Inference's predictor over an exported inference model, on the CPU."""

    def __init__(self, directory: Path) -> None:
        prefix = str(Path(directory) / INFERENCE_PREFIX)
        config = paddle.inference.Config(prefix + ".pdmodel", prefix + ".pdiparams")
        config.disable_gpu()
        config.disable_glog_info()
        self.predictor = paddle.inference.create_predictor(config)

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        (name,) = self.predictor.get_input_names()
        handle = self.predictor.get_input_handle(name)
        handle.reshape(list(batch.shape))
        handle.copy_from_cpu(np.ascontiguousarray(batch, dtype=np.float32))
        self.predictor.run()
        output = self.predictor.get_output_handle(self.predictor.get_output_names()[0])
        return output.copy_to_cpu()


class PaddleExporter(ExporterBase):
    """The Paddle backend's Exporter (train/backends/base.py): the Trainer's bare model on a
    host batch, or written as an inference model or .pdparams (export above)."""

    def __init__(self, runtime, trainer) -> None:
        super().__init__(trainer, export)
        self.runtime = runtime

    def scores(self, images: np.ndarray) -> np.ndarray:
        with paddle.no_grad():
            scores = self.trainer.net(paddle.to_tensor(images, place=self.runtime.place))
        return scores.astype("float32").numpy()
