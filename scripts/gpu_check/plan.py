"""The plans (GPU and dry-run sizes), the check names and the constants both sides share.

The helper commands import this module too (they run in the framework venvs): standard library
only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA = "gpu_check/1"
TASKS = ("ocr", "resnet50")
FRAMEWORKS = ("paddle", "torch")
AMP_DTYPES = ("fp16", "bf16")
WORKER_COUNTS = (1, 2, 4, 8)
# train.compile, measured off and on: the Paddle OCR smoke config and torch's single_gpu ResNet-50
COMPILE_RUNS = (("paddle", "ocr"), ("torch", "resnet50"))
MARK = "GPU-CHECK "  # helpers print one line "GPU-CHECK {json}" among whatever a framework prints


def check_names() -> list[str]:
    """Every check of the JSON, in the order they run (the dry-run prints the same ones)."""
    names = ["setup.torch", "setup.paddle", "configs", "data"]
    names += ["smoke.paddle.ocr", "smoke.torch.resnet50"]
    names += [
        f"amp.{fw}.{task}.{dtype}" for fw in FRAMEWORKS for task in TASKS for dtype in AMP_DTYPES
    ]
    names += ["throughput.synthetic"]
    names += [f"throughput.loader.w{n}" for n in WORKER_COUNTS]
    names += ["prefetcher.on", "prefetcher.off"]
    return names + [f"compile.{framework}.{task}" for framework, task in COMPILE_RUNS]


@dataclass(frozen=True)
class Plan:
    """Sizes for one mode. GPU: enough steps to see learning and stable throughput in minutes;
    dry-run: the fewest steps that still walk every code path, on the CPU."""

    gpu: bool
    jobs: int  # smoke and AMP runs at once (the throughput runs always run alone)
    budget_s: float  # wall-clock budget from the start; checks past it are skipped
    run_timeout_s: float  # one training run
    ocr_lines: int
    images_train: int
    images_val: int
    classes: int
    smoke_steps: tuple[int, int]  # first run, then --resume up to the second
    # The dry-run's smoke runs train on the small validation split: a batch or two seen again and
    # again, so that 6 CPU steps show the loss falling (on a fresh batch each step they may not).
    smoke_split: str
    smoke_sets: dict[str, tuple[str, ...]]
    amp_steps: int
    amp_sets: dict[str, tuple[str, ...]]
    bench_sets: tuple[str, ...]
    bench_batch: int
    bench_steps: int
    bench_log_every: int
    synthetic_steps: tuple[int, int]  # warm-up, timed
    compile_steps: int  # each train.compile run (off, then on); every step logged
    # Environment of the compiled runs, by framework. The dry-run's torch run sets
    # TORCHDYNAMO_DISABLE: inductor on a 2-core CPU compiles for minutes, past the dry-run's
    # budget; tests/test_compile.py runs the real compile on the CPU instead.
    compile_env: dict[str, dict[str, str]]

    @property
    def device(self) -> str:
        return "gpu" if self.gpu else "cpu"


GPU_PLAN = Plan(
    gpu=True,
    jobs=4,
    budget_s=470.0,
    run_timeout_s=240.0,
    ocr_lines=2000,
    images_train=2048,
    images_val=128,
    classes=10,
    smoke_steps=(80, 120),
    smoke_split="train",
    smoke_sets={
        task: ("train.log_every=10", "train.eval_every=40", "train.checkpoint_every=40")
        for task in TASKS
    },
    amp_steps=8,
    amp_sets={task: ("train.log_every=2",) for task in TASKS},
    bench_sets=(),
    bench_batch=128,
    bench_steps=32,
    bench_log_every=8,
    synthetic_steps=(8, 30),
    compile_steps=32,
    compile_env={},
)
_TINY = ("loader.batch_size=8", "optim.warmup_steps=1")
_TINY_IMAGES = ("data.image_size=32", "data.eval_resize=36")
DRY_PLAN = Plan(
    gpu=False,
    jobs=2,
    budget_s=420.0,
    run_timeout_s=180.0,
    ocr_lines=160,
    images_train=48,
    images_val=16,
    classes=4,
    smoke_steps=(4, 6),
    smoke_split="val",
    smoke_sets={
        "ocr": (
            *_TINY,
            "loader.num_workers=1",
            "train.log_every=2",
            "train.eval_every=4",
            "train.checkpoint_every=4",
        ),
        "resnet50": (
            "loader.batch_size=16",  # the whole validation file: one batch per epoch
            "optim.warmup_steps=1",
            *_TINY_IMAGES,
            "loader.num_workers=1",
            "train.log_every=2",
            "train.eval_every=4",
            "train.checkpoint_every=4",
        ),
    },
    amp_steps=2,
    amp_sets={
        "ocr": (*_TINY, "loader.num_workers=1", "train.log_every=1"),
        "resnet50": (*_TINY, *_TINY_IMAGES, "loader.num_workers=1", "train.log_every=1"),
    },
    bench_sets=("model.name=resnet18", *_TINY_IMAGES),
    bench_batch=4,
    bench_steps=4,
    bench_log_every=2,
    synthetic_steps=(1, 2),
    compile_steps=4,
    compile_env={"torch": {"TORCHDYNAMO_DISABLE": "1"}},
)
