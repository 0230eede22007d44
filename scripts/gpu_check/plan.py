"""The plans (GPU and dry-run sizes), the check names and the constants both sides share.

The helper commands import this module too (they run with the frameworks' interpreters):
standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA = "gpu_check/2"
TASKS = ("ocr", "resnet50")
FRAMEWORKS = ("paddle", "torch")
AMP_DTYPES = ("fp16", "bf16")
LOADER_WORKERS = 8  # the loader throughput run and the prefetcher-off run
# train.compile, measured off and on: torch's single_gpu ResNet-50 and the Paddle OCR smoke config
COMPILE_RUNS = (("torch", "resnet50"), ("paddle", "ocr"))
RING_LEGS = ("on", "off")  # loader.batch_ring of the Paddle OCR throughput runs
MARK = "GPU-CHECK "  # helpers print one line "GPU-CHECK {json}" among whatever a framework prints

# Setup: both frameworks probed on the device, every command line through the config loader,
# the synthetic data. Nothing here is timed.
SETUP_CHECKS = ["setup.torch", "setup.paddle", "configs", "data"]


def run_checks() -> list[str]:
    """The measuring checks, most important first: a budget cut loses the tail."""
    names = ["throughput.synthetic", f"throughput.loader.w{LOADER_WORKERS}", "prefetcher.off"]
    names += [f"compile.{framework}.{task_name}" for framework, task_name in COMPILE_RUNS]
    names += [f"throughput.paddle.ocr.ring_{leg}" for leg in RING_LEGS]
    names += [
        f"amp.{fw}.{task_name}.{dtype}"
        for fw in FRAMEWORKS
        for task_name in TASKS
        for dtype in AMP_DTYPES
    ]
    names += ["smoke.torch.resnet50", "smoke.paddle.ocr"]
    return names + ["finetune.paddle.ppocrv4", "dist.torch.gloo2"]


def check_names() -> list[str]:
    """Every check of the JSON, in the order they run (the dry-run prints the same ones)."""
    return SETUP_CHECKS + run_checks()


def lines_for(batch: int, steps: int) -> int:
    """OCR lines to write so that the train split (all but a tenth) holds ``steps`` batches and
    a few more: a throughput run never reaches the end of its epoch."""
    return math.ceil(batch * (steps + 4) / 0.9) + 1


@dataclass(frozen=True)
class Plan:
    """Sizes for one mode. GPU: every throughput figure over `measure_steps` steps after
    `warmup_steps`, all inside the first epoch; dry-run: the fewest steps that still walk every
    code path, on the CPU."""

    gpu: bool
    jobs: int  # correctness runs at once after the timed ones (those always run alone)
    budget_s: float  # wall clock from the start, data included; checks past it are skipped
    run_timeout_s: float  # one training run
    ocr_lines: int
    images_train: int
    images_val: int
    classes: int
    warmup_steps: int  # the first logging window of a throughput run, left out of its figure
    measure_steps: int  # the steps a throughput figure is measured over
    smoke_steps: tuple[int, int]  # first run, then --resume up to the second
    # The dry-run's smoke runs train on the small validation split: one batch seen again and
    # again, so that 3 CPU steps show the loss falling (on a fresh batch each step they may not).
    smoke_split: str
    smoke_sets: dict[str, tuple[str, ...]]
    amp_steps: int
    amp_sets: dict[str, tuple[str, ...]]
    bench_sets: tuple[str, ...]  # the ResNet throughput runs
    bench_batch: int
    ocr_bench_sets: tuple[str, ...]  # the Paddle OCR throughput runs (single_gpu.yaml)
    ocr_bench_batch: int
    ocr_bench_workers: int
    finetune_steps: int
    finetune_sets: tuple[str, ...]
    dist_steps: int
    train_sets: tuple[str, ...]  # every ``python -m train`` run of the plan
    # Environment of the compiled runs, by framework. The dry-run's torch run sets
    # TORCHDYNAMO_DISABLE: inductor on a 2-core CPU compiles for minutes, past the dry-run's
    # budget; tests/test_compile.py runs the real compile on the CPU instead.
    compile_env: dict[str, dict[str, str]]

    @property
    def device(self) -> str:
        return "gpu" if self.gpu else "cpu"

    @property
    def bench_steps(self) -> int:
        """A throughput run's steps: the warm-up window, then the measured ones."""
        return self.warmup_steps + self.measure_steps


_GPU_WARMUP, _GPU_MEASURE = 16, 96
GPU_PLAN = Plan(
    gpu=True,
    jobs=4,
    # One command of at most 9 minutes on a lent host: the data (about a minute on 16 cores),
    # the probes, then the checks; what the budget cuts is skipped, never half-reported.
    budget_s=510.0,
    run_timeout_s=180.0,
    # single_gpu.yaml's OCR batch of 256 for 112 steps in one epoch: 29,700 train lines
    ocr_lines=lines_for(256, _GPU_WARMUP + _GPU_MEASURE),
    # ResNet-50 at batch 128: 112 steps of 120 in the first epoch
    images_train=128 * (_GPU_WARMUP + _GPU_MEASURE + 8),
    images_val=256,
    classes=10,
    warmup_steps=_GPU_WARMUP,
    measure_steps=_GPU_MEASURE,
    smoke_steps=(80, 120),
    smoke_split="train",
    smoke_sets={
        task_name: ("train.log_every=10", "train.eval_every=40", "train.checkpoint_every=40")
        for task_name in TASKS
    },
    amp_steps=24,
    amp_sets={task_name: ("train.log_every=4",) for task_name in TASKS},
    bench_sets=(),
    bench_batch=128,
    ocr_bench_sets=(),
    ocr_bench_batch=256,
    ocr_bench_workers=LOADER_WORKERS,
    finetune_steps=40,
    finetune_sets=("loader.batch_size=64", "train.log_every=10"),
    dist_steps=30,
    train_sets=(),
    compile_env={},
)
_TINY = ("loader.batch_size=8", "optim.warmup_steps=1")
_TINY_IMAGES = ("data.image_size=32", "data.eval_resize=36")
# The dry-run's throughput runs: one warm-up window and two measured steps, the fewest that
# still give a median, a measured window after the warm-up one and a step to compare with. Every
# child process pays 2-4 CPU seconds of imports, model build and checkpoint whatever its steps (a
# tiny step takes 0.05-0.5 s), so its steps are cut to what its checks read.
_DRY_WARMUP, _DRY_MEASURE = 1, 2
_DRY_OCR_BATCH = 8
DRY_PLAN = Plan(
    gpu=False,
    jobs=2,
    budget_s=600.0,
    run_timeout_s=150.0,
    # 64 lines: 56 train (the ring runs' 3 steps of 8 and 4 more), 8 val, one batch of the smoke
    # and AMP OCR runs, so that every evaluation reads one batch
    ocr_lines=lines_for(_DRY_OCR_BATCH, _DRY_WARMUP + _DRY_MEASURE),
    images_train=48,
    images_val=16,
    classes=4,
    warmup_steps=_DRY_WARMUP,
    measure_steps=_DRY_MEASURE,
    # Checkpoint at 2, --resume to 3: the GPU plan's shape (a checkpoint and an evaluation in
    # the first leg, the resumed leg ends on its final checkpoint), the loss over 3 logged steps.
    smoke_steps=(2, 3),
    smoke_split="val",
    smoke_sets={
        "ocr": (
            *_TINY,
            "loader.num_workers=1",
            "train.log_every=1",
            "train.eval_every=2",
            "train.checkpoint_every=2",
        ),
        "resnet50": (
            "loader.batch_size=16",  # the whole validation file: one batch per epoch
            "optim.warmup_steps=1",
            *_TINY_IMAGES,
            "loader.num_workers=1",
            "train.log_every=1",
            "train.eval_every=2",
            "train.checkpoint_every=2",
        ),
    },
    # The fewest the config loader allows (optim.warmup_steps 1 must be below max_steps).
    amp_steps=2,
    amp_sets={
        "ocr": (*_TINY, "loader.num_workers=1", "train.log_every=1"),
        "resnet50": (*_TINY, *_TINY_IMAGES, "loader.num_workers=1", "train.log_every=1"),
    },
    bench_sets=("model.name=resnet18", *_TINY_IMAGES),
    bench_batch=4,
    ocr_bench_sets=("data.image_shape=[3,32,160]", "model.name=crnn_tiny"),
    ocr_bench_batch=_DRY_OCR_BATCH,
    ocr_bench_workers=1,
    finetune_steps=2,
    finetune_sets=("loader.batch_size=4", "loader.num_workers=1", "train.log_every=1"),
    dist_steps=3,
    # No loss and throughput plots: nothing reads them, and drawing them took 0.6-0.9 CPU
    # seconds of matplotlib in each of the 23 runs (a third of a tiny Paddle run's time).
    train_sets=("output.plots=false",),
    compile_env={"torch": {"TORCHDYNAMO_DISABLE": "1"}},
)
