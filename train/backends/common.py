"""What both backends do that needs no framework, written once (framework-free).

- :func:`stack_samples`: the collate step: each field of the samples stacked into one array
  (uint8 images stay uint8 through worker IPC; the backend normalizes on the device);
- :class:`LoaderKnobs`: what a framework's DataLoader gets from ``loader:``, by one rule
  (batch size and drop_last from ``LoaderConfig.batching``);
- :func:`pad_top_k`: the top-5 prediction of a model with fewer than 5 classes;
- :func:`choose_gpu`: whether ``train.device`` means a GPU here, from what the framework says
  about CUDA; the reason when it cannot have one;
- :func:`amp_dtype`: which autocast dtype ``train.amp`` means on this device (said once when
  the CPU ignores it);
- :func:`crnn_plan`: the CRNN, layer by layer, which both backends build (their conv stacks
  with :func:`build_layers`);
- what the parts of train/backends/base.py do alike in both frameworks: :class:`RuntimeBase`
  (ranks, seeding, out-of-memory), :class:`TicketPassingDataset` (the batch ring's tickets
  through a loader), :class:`BatchesBase` (the model's pixel contract, labels on the host),
  :class:`TrainerBase` (the model's mode) with :class:`StepTable` (each step's loss and flag
  on the device), :class:`InitFrom` (model.init_from) and :class:`ExporterBase`.

The weight-decay rule lives with the learning-rate curve in train/schedule.py.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datasets.batch_ring import RingTicket
from train import tasks, weights
from train.backends import gpu_probe
from train.backends.base import DeviceUnavailableError, DistInfo
from train.backends.gpu_probe import FrameworkCuda
from train.backends.gpu_verdicts import no_cuda_reason, unrunnable_gpu
from train.config.schema import DEFAULT_PREFETCH_FACTOR, batches_in_flight
from train.tasks import CrnnWidths

log = logging.getLogger(__name__)


def choose_gpu(wanted: str, cuda: FrameworkCuda) -> bool:
    """Whether to train on a GPU, for train.device ``wanted`` and ``cuda``, what the framework
    in this process says (its build, the GPUs it can use). gpu without a usable one raises
    DeviceUnavailableError with the reason (a CPU build, CUDA_VISIBLE_DEVICES, a driver too
    old, no GPU visible) and its fix; so does gpu or auto with a GPU the build cannot run on
    (train/backends/gpu_verdicts.py's unrunnable_gpu, the doctor's FAIL: NVML's compute capability
    against the build), which needs another image, not the CPU. auto without a usable GPU
    falls back to the CPU, with a loud warning when the driver (NVML) sees GPUs the framework
    cannot use: they would idle all run."""
    if wanted == "cpu":
        return False
    gpus = gpu_probe.nvml_gpus()
    if cuda.usable:
        unrunnable = unrunnable_gpu(cuda, gpus)  # e.g. Paddle's CUDA 11.8 build on an H100
        if unrunnable is not None:
            reason, fix = unrunnable
            raise DeviceUnavailableError(
                f"train.device is {wanted} but {reason}",
                f"{fix}; or set train.device: cpu",
            )
        return True
    reason, fix = no_cuda_reason(cuda, gpus)
    if wanted == "gpu":
        seen = f" ({len(gpus)} GPU(s) visible to the driver)" if gpus else ""
        if "train.device: cpu" not in fix:
            fix += "; or set train.device: cpu"
        raise DeviceUnavailableError(f"train.device is gpu but {reason}{seen}", fix)
    if gpus:
        log.warning(
            "TRAINING ON THE CPU with %d GPU(s) idle: train.device is auto and the driver sees "
            "%s, but %s cannot use CUDA: %s. HINT: %s; or set train.device: cpu to mean it",
            len(gpus),
            ", ".join(sorted({g.name for g in gpus})),
            cuda.framework,
            reason,
            fix,
        )
    return False


def stack_samples(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One contiguous array per field, the samples stacked along a new first axis."""
    return {key: np.stack([sample[key] for sample in samples]) for key in samples[0]}


def ring_slots(knobs: LoaderKnobs) -> int:
    """Slots of a loader's batch ring (datasets/batch_ring.py): one per batch in flight, as
    train.preflight's /dev/shm plan counts them."""
    return batches_in_flight(knobs.num_workers, knobs.prefetch_factor)


@dataclass(frozen=True)
class LoaderKnobs:
    """What both backends' make_loader take: the loader config for one loader (training or
    evaluation). Defaults: the frameworks' own."""

    batch_size: int
    drop_last: bool = True
    num_workers: int = 0
    prefetch_factor: int = DEFAULT_PREFETCH_FACTOR  # batches in flight per worker
    persistent_workers: bool = False
    multiprocessing_context: str | None = None  # None: the platform's default start method
    timeout_s: float = 0.0  # no batch for this long is an error; 0: wait forever

    @classmethod
    def of(cls, loader_config, train: bool) -> LoaderKnobs:
        """``loader_config`` is a train.config.schema.LoaderConfig whose num_workers is a count:
        a resolved config's (train.data.resolve), or one a test or tool set itself."""
        if not isinstance(loader_config.num_workers, int):
            raise ValueError(
                f"loader.num_workers is {loader_config.num_workers!r}: a loader takes a count "
                "(resolve the config first with train.data.resolve)"
            )
        loader_config = loader_config.resolved(loader_config.num_workers)
        batch_size, drop_last = loader_config.batching(train)
        return cls(
            batch_size=batch_size,
            drop_last=drop_last,
            num_workers=loader_config.num_workers,
            prefetch_factor=loader_config.prefetch_factor,
            persistent_workers=loader_config.persistent_workers,
            multiprocessing_context=loader_config.multiprocessing_context,
            timeout_s=loader_config.timeout_s,
        )


def pad_top_k(top: np.ndarray, k: int = 5) -> np.ndarray:
    """int64 [N, k] class ids, best first: a model with fewer than k classes has its columns
    padded with -1, which matches no label."""
    top = np.asarray(top).astype(np.int64)
    if top.shape[1] < k:
        top = np.pad(top, ((0, 0), (0, k - top.shape[1])), constant_values=-1)
    return top


def amp_dtype(amp: str, on_gpu: bool) -> str | None:
    """The autocast dtype ("float16", "bfloat16") for ``train.amp`` on this device; None for
    float32. AMP is a GPU feature: on the CPU the run trains in float32 and says so once."""
    if amp != "none" and not on_gpu:
        log.warning("train.amp is %s but the device is the CPU: training in float32", amp)
        return None
    return {"fp16": "float16", "bf16": "bfloat16"}.get(amp)


# ---------------------------------------------------------------- what the parts share
class RuntimeBase:
    """What each framework's Runtime does alike: the ranks it read (DistInfo), the seed, Python's
    and numpy's generators, and which exceptions mean out of memory. A subclass adds the device,
    the framework's generators (seed_framework) and the collectives."""

    out_of_memory_errors: tuple[type[BaseException], ...] = (MemoryError,)
    device_index: int | None = None  # the subclass's: its CUDA ordinal, None on the CPU

    def __init__(self, train) -> None:
        self.train = train  # the train: section (device, amp, profile), a TrainConfig
        self.dist = DistInfo()  # until init_distributed reads the launcher's
        self.seed = 0  # seed_everything's

    @property
    def uses_gpu(self) -> bool:
        return self.device_index is not None

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, self.out_of_memory_errors)

    def seed_everything(self, seed: int, deterministic: bool) -> None:
        self.seed = seed
        random.seed(seed)
        np.random.seed(seed)
        self.seed_framework(seed, deterministic)

    def seed_framework(self, seed: int, deterministic: bool) -> None:
        """Seed the framework's generators (every device's); with deterministic, select
        deterministic kernels."""
        raise NotImplementedError


class TicketPassingDataset:
    """A framework-free dataset as a framework's loader sees it, passing the RingTicket that
    datasets/batch_ring.py puts in front of each batch's indices on to RingCollate untouched:
    it names the batch's slot in the ring, not a sample."""

    def __init__(self, dataset) -> None:
        super().__init__()
        self.dataset = dataset

    def __getitem__(self, item):
        if isinstance(item, RingTicket):
            return item
        return self.dataset[item]

    def __len__(self) -> int:
        return len(self.dataset)


class BatchesBase:
    """What each framework's Batches does alike: whose pixel contract normalizes the batches
    (the task's until a model is built, then the model's) and the label fields on the host."""

    def __init__(self, task: tasks.Task, runtime: RuntimeBase) -> None:
        self.task, self.runtime = task, runtime
        self.model_spec: tasks.Model | None = None  # the built model's, once there is one
        self._stats: Any = None  # the pixel scale and shift on the device, made once

    def normalize_for(self, model_spec: tasks.Model) -> None:
        self.model_spec, self._stats = model_spec, None

    def to_numpy(self, tensor: Any) -> np.ndarray:
        raise NotImplementedError

    def batch_labels(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        return {key: self.to_numpy(batch[key]) for key in self.task.label_keys}


class StepTable:
    """The (loss, nonfinite) row of each train step since the last read, kept on the device in
    a table that doubles when full: writing a row is device work, not a host read, and read()
    is the one device-to-host transfer of a logging window. ``zeros(rows, like)`` makes a
    float32 [rows, 2] table on ``like``'s device, ``row(loss, nonfinite)`` one row."""

    def __init__(self, zeros: Callable[[int, Any], Any], row: Callable[[Any, Any], Any]) -> None:
        self._zeros, self._row = zeros, row
        self._table: Any = None
        self._recorded = 0  # rows since the last read

    def record(self, loss: Any, nonfinite: Any) -> None:
        table = self._table
        if table is None or self._recorded == table.shape[0]:
            grown = self._zeros(max(64, 2 * self._recorded), loss)
            if table is not None:
                grown[: table.shape[0]] = table
            self._table = table = grown
        table[self._recorded] = self._row(loss, nonfinite)
        self._recorded += 1

    def read(self) -> np.ndarray:
        recorded, self._recorded = self._recorded, 0
        if not recorded:
            return np.zeros((0, 2))
        return np.array(self._table[:recorded].tolist(), np.float64)  # the one read


class TrainerBase:
    """What each framework's Trainer holds alike: the bare model and the one train_step calls
    (its data-parallel and compiled wrappers), the step table, the model's mode."""

    def __init__(self, task: tasks.Task, runtime: RuntimeBase) -> None:
        self.task, self.runtime = task, runtime
        self.net: Any = None  # the bare model: predict, checkpoints, counting, export
        self.model: Any = None  # what train_step calls (wrapped for data parallelism > 1 rank)
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.scaler: Any = None
        self.steps: StepTable
        self.head: Any = None  # the loss, decoding and probabilities of the task's loss kind
        self._training_mode: bool | None = None

    def set_training(self, training: bool) -> None:
        if self._training_mode == training:  # train()/eval() walk every layer: only on change
            return
        if training:
            self.model.train()
        else:
            self.model.eval()
        self._training_mode = training

    def read_steps(self) -> np.ndarray:
        return self.steps.read()

    def to_float(self, loss: Any) -> float:
        return float(loss.item())  # a 0-d or [1] tensor in both frameworks


class InitFrom:
    """model.init_from for a StateIO, alike in both frameworks: train/weights.py finds the
    source and picks the tensors whose names and shapes fit the model; the framework reads the
    source (``read_weights``) and loads what fits, leaving the rest as built (``load_fitting``).
    Never touches the optimizer."""

    framework: str
    trainer: TrainerBase

    def read_weights(self, source: weights.WeightsSource) -> dict[str, Any]:
        """Name -> tensor of the model in ``source`` (a checkpoint or a weights file)."""
        raise NotImplementedError

    def is_tensor(self, value: Any) -> bool:
        raise NotImplementedError

    def load_fitting(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def init_weights_from(self, path: str | Path) -> weights.InitReport:
        source = weights.source_for(path, self.framework)
        model = self.trainer.net.state_dict()
        state = self.read_weights(source)
        loaded, report = weights.select(state, model, str(source.path), self.is_tensor)
        self.load_fitting(loaded)
        return report


class ExporterBase:
    """infer and export alike in both frameworks: the bare model in evaluation mode, run on a
    host batch (``scores``) or written by the framework's export module (``write``)."""

    def __init__(self, trainer: TrainerBase, write: Callable[..., list[Path]]) -> None:
        self.trainer, self._write = trainer, write

    def scores(self, images: np.ndarray) -> np.ndarray:
        """The bare model's float32 scores for a contiguous float32 host batch."""
        raise NotImplementedError

    def infer(self, images: np.ndarray) -> np.ndarray:
        self.trainer.set_training(False)
        return self.scores(np.ascontiguousarray(images))

    def export(self, directory: Path, fmt: str, input_shape, pad: float | None) -> list[Path]:
        self.trainer.set_training(False)
        probabilities = self.trainer.head.probabilities  # the loss kind's, after the network
        return self._write(self.trainer.net, fmt, directory, input_shape, pad, probabilities)


# ---------------------------------------------------------------- the CRNN, as a plan
# The conv stack halves the height four times (pool 2x2, 2x2, 2x1, 2x1) before the last conv
# folds what is left, and the width twice: a 48 x 320 line gives T = 80 time steps, as in
# PaddleOCR's recognizers, room for 25-character labels with blanks between repeats. The
# factors are the task's (train/tasks.py), which checks a config's image shape against them.
HEIGHT_STRIDE = tasks.CRNN_HEIGHT_STRIDE
WIDTH_STRIDE = tasks.CRNN_WIDTH_STRIDE


@dataclass(frozen=True)
class Conv:
    """A bias-free conv + BatchNorm + ReLU (the BatchNorm adds its own shift)."""

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    padding: tuple[int, int]


@dataclass(frozen=True)
class Pool:
    """A max pool (kernel = stride)."""

    size: tuple[int, int]


def build_layers(plan: list[Conv | Pool], conv: Callable, pool: Callable) -> list:
    """A framework's layers for ``plan``: ``conv(step)`` gives a Conv step's layers (conv,
    norm, activation), ``pool(step)`` a Pool step's one layer."""
    layers = []
    for step in plan:
        layers += [pool(step)] if isinstance(step, Pool) else conv(step)
    return layers


@dataclass(frozen=True)
class CrnnPlan:
    """The whole CRNN, framework-free. CRNN (Shi, Bai and Yao, 2015): a VGG-style conv stack
    turns a text-line image [N, C, H, W] into a feature sequence along the width [N, C', 1, T];
    a bidirectional LSTM reads it and a linear layer scores every time step for CTC."""

    backbone: list[Conv | Pool]
    rnn: tuple[int, int, int]  # input size, hidden size (per direction), layers; bidirectional
    head: tuple[int, int]  # in and out features: 2 x hidden -> classes (the CTC blank is 0)
    height: int  # the image height the last conv is sized for


def crnn_plan(
    widths: CrnnWidths, image_shape: tuple[int, int, int], hidden_size: int, num_classes: int
) -> CrnnPlan:
    """The CRNN of ``widths`` for images [C, H, W]: T = W / 4 time steps."""
    rnn = (widths.stages[-1], hidden_size, widths.lstm_layers)
    head = (2 * hidden_size, num_classes)
    return CrnnPlan(_crnn_backbone(widths, image_shape), rnn, head, image_shape[1])


def _crnn_backbone(widths: CrnnWidths, image_shape: tuple[int, int, int]) -> list[Conv | Pool]:
    """The conv stack for images [C, H, W], in order: [N, C, H, W] -> [N, C', 1, W / 4]."""
    channels, height, width = image_shape
    if height % HEIGHT_STRIDE or width % WIDTH_STRIDE:
        raise ValueError(
            f"CRNN needs an image height divisible by {HEIGHT_STRIDE} and a width divisible "
            f"by {WIDTH_STRIDE}, got {height} x {width}; set data.image_shape, e.g. "
            "[3, 48, 320] or [3, 32, 320]"
        )
    s1, s2, s3, s4 = widths.stages
    same = ((3, 3), (1, 1))
    return [
        Conv(channels, s1, *same),
        Pool((2, 2)),  # H/2, W/2
        Conv(s1, s2, *same),
        Pool((2, 2)),  # H/4, W/4
        Conv(s2, s3, *same),
        Conv(s3, s3, *same),
        Pool((2, 1)),  # H/8; the width is the time axis from here on
        Conv(s3, s4, *same),
        Conv(s4, s4, *same),
        Pool((2, 1)),  # H/16
        # A learned full-height conv folds the remaining rows (3 for H = 48) into one, instead
        # of adaptive pooling, whose CUDA backward has no deterministic kernel.
        Conv(s4, s4, (height // HEIGHT_STRIDE, 1), (0, 0)),
    ]


# ---------------------------------------------------------------- PP-OCRv4 mobile recognizer
# The released ch_PP-OCRv4_rec model as its inference export computes it (read from the ONNX
# graph with the onnx package; docs/ppocrv4.md). Backbone: PP-LCNetV3 at scale 0.95 in its
# deployed form, where each block's parallel branches and batch norms were fused at export
# into one convolution with a bias. Both backends build exactly this, in this order: the weight
# converter (train/ppocrv4_weights.py) maps the export's tensors onto it in graph order.
@dataclass(frozen=True)
class LcnetBlock:
    in_channels: int
    out_channels: int
    kernel: int  # of the depthwise convolution
    stride: tuple[int, int]  # (height, width), of the depthwise convolution
    squeeze_excite: bool  # SE between the depthwise and the pointwise convolution


PPOCRV4_STEM = 16  # 3x3 stride-2 convolution without bias, then batch norm, no activation
PPOCRV4_BLOCKS = (
    LcnetBlock(16, 32, 3, (1, 1), False),
    LcnetBlock(32, 64, 3, (1, 1), False),
    LcnetBlock(64, 64, 3, (1, 1), False),
    LcnetBlock(64, 128, 3, (2, 1), False),
    LcnetBlock(128, 128, 3, (1, 1), False),
    LcnetBlock(128, 240, 3, (1, 2), False),
    *(LcnetBlock(240, 240, 5, (1, 1), False) for _ in range(4)),
    LcnetBlock(240, 480, 5, (2, 1), True),
    LcnetBlock(480, 480, 5, (1, 1), True),
    LcnetBlock(480, 480, 5, (2, 1), False),
    LcnetBlock(480, 480, 5, (1, 1), False),
)
PPOCRV4_SE_REDUCTION = 4
# After the backbone: average pooling (3, 2) turns the 3 x W/4 map of a 48-pixel line into one
# row of W/8 steps. The SVTR neck: 1x3 conv to 480/8, 1x1 conv to 120, two pre-norm transformer
# blocks (8 heads of 15, MLP ratio 2, swish), 1x1 conv back to 480, concatenated with the
# pooled map, 1x3 conv to 60, 1x1 conv to 120; every conv there is conv + batch norm + swish.
PPOCRV4_HEIGHT = 48
PPOCRV4_POOL = (3, 2)
PPOCRV4_NECK_DIMS = 120
PPOCRV4_NECK_DEPTH = 2
PPOCRV4_NECK_HEADS = 8
PPOCRV4_NECK_MLP = 240
PPOCRV4_BLOCK_EPS = 1e-5  # the blocks' layer norms
PPOCRV4_FINAL_EPS = 1e-6  # the neck's last layer norm
PPOCRV4_BN_EPS = 1e-5
