"""The schema: one frozen dataclass per config section, each field with its doc beside its
default. Parsing (train/config/validate.py) walks these type hints, so a new knob is one line
here; the types below carry their own range checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from datasets.cache import DEFAULT_CACHE_DIR, DEFAULT_CACHE_MAX_BYTES
from train.config.errors import ConfigError
from train.tasks import MODEL_NAMES, TASK_NAMES

GIB = 1024**3


@dataclass(frozen=True)
class Bounds:
    """Range check attached to a type with Annotated, e.g. Annotated[int, Bounds(low=1)]."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: value must be strictly greater than low
    hint: str = ""

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"between {self.low} and {self.high}"
        if self.low is not None:
            return f"> {self.low}" if self.low_open else f">= {self.low}"
        return f"<= {self.high}"

    def check(self, value: float, key: str) -> None:
        too_low = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        if too_low or (self.high is not None and value > self.high):
            raise ConfigError(key, f"must be {self.describe()}, got {value}", self.hint)


BYTES = "bytes"  # Annotated marker: the field also accepts size strings such as 512m or 8g
ByteSize = Annotated[int, BYTES]
PositiveInt = Annotated[int, Bounds(low=1)]
NonNegativeInt = Annotated[int, Bounds(low=0)]
PositiveFloat = Annotated[float, Bounds(low=0, low_open=True)]
NonNegativeFloat = Annotated[float, Bounds(low=0)]
Fraction = Annotated[float, Bounds(low=0, high=1)]
WorkerCount = Annotated[int, Bounds(low=0, hint="use 0 to load in the main process, or 'auto'")]


# ---------------------------------------------------------------- one dataclass per section
@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str  # dataset: a local path (relative to the repository root) or an s3:// URL
    val: str | None = None  # validation dataset, as train; None: no evaluation
    char_dict: str | None = None  # OCR: one character per line; required when task is ocr
    use_space_char: bool = False  # OCR: add " " to the characters of char_dict
    image_shape: list[PositiveInt] = field(default_factory=lambda: [3, 48, 320])  # OCR: C, H, W
    max_text_length: PositiveInt = 25  # OCR: longest label, in characters
    augment: bool = True  # training-time augmentation (never for evaluation)
    image_size: PositiveInt = 224  # ResNet: random-resized crop for training
    eval_resize: PositiveInt = 256  # ResNet: resize the short side, then center-crop image_size
    cache: Literal["none", "memory", "disk"] = "none"  # shared by all workers, bounded below
    cache_dir: str = DEFAULT_CACHE_DIR  # cache: disk keeps its memory-mapped file here
    cache_max_bytes: ByteSize = DEFAULT_CACHE_MAX_BYTES  # the cache's bound (memory or disk)
    max_bad_fraction: Fraction = 0.01  # abort when more samples than this fail to decode
    # An image with more pixels (read from its header, before decoding) is a bad sample of
    # kind image_too_large: 40 M fits ImageNet's largest photos and long text lines, and keeps a
    # 20000 x 20000 scan or a PNG decompression bomb from taking a worker's memory.
    max_image_pixels: PositiveInt = 40_000_000
    skip_keys_file: str | None = None  # keys to skip, one per line (e.g. an earlier run's)
    remote_cache_dir: str = ".cache/remote"  # where s3:// data is staged before reading
    remote_cache_max_bytes: ByteSize | None = None  # None: no limit


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    batch_size: PositiveInt = 64  # per rank
    eval_batch_size: PositiveInt | None = None  # None: batch_size
    num_workers: WorkerCount | Literal["auto"] = "auto"  # see train.cpus.resolve_num_workers
    prefetch_factor: PositiveInt | None = None  # batches in flight per worker; None: 2
    persistent_workers: bool = False  # keep workers (and their open files) across epochs
    pin_memory: bool = True  # torch: page-locked batches copy to the GPU asynchronously
    # torch on CUDA: copy and normalize the next batch on a side stream while this one trains;
    # false: a plain copy per batch on the compute stream (Paddle's loader always stages ahead)
    device_prefetch: bool = True
    use_shared_memory: bool = True  # paddle: workers hand batches over through /dev/shm
    # with workers (paddle: and use_shared_memory), workers write each batch once into a
    # /dev/shm ring the trainer owns; false: the framework's own hand-over (Paddle: two copies
    # per batch in the worker; torch: a new /dev/shm file per batch, faulted in page by page)
    batch_ring: bool = True
    multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None  # None: default
    timeout_s: NonNegativeFloat = 120.0  # a worker silent this long is an error; 0: wait forever
    drop_last: bool = True  # training drops the last partial batch (evaluation never does)

    def batching(self, train: bool) -> tuple[int, bool]:
        """(batch size, drop last) for a train or an evaluation loader: evaluation uses
        eval_batch_size when set and never drops the last partial batch (every validation
        sample counts)."""
        if train:
            return self.batch_size, self.drop_last
        return self.eval_batch_size or self.batch_size, False


@dataclass(frozen=True, kw_only=True)
class ShmConfig:
    policy: Literal["fail", "adapt"] = "fail"  # adapt: lower prefetch/workers until batches fit
    # multiplies the estimated /dev/shm need
    headroom: Annotated[float, Bounds(low=1, hint="it multiplies the estimated need")] = 1.5


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: Literal[MODEL_NAMES] | None = None  # one of the task's (train/tasks.py); None: its 1st
    hidden_size: PositiveInt = 256  # CRNN: BiLSTM width
    num_classes: PositiveInt | None = None  # ResNet; None: read from the dataset
    # Fine-tuning: a new run starts from these weights (a checkpoint or run directory, a torch
    # .pt/.pth or a Paddle .pdparams); names and shapes that differ keep their fresh init
    # (train/weights.py). Ignored on --resume.
    init_from: str | None = None


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = "adamw"  # sgd: with momentum (not Nesterov)
    lr: PositiveFloat = 1e-3  # peak learning rate, after warmup
    momentum: Fraction = 0.9  # sgd only
    weight_decay: NonNegativeFloat = 1e-4  # not on 1-D parameters: see train/schedule.py
    warmup_steps: NonNegativeInt = 0  # linear warmup from lr / warmup_steps
    schedule: Literal["cosine", "constant", "step"] = "cosine"  # after warmup (train/schedule.py)
    grad_clip: PositiveFloat | None = None  # max global gradient norm; None: no clipping


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: PositiveInt = 1  # the run stops after epochs or max_steps, whichever comes first
    max_steps: PositiveInt | None = None  # None: epochs decide
    log_every: PositiveInt = 20  # steps between train records (and multi-rank stop checks)
    eval_every: PositiveInt | None = None  # steps; None: once per epoch
    amp: Literal["none", "fp16", "bf16"] = "none"  # mixed precision, on a GPU only
    profile: bool = False  # profiler ranges (NVTX / paddle.profiler) around the step's parts
    # Compile the model for training: torch.compile (torch), paddle.jit.to_static (Paddle).
    # Off by default: the first step pays the compile time, and on CPU it was slower
    # (docs/benchmarks.md, train.compile).
    compile: bool = False
    device: Literal["auto", "cpu", "gpu"] = "auto"  # auto: a GPU when there is one
    checkpoint_every: PositiveInt | None = None  # steps; None: at the end of each epoch
    keep_last: PositiveInt = 3  # checkpoints kept
    # A step whose loss is NaN/Inf (on any rank) never updates the weights. abort: the run stops
    # there (exit 8), naming the step and batch; skip: it goes on with the next batch, and stops
    # after nonfinite_max_skips such steps in a row.
    nonfinite: Literal["abort", "skip"] = "abort"
    nonfinite_max_skips: PositiveInt = 10
    stall_warn_fraction: Fraction = 0.3  # warn when steps wait on data longer than this share
    # Seconds a rank waits for the others, at the start (rendezvous, NCCL setup) and in every
    # collective, before the run fails. Every rank stages s3:// data before it joins, so one
    # node staging longer than NCCL's default 10 min left the others to time out at the start;
    # a hang is also detected only after this long.
    dist_timeout_s: PositiveFloat = 1800.0


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    dir: str = "runs/{task}-{framework}-{config_name}"  # config_name: the YAML file's stem


@dataclass(frozen=True, kw_only=True)
class Config:
    task: Literal[TASK_NAMES]  # what to train: a task of train/tasks.py
    framework: Literal["paddle", "torch"]  # which backend trains it (train/backends/)
    seed: NonNegativeInt = 0  # model init, shuffling and augmentation
    deterministic: bool = False  # deterministic kernels (slower on a GPU)
    data: DataConfig
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    shm: ShmConfig = field(default_factory=ShmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The hint for each required key that is missing.
REQUIRED_HINTS = {
    "task": f"add {' or '.join(repr(f'task: {name}') for name in TASK_NAMES)}, or 'extends:' a "
    "base file that has it",
    "framework": "add 'framework: paddle' or 'framework: torch'",
    "data.train": "set it to a dataset path (relative to the repository root) or an s3:// URL",
}
