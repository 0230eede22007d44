"""The tasks this stack trains, one entry each: models, data, metric, pixel normalization.

Framework-free. Everything outside the backends that depends on the task reads this table
instead of asking for the task's name: the config (task and model names, each task's own
checks), data building (train/data.py), the /dev/shm estimate (train/preflight.py), the doctor
(train/doctor.py) and the loop's evaluation (train/loop.py). A backend keys its loss and
decoding by the task's loss kind (HEADS in train/backends/torch/models.py and
train/backends/paddle/models.py), so a task with a loss they already have adds nothing there.
docs/architecture.md shows how to add a task.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from train.metrics import Metric, OcrMetric, TopKMetric

if TYPE_CHECKING:
    from datasets.dataset import RecordDataset

Problem = tuple[str, str, str]  # a config problem: (dotted key, what is wrong, the fix)

# The loss kinds a task can train with: each backend has a head (the loss on the model's scores
# and their decoding into the metric's predictions) for each. "ctc": a class per time step, the
# blank class 0 before the labels; "cross_entropy": one class per image.
LOSSES = ("ctc", "cross_entropy")


@dataclass(frozen=True)
class CrnnWidths:
    """Output channels of the four conv stages, and how many BiLSTM layers read the sequence."""

    stages: tuple[int, int, int, int]
    lstm_layers: int


@dataclass(frozen=True)
class Model:
    name: str  # model.name in a config
    family: str  # the builder in each backend's models.py: "crnn", "resnet" or "ppocrv4"
    parameters: float  # about how many: the doctor's checkpoint-size estimate
    widths: CrnnWidths | None = None  # the crnn family's sizes
    # The model's own pixel normalization when it differs from the task's (None: the task's).
    # A model with released weights keeps the normalization they were trained with.
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # data config -> what the config gets wrong for this model (e.g. the input its weights need)
    problems: Callable[[Any], Iterator[Problem]] | None = None


@dataclass(frozen=True)
class Task:
    name: str  # task: in a config
    models: tuple[Model, ...]  # the first is the default (model.name: null)
    label_keys: tuple[str, ...]  # a sample's fields besides "image"
    # Pixel normalization (x / 255 - mean) / std, per channel; one value: every channel.
    mean: tuple[float, ...]
    std: tuple[float, ...]
    loss: str  # one of LOSSES: the backends' head, and what the model's outputs mean
    metric: Callable[[], Metric]  # a fresh accumulator for one evaluation
    # (data config, path, *, train, seed, **sample policy) -> the dataset at path
    open_dataset: Callable[..., RecordDataset]
    # (model config, training dataset) -> the model's output classes
    num_classes: Callable[[Any, RecordDataset], int]
    # data config -> the model's input [C, H, W]
    input_shape: Callable[[Any], tuple[int, int, int]]
    # data config -> bytes of one collated sample, from the config's fixed output shapes
    sample_bytes: Callable[[Any], int]
    # data config -> what the config gets wrong for this task (the config's own checks)
    problems: Callable[[Any], Iterator[Problem]]
    # data fields naming files the dataset reads besides data.train and data.val
    input_files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"task {self.name}: loss {self.loss!r} is not one of {LOSSES}")

    def model(self, name: str | None) -> Model:
        """The model called ``name`` (None: the task's default)."""
        if name is None:
            return self.models[0]
        return next(model for model in self.models if model.name == name)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(model.name for model in self.models)

    def pixel_scale_shift(self, model: Model | None = None) -> tuple[np.ndarray, np.ndarray]:
        """float32 arrays [1, C, 1, 1] (C = 1: every channel) with which uint8 pixels x
        normalize as x * scale + shift, which is (x / 255 - mean) / std in one multiply-add:
        ``model``'s own mean and std when it has them, else the task's."""
        own = model is not None and model.mean is not None
        mean = np.array(model.mean if own else self.mean)
        std = np.array(model.std if own else self.std)
        scale = (1.0 / (255.0 * std)).astype(np.float32).reshape(1, -1, 1, 1)
        shift = (-mean / std).astype(np.float32).reshape(1, -1, 1, 1)
        return scale, shift


# ---------------------------------------------------------------- OCR: CRNN + CTC on LMDB lines
def _open_ocr(data, path: str, *, train: bool, seed: int = 0, **policy) -> RecordDataset:
    from datasets.dataset import build_ocr_dataset
    from datasets.ocr_transforms import CharDict

    chars = CharDict.from_file(data.char_dict, data.use_space_char)
    return build_ocr_dataset(
        path,
        chars,
        train=train,
        seed=seed,
        image_shape=tuple(data.image_shape),
        max_text_length=data.max_text_length,
        augment=data.augment,
        max_image_pixels=data.max_image_pixels,
        **policy,
    )


def _ocr_sample_bytes(data) -> int:
    channels, height, width = data.image_shape
    return channels * height * width + 4 * data.max_text_length + 4  # image, label, length


def _ocr_problems(data) -> Iterator[Problem]:
    if not data.char_dict:
        hint = "point it at the character list, one character per line"
        yield "data.char_dict", "required when task is ocr", hint
    if len(data.image_shape) != 3:
        got = f"{len(data.image_shape)} numbers"
        yield "data.image_shape", f"expected 3 numbers [C, H, W], got {got}", "e.g. [3, 48, 320]"


def _ppocrv4_problems(data) -> Iterator[Problem]:
    if len(data.image_shape) == 3 and tuple(data.image_shape[:2]) != (3, 48):
        got = list(data.image_shape)
        problem = f"ppocrv4_rec reads BGR lines 48 pixels high, got {got}"
        yield "data.image_shape", problem, f"use [3, 48, {got[-1]}] (width: up to 320 or more)"


OCR = Task(
    name="ocr",
    models=(
        # VGG widths of the original CRNN and two BiLSTM layers (PaddleOCR's EncoderWithRNN
        # also stacks two): ~8.5M parameters at hidden_size 256, PaddleOCR CRNN scale.
        Model("crnn", "crnn", 9e6, CrnnWidths(stages=(64, 128, 256, 512), lstm_layers=2)),
        # About 1/20 of the compute: learns the synthetic smoke data in a few hundred CPU steps.
        Model("crnn_tiny", "crnn", 1e6, CrnnWidths(stages=(16, 32, 64, 96), lstm_layers=1)),
        # PaddleOCR's released PP-OCRv4 mobile recognizer (2.7M parameters with its 6,625
        # classes), for fine-tuning from its weights: docs/ppocrv4.md. Its contract is PP-OCR's:
        # BGR, 48 high, aspect kept up to the width, right padding, (x / 255 - 0.5) / 0.5.
        Model(
            "ppocrv4_rec",
            "ppocrv4",
            2.7e6,
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            problems=_ppocrv4_problems,
        ),
    ),
    label_keys=("label", "length"),
    mean=(0.5,),  # to [-1, 1], as PaddleOCR's recognizers
    std=(0.5,),
    loss="ctc",
    metric=OcrMetric,
    open_dataset=_open_ocr,
    num_classes=lambda model, train_set: train_set.transform.char_dict.num_classes,
    input_shape=lambda data: tuple(data.image_shape),
    sample_bytes=_ocr_sample_bytes,
    problems=_ocr_problems,
    input_files=("char_dict",),
)


# ---------------------------------------------------------------- ResNet: classes of images in HDF5
def _open_images(data, path: str, *, train: bool, seed: int = 0, **policy) -> RecordDataset:
    from datasets.dataset import build_image_dataset

    return build_image_dataset(
        path,
        train=train,
        seed=seed,
        image_size=data.image_size,
        eval_resize=data.eval_resize,
        max_image_pixels=data.max_image_pixels,
        **policy,
    )


def _resnet_problems(data) -> Iterator[Problem]:
    if data.eval_resize < data.image_size:
        problem = f"{data.eval_resize} is smaller than data.image_size ({data.image_size})"
        yield "data.eval_resize", problem, "eval resizes, then center-crops image_size"


RESNET50 = Task(
    name="resnet50",
    models=(Model("resnet50", "resnet", 25.6e6), Model("resnet18", "resnet", 11.7e6)),
    label_keys=("label",),
    mean=(0.485, 0.456, 0.406),  # ImageNet's, RGB
    std=(0.229, 0.224, 0.225),
    loss="cross_entropy",
    metric=TopKMetric,
    open_dataset=_open_images,
    num_classes=lambda model, train_set: model.num_classes or len(train_set.source.class_names),
    input_shape=lambda data: (3, data.image_size, data.image_size),
    sample_bytes=lambda data: 3 * data.image_size**2 + 8,  # RGB image, int64 label
    problems=_resnet_problems,
)


TASKS: dict[str, Task] = {task.name: task for task in (OCR, RESNET50)}
TASK_NAMES = tuple(TASKS)
# Every model once, in task order (a model may serve several tasks).
MODEL_NAMES = tuple(dict.fromkeys(m.name for task in TASKS.values() for m in task.models))


def get(name: str) -> Task:
    """The task called ``name`` (a validated config's task)."""
    return TASKS[name]
