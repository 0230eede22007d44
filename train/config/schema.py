"""The schema: one frozen dataclass per config section, each field with its doc beside its
default. Parsing (train/config/validate.py) walks these type hints, so a new knob is one line
here; the types below carry their own range checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from train import tasks  # the module: train/tasks.py imports train.config.fields, not this
from train.config.fields import (  # noqa: F401  (re-exported: the schema's types)
    BYTES,
    INFINITY,
    Bounds,
    ByteSize,
    DataConfig,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    WorkerCount,
)

GIB = 1024**3
# Batches each loader worker keeps in flight when loader.prefetch_factor is unset (both
# frameworks' own default); resolution (train.data.resolve) writes it into the config.
DEFAULT_PREFETCH_FACTOR = 2
# Batches the trainer holds besides the workers' (the one training, the next staged): they count
# against /dev/shm and the batch ring's slots as the workers' do.
TRAINER_HELD_BATCHES = 2


def batches_in_flight(num_workers: int, prefetch_factor: int) -> int:
    """Batches of one loader alive at once: ``prefetch_factor`` per worker and those the trainer
    holds. The /dev/shm plan (train/preflight.py) counts them, and a batch ring has one slot each
    (train/backends/common.py's ring_slots)."""
    return prefetch_factor * num_workers + TRAINER_HELD_BATCHES


# ---------------------------------------------------------------- one dataclass per section
@dataclass(frozen=True, kw_only=True)
class AutotuneConfig:
    """loader.autotune: the loader tuned while the run trains (train/autotune.py)."""

    # Watch the loop's data wait and move num_workers and prefetch_factor between two steps
    # until the loader keeps up (or more stops helping); what it settles on goes to the run's
    # summary and to tuned.yaml in the run directory.
    enabled: bool = False
    # Steps measured per setting, after the new workers' first round of batches: long enough
    # that a window covers several rounds of every worker.
    window_steps: PositiveInt = 20
    # The share of a step spent waiting for data below which the loader keeps up.
    keeps_up_wait: Fraction = 0.05
    # A costlier setting (a worker more, a deeper prefetch) is kept only when its samples/s
    # beat the current one's by this share: less is within a window's noise.
    min_gain: Fraction = 0.05


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    batch_size: PositiveInt = 64  # per rank
    eval_batch_size: PositiveInt | None = None  # None: batch_size
    num_workers: WorkerCount | Literal["auto"] = "auto"  # see train.cpus.resolve_num_workers
    # batches in flight per worker; None: DEFAULT_PREFETCH_FACTOR (set only with workers)
    prefetch_factor: PositiveInt | None = None
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
    # None: the platform's default (fork on Linux). torch's forkserver workers fork from a server
    # that has imported torch, OpenCV and the dataset's module: they start in milliseconds
    multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None
    timeout_s: NonNegativeFloat = 120.0  # a worker silent this long is an error; 0: wait forever
    drop_last: bool = True  # training drops the last partial batch (evaluation never does)
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)

    def resolved(self, num_workers: int) -> LoaderConfig:
        """This section as loaders read it: ``num_workers`` a count (train.data.resolve decides
        it once) and prefetch_factor a count, DEFAULT_PREFETCH_FACTOR where unset."""
        prefetch = self.prefetch_factor or DEFAULT_PREFETCH_FACTOR
        return dataclasses.replace(self, num_workers=num_workers, prefetch_factor=prefetch)

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
    name: Literal[tasks.MODEL_NAMES] | None = (
        None  # one of the task's (train/tasks.py); None: its 1st
    )
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
    # plots/loss.png and plots/throughput.png at the end of the run; drawing them (matplotlib's
    # import and two figures) takes 0.6-0.9 CPU seconds, which runs whose figures nobody looks
    # at (the GPU check's dry run) save with false
    plots: bool = True


@dataclass(frozen=True, kw_only=True)
class Config:
    task: Literal[tasks.TASK_NAMES]  # what to train: a task of train/tasks.py
    framework: Literal["paddle", "torch"]  # which backend trains it (train/backends/)
    seed: NonNegativeInt = 0  # model init, shuffling and augmentation
    deterministic: bool = False  # deterministic kernels (slower on a GPU)
    data: DataConfig  # parsed as the task's own data section (Task.data, a DataConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    shm: ShmConfig = field(default_factory=ShmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def required_hint(key: str) -> str:
    """The hint for a required key that is missing."""
    if key == "task":
        names = " or ".join(repr(f"task: {name}") for name in tasks.TASK_NAMES)
        return f"add {names}, or 'extends:' a base file that has it"
    return {
        "framework": "add 'framework: paddle' or 'framework: torch'",
        "data.train": "set it to a dataset path (relative to the repository root) or an s3:// URL",
    }.get(key, "")
