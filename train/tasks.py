"""The tasks this stack trains, one entry each: models, data, metric, pixel normalization.

The built-in tasks are defined here; every other task is one module of train/task_modules/ that
defines ``TASK`` (a Task), registered below. Framework-free. Everything outside the backends
that depends on the task reads this table instead of asking for the task's name: the config
(task and model names, each task's own checks), data building (train/data.py), the /dev/shm
estimate (train/preflight.py), the doctor (train/doctor.py), the loop's evaluation
(train/loop.py), and after training train.evaluate, train.export and train.predict
(train/inference.py: the labels, the preprocessing contract, the padding, the decoding by loss
kind, evaluation's breakdowns). A backend keys its loss and decoding by the task's loss kind
(HEADS in train/backends/torch/models.py and train/backends/paddle/models.py), so a task with a
loss they already have adds nothing there. docs/architecture.md shows how to add a task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from train.config.fields import DataConfig, PositiveInt
from train.metrics import Breakdown, Metric, OcrLengthAccuracy, OcrMetric, TopKMetric

if TYPE_CHECKING:
    from datasets.dataset import RecordDataset

Problem = tuple[str, str, str]  # a config problem: (dotted key, what is wrong, the fix)

# The loss kinds a task can train with: each backend has a head (the loss on the model's scores,
# their decoding into the metric's predictions, the probabilities an export outputs) for each,
# and train/inference.py a decoding. "ctc": a class per time step, the blank class 0 before the
# labels; "cross_entropy": one class per image; "multi_label": an independent yes/no per label
# (binary cross-entropy on a sigmoid each), any number of labels per image.
LOSSES = ("ctc", "cross_entropy", "multi_label")


def class_name(label, labels: Sequence[str]):
    """A record's label as train.predict prints it: a class id's name; text as it is."""
    if isinstance(label, (int, np.integer)) and 0 <= label < len(labels):
        return labels[int(label)]
    return label


# The files an export writes beside the weights (train/inference.py writes them, each task's
# contract names its own): the preprocessing contract, and the labels by output id.
CONTRACT_FILE = "preprocess.json"
DICT_FILE = "dict.txt"  # OCR: one character per line, PaddleOCR's rec_char_dict_path format
CLASSES_FILE = "classes.txt"  # an image task: one class (or tag) name per line, by id
TAG_SEPARATOR = ","  # between the names of a multi-label prediction's tags


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
    # After training (train/inference.py).
    # config -> the names of the model's classes by id, as training read them (OCR: the
    # dictionary's characters, which follow CTC's blank)
    labels: Callable[[Any], list[str]]
    # config -> the task's part of the preprocessing contract (preprocess.json): input shape,
    # channel order, resize, padding, the labels file, the output and its decoding
    contract: Callable[[Any], dict]
    # (preprocess.json, encoded image) -> the uint8 HWC image the model reads, as evaluation
    # builds it; the task's normalization follows
    prepare_image: Callable[[dict, bytes], np.ndarray]
    # data fields naming files the dataset reads besides data.train and data.val
    input_files: tuple[str, ...] = ()
    # The uint8 value the task's transforms pad an image with to the input's width (None: they
    # never pad). A callable: the transforms import OpenCV, which this table does not need.
    pad_pixel: Callable[[], int] | None = None
    # The task's data section: DataConfig (what every task's has) or a subclass adding the
    # task's own keys, each with its type and default; the config parses data: as it.
    data: type[DataConfig] = DataConfig
    # the folder of configs/ holding the task's scenario files (None: the task's name)
    scenarios: str | None = None
    # train.evaluate's figures besides the metric's: (key in its report, a fresh accumulator)
    breakdowns: tuple[tuple[str, Callable[[], Breakdown]], ...] = ()
    # train.predict: (a record's label, the model's labels) -> the label as the decoded
    # predictions read, which train.predict compares them with
    label_text: Callable[[Any, Sequence[str]], Any] = class_name
    # train.predict: an HDF5 file given as input -> its records with this task's labels (None:
    # the class of each image, datasets/hdf5_images.py's Hdf5ImageSource)
    label_source: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"task {self.name}: loss {self.loss!r} is not one of {LOSSES}")

    def model(self, name: str | None) -> Model:
        """The model called ``name`` (None: the task's default)."""
        if name is None:
            return self.models[0]
        return next(model for model in self.models if model.name == name)

    @property
    def scenario_dir(self) -> str:
        """configs/<this>/: the folder of the task's scenario files."""
        return f"configs/{self.scenarios or self.name}"

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(model.name for model in self.models)

    def num_outputs(self, labels: Sequence[str]) -> int:
        """The model's outputs for ``labels``: CTC's blank is class 0, before them."""
        return len(labels) + (1 if self.loss == "ctc" else 0)

    def pad_value(self) -> float | None:
        """pad_pixel after the task's normalization (one value: the task normalizes every
        channel alike), None when the task never pads. An exported model reads an input of
        exactly 0 as this padding (train/backends/*/export.py)."""
        if self.pad_pixel is None:
            return None
        scale, shift = self.pixel_scale_shift()
        return float(np.float32(self.pad_pixel()) * scale.ravel()[0] + shift.ravel()[0])

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
@dataclass(frozen=True, kw_only=True)
class OcrData(DataConfig):
    char_dict: str | None = None  # one character per line; required
    use_space_char: bool = False  # add " " to the characters of char_dict
    image_shape: list[PositiveInt] = field(default_factory=lambda: [3, 48, 320])  # C, H, W
    max_text_length: PositiveInt = 25  # longest label, in characters


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
        reader="the ocr task",
        **policy,
    )


def _ocr_characters(config) -> list[str]:
    from datasets.ocr_transforms import CharDict

    return CharDict.from_file(config.data.char_dict, config.data.use_space_char).characters


def _ocr_pad_pixel() -> int:
    from datasets.ocr_transforms import PAD_VALUE

    return PAD_VALUE


def _ocr_contract(config) -> dict:
    channels, height, width = config.data.image_shape
    return {
        "image_shape": [channels, height, width],
        "channel_order": "BGR (OpenCV's imread)",
        "resize": (
            f"to height {height} keeping the aspect ratio: width ceil({height} * w / h), "
            f"at most {width}, bilinear (cv2.INTER_LINEAR) on the uint8 image"
        ),
        "pad": (
            f"on the right to width {width}: uint8 {_ocr_pad_pixel()} before normalization "
            f"({OCR.pad_value():.6f} after, as in training), or 0 after normalization as "
            "PaddleOCR's resize_norm_img pads; the exported model reads an input of exactly "
            "0 as that padding (no pixel normalizes to exactly 0)"
        ),
        # The dictionary file leaves out the space that use_space_char appends, as PaddleOCR's
        # dictionaries do: PaddleOCR appends it itself (train/inference.py, write_contract).
        "dictionary": DICT_FILE,
        "use_space_char": config.data.use_space_char,
        "output": "[N, T, 1 + characters] softmax probabilities; class 0 is the CTC blank",
        "decode": "argmax per step, merge repeats, drop blanks (PaddleOCR CTCLabelDecode)",
    }


def _prepare_line(spec: dict, encoded: bytes) -> np.ndarray:
    from datasets.decode import decode_bgr
    from datasets.ocr_transforms import resize_and_pad

    return resize_and_pad(decode_bgr(encoded), tuple(spec["image_shape"]))[0]


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
        return
    channels, height, width = data.image_shape
    if channels not in (1, 3):
        problem = f"{list(data.image_shape)} has {channels} channels: lines are read as BGR (3)"
        yield "data.image_shape", problem + " or grayscale (1)", f"use [3, {height}, {width}]"


# The CRNN's downsampling (train/backends/common.py builds it from these): max pools halve the
# height four times (2x2, 2x2, 2x1, 2x1) and a full-height convolution folds the rows left into
# one; the first two pools halve the width, whose columns are then the CTC time steps.
CRNN_HEIGHT_STRIDE = 16
CRNN_WIDTH_STRIDE = 4


def crnn_time_steps(image_shape) -> int:
    """The CRNN's CTC time steps for lines [C, H, W] (a shape _crnn_problems accepts)."""
    return image_shape[2] // CRNN_WIDTH_STRIDE


PPOCRV4_WIDTH_STRIDE = 8  # ppocrv4_time_steps of a width that is a multiple of 8: width / 8


def ppocrv4_time_steps(image_shape) -> int:
    """PP-OCRv4's CTC time steps for lines [C, H, W] (train/backends/common.py's PPOCRV4_*):
    the stem and one block halve the width with padded stride-2 convolutions (rounding up),
    the average pool after the backbone halves it again (rounding down)."""
    return math.ceil(math.ceil(image_shape[2] / 2) / 2) // 2


def _ctc_length_problems(data, model: str, steps: int, stride: int) -> Iterator[Problem]:
    """CTC aligns a label of L characters to at least L of the model's time steps (L + the
    number of equal neighbours: a blank between each two). A max_text_length above the time
    steps is refused: no label of that length can be aligned, its loss is infinite (torch's
    CTCLoss zeroes it: nothing learned). Up to 2 L - 1 steps are needed only for labels of
    repeated characters, so a shorter line is kept: PaddleOCR pairs 25 characters with
    PP-OCRv4's 40 steps."""
    length = data.max_text_length
    if steps < length:
        channels, height, width = data.image_shape
        problem = (
            f"{length} characters need at least {length} CTC time steps, but {model} has "
            f"{steps} for data.image_shape {list(data.image_shape)} (width / {stride})"
        )
        hint = (
            f"lower data.max_text_length to {steps}, or widen the lines: "
            f"data.image_shape [{channels}, {height}, {stride * length}]"
        )
        yield "data.max_text_length", problem, hint


def _crnn_problems(data) -> Iterator[Problem]:
    if len(data.image_shape) != 3:
        return  # _ocr_problems says so
    channels, height, width = data.image_shape
    if height % CRNN_HEIGHT_STRIDE:
        fit = max(CRNN_HEIGHT_STRIDE, round(height / CRNN_HEIGHT_STRIDE) * CRNN_HEIGHT_STRIDE)
        problem = (
            f"the CRNN reduces the height {CRNN_HEIGHT_STRIDE}-fold to one row, so it must be a "
            f"multiple of {CRNN_HEIGHT_STRIDE}, got {height} in {list(data.image_shape)}"
        )
        hint = f"use [{channels}, {fit}, {width}] (PaddleOCR's recognizers read 48 or 32)"
        yield "data.image_shape", problem, hint
        return
    if width % CRNN_WIDTH_STRIDE:
        fit = -(-width // CRNN_WIDTH_STRIDE) * CRNN_WIDTH_STRIDE
        problem = (
            f"the CRNN's CTC time steps are the width / {CRNN_WIDTH_STRIDE}, so it must be a "
            f"multiple of {CRNN_WIDTH_STRIDE}, got {width} in {list(data.image_shape)}"
        )
        yield "data.image_shape", problem, f"use [{channels}, {height}, {fit}]"
        return
    steps = crnn_time_steps(data.image_shape)
    yield from _ctc_length_problems(data, "the CRNN", steps, CRNN_WIDTH_STRIDE)


def _ppocrv4_problems(data) -> Iterator[Problem]:
    if len(data.image_shape) != 3:
        return  # _ocr_problems says so
    if tuple(data.image_shape[:2]) != (3, 48):
        got = list(data.image_shape)
        problem = f"ppocrv4_rec reads BGR lines 48 pixels high, got {got}"
        yield "data.image_shape", problem, f"use [3, 48, {got[-1]}] (width: up to 320 or more)"
        return
    steps = ppocrv4_time_steps(data.image_shape)
    yield from _ctc_length_problems(data, "ppocrv4_rec", steps, PPOCRV4_WIDTH_STRIDE)


OCR = Task(
    name="ocr",
    models=(
        # VGG widths of the original CRNN and two BiLSTM layers (PaddleOCR's EncoderWithRNN
        # also stacks two): ~8.5M parameters at hidden_size 256, PaddleOCR CRNN scale.
        Model(
            "crnn",
            "crnn",
            9e6,
            CrnnWidths(stages=(64, 128, 256, 512), lstm_layers=2),
            problems=_crnn_problems,
        ),
        # About 1/20 of the compute: learns the synthetic smoke data in a few hundred CPU steps.
        Model(
            "crnn_tiny",
            "crnn",
            1e6,
            CrnnWidths(stages=(16, 32, 64, 96), lstm_layers=1),
            problems=_crnn_problems,
        ),
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
    labels=_ocr_characters,
    contract=_ocr_contract,
    prepare_image=_prepare_line,
    data=OcrData,
    input_files=("char_dict",),
    pad_pixel=_ocr_pad_pixel,
    breakdowns=(("acc_by_length", OcrLengthAccuracy),),
)


# ---------------------------------------------------------------- classification: a class per image
@dataclass(frozen=True, kw_only=True)
class ImageData(DataConfig):
    image_size: PositiveInt = 224  # random-resized crop for training
    eval_resize: PositiveInt = 256  # evaluation: resize the short side, then center-crop image_size


def open_images(data, path: str, *, train: bool, seed: int = 0, **policy) -> RecordDataset:
    from datasets.dataset import build_image_dataset

    return build_image_dataset(
        path,
        train=train,
        seed=seed,
        image_size=data.image_size,
        eval_resize=data.eval_resize,
        max_image_pixels=data.max_image_pixels,
        reader="the classification task",
        **policy,
    )


def class_names(config) -> list[str]:
    """The training data's class names by id (``dataset.source.class_names`` of the config's
    task's dataset), cut or extended (class_<id>) to model.num_classes when the config sets
    it."""
    dataset = get(config.task).open_dataset(config.data, config.data.train, train=False)
    try:
        names = list(dataset.source.class_names)
    finally:
        dataset.close()
    count = config.model.num_classes or len(names)
    return names[:count] + [f"class_{i}" for i in range(len(names), count)]


def image_contract(config) -> dict:
    size, resize = config.data.image_size, config.data.eval_resize
    return {
        "image_size": size,
        "eval_resize": resize,
        "channel_order": "RGB",
        "resize": (f"short side to {resize}, then a center crop of {size} x {size} (bilinear)"),
        "classes": CLASSES_FILE,
        "output": "[N, classes] softmax probabilities",
    }


def prepare_image(spec: dict, encoded: bytes) -> np.ndarray:
    from datasets.image_transforms import eval_transform

    return eval_transform(encoded, spec["image_size"], spec["eval_resize"])


def image_problems(data) -> Iterator[Problem]:
    if data.eval_resize < data.image_size:
        problem = f"{data.eval_resize} is smaller than data.image_size ({data.image_size})"
        yield "data.eval_resize", problem, "eval resizes, then center-crops image_size"


CLASSIFICATION = Task(
    name="classification",
    models=(Model("resnet50", "resnet", 25.6e6), Model("resnet18", "resnet", 11.7e6)),
    data=ImageData,
    # The ResNet-50 recipes: their runs keep the resnet50-<framework>-<scenario> names.
    scenarios="resnet50",
    label_keys=("label",),
    mean=(0.485, 0.456, 0.406),  # ImageNet's, RGB
    std=(0.229, 0.224, 0.225),
    loss="cross_entropy",
    metric=TopKMetric,
    open_dataset=open_images,
    num_classes=lambda model, train_set: model.num_classes or len(train_set.source.class_names),
    input_shape=lambda data: (3, data.image_size, data.image_size),
    sample_bytes=lambda data: 3 * data.image_size**2 + 8,  # RGB image, int64 label
    problems=image_problems,
    labels=class_names,
    contract=image_contract,
    prepare_image=prepare_image,
)


def _registered(built_in: tuple[Task, ...]) -> dict[str, Task]:
    """The built-in tasks, then the TASK of each module of train/task_modules/ (a new task is
    one module there plus its configs/<task>/ scenarios), by name."""
    import importlib
    import pkgutil

    # By name, not an import statement: the task modules import this one (they are a layer
    # above it), and the registry finds them as plugins.
    task_modules = importlib.import_module("train.task_modules")

    found = list(built_in)
    for module in sorted(pkgutil.iter_modules(task_modules.__path__), key=lambda m: m.name):
        task = getattr(
            importlib.import_module(f"{task_modules.__name__}.{module.name}"), "TASK", None
        )
        if not isinstance(task, Task):
            raise TypeError(
                f"train/task_modules/{module.name}.py defines no TASK = Task(...); define it, "
                "or move the module out of train/task_modules/"
            )
        found.append(task)
    names = [task.name for task in found]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"tasks named twice: {duplicated}; give each task its own name")
    return {task.name: task for task in found}


TASKS: dict[str, Task] = _registered((OCR, CLASSIFICATION))
TASK_NAMES = tuple(TASKS)
# Old task names, still read (a config's task:, an old checkpoint's or export's): the name now.
RENAMED = {"resnet50": "classification"}
# Every model once, in task order (a model may serve several tasks).
MODEL_NAMES = tuple(dict.fromkeys(m.name for task in TASKS.values() for m in task.models))


def current_name(name: str) -> str:
    """``name``, or the name of the task once called so (RENAMED)."""
    return RENAMED.get(name, name)


def get(name: str) -> Task:
    """The task called ``name`` (a validated config's task, or an old name of one)."""
    return TASKS[current_name(name)]
