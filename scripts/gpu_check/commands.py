"""The plans (GPU and dry-run sizes), the check names, and a plan's ``python -m train`` command
lines: pure functions, so that the dry run validates the GPU plan's too. Standard library only."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA = "gpu_check/2"
TASKS, FRAMEWORKS, AMP_DTYPES = ("ocr", "resnet50"), ("paddle", "torch"), ("fp16", "bf16")
LOADER_WORKERS = 8  # the loader throughput run and the prefetcher-off run
COMPILE_RUNS = SMOKE_RUNS = (("torch", "resnet50"), ("paddle", "ocr"))
SETUP_CHECKS = ["setup.torch", "setup.paddle", "configs", "data"]
# The timed checks, most important first (a budget cut loses the tail), run one at a time; then
# the correctness checks, none timed, several at once.
TIMED_CHECKS = ["throughput.synthetic", f"throughput.loader.w{LOADER_WORKERS}", "prefetcher.off"]
TIMED_CHECKS += [f"compile.{framework}.{task}" for framework, task in COMPILE_RUNS]
TIMED_CHECKS += [f"throughput.paddle.ocr.ring_{leg}" for leg in ("on", "off")]
CORRECTNESS_CHECKS = [f"amp.{f}.{t}.{d}" for f in FRAMEWORKS for t in TASKS for d in AMP_DTYPES]
CORRECTNESS_CHECKS += [f"smoke.{framework}.{task}" for framework, task in SMOKE_RUNS]
CORRECTNESS_CHECKS += ["finetune.paddle.ppocrv4", "dist.torch.gloo2"]
RUN_CHECKS = TIMED_CHECKS + CORRECTNESS_CHECKS
CHECK_NAMES = SETUP_CHECKS + RUN_CHECKS  # every check of the JSON, in the order they run
RESNET_SINGLE, OCR_SINGLE = "configs/resnet50/single_gpu.yaml", "configs/ocr/single_gpu.yaml"
# From the released weights when scripts/convert_weights.py has written them, else from scratch.
RELEASED_WEIGHTS = ROOT / ".cache" / "ppocrv4" / "ppocrv4_rec.pdparams"
FINETUNE_INIT = str(RELEASED_WEIGHTS) if RELEASED_WEIGHTS.is_file() else None


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
    bench_batch: int  # the ResNet throughput runs
    ocr_bench_batch: int  # the Paddle OCR throughput runs (single_gpu.yaml)
    ocr_bench_workers: int
    finetune_steps: int
    finetune_sets: tuple[str, ...]
    dist_steps: int
    bench_sets: tuple[str, ...] = ()
    ocr_bench_sets: tuple[str, ...] = ()
    train_sets: tuple[str, ...] = ()  # every ``python -m train`` run of the plan
    # Environment of the compiled runs, by framework. The dry-run's torch run sets
    # TORCHDYNAMO_DISABLE: inductor on a 2-core CPU compiles for minutes, past the dry-run's
    # budget; tests/test_compile.py runs the real compile on the CPU instead.
    compile_env: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "gpu" if self.gpu else "cpu"

    @property
    def bench_steps(self) -> int:
        """A throughput run's steps: the warm-up window, then the measured ones."""
        return self.warmup_steps + self.measure_steps


_GPU_WARMUP, _GPU_MEASURE = 16, 96
_GPU_SMOKE = ("train.log_every=10", "train.eval_every=40", "train.checkpoint_every=40")
GPU_PLAN = Plan(
    gpu=True,
    jobs=4,
    budget_s=510.0,  # one command of at most 9 minutes on a lent host, the data included
    run_timeout_s=180.0,
    # single_gpu.yaml's OCR batch of 256 for 112 steps in one epoch: 29,700 train lines
    ocr_lines=lines_for(256, _GPU_WARMUP + _GPU_MEASURE),
    images_train=128 * (_GPU_WARMUP + _GPU_MEASURE + 8),  # ResNet-50, batch 128: 112 of 120 steps
    images_val=256,
    classes=10,
    warmup_steps=_GPU_WARMUP,
    measure_steps=_GPU_MEASURE,
    smoke_steps=(80, 120),
    smoke_split="train",
    smoke_sets=dict.fromkeys(TASKS, _GPU_SMOKE),
    amp_steps=24,
    amp_sets=dict.fromkeys(TASKS, ("train.log_every=4",)),
    bench_batch=128,
    ocr_bench_batch=256,
    ocr_bench_workers=LOADER_WORKERS,
    finetune_steps=40,
    finetune_sets=("loader.batch_size=64", "train.log_every=10"),
    dist_steps=30,
)
_TINY = ("loader.batch_size=8", "optim.warmup_steps=1")
_TINY_IMAGES, _EVERY_STEP = (
    ("data.image_size=32", "data.eval_resize=36"),
    ("loader.num_workers=1", "train.log_every=1"),
)
_SMOKE = (*_EVERY_STEP, "train.eval_every=2", "train.checkpoint_every=2")
# The dry-run's steps are the fewest its checks can read (each child pays 2-4 CPU seconds of
# imports, build and checkpoint whatever its steps): a warm-up window, then two measured steps.
_DRY_WARMUP, _DRY_MEASURE, _DRY_OCR_BATCH = 1, 2, 8
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
    smoke_sets={  # resnet50's batch of 16: the whole validation file, one batch per epoch
        "ocr": (*_TINY, *_SMOKE),
        "resnet50": ("loader.batch_size=16", "optim.warmup_steps=1", *_TINY_IMAGES, *_SMOKE),
    },
    amp_steps=2,  # the fewest the config loader allows (optim.warmup_steps 1 < max_steps)
    amp_sets={"ocr": (*_TINY, *_EVERY_STEP), "resnet50": (*_TINY, *_TINY_IMAGES, *_EVERY_STEP)},
    bench_batch=4,
    ocr_bench_batch=_DRY_OCR_BATCH,
    ocr_bench_workers=1,
    finetune_steps=2,
    finetune_sets=("loader.batch_size=4", *_EVERY_STEP),
    dist_steps=3,
    bench_sets=("model.name=resnet18", *_TINY_IMAGES),
    ocr_bench_sets=("data.image_shape=[3,32,160]", "model.name=crnn_tiny"),
    # No plots: nothing reads them, and matplotlib costs 0.6-0.9 CPU seconds in each run.
    train_sets=("output.plots=false",),
    compile_env={"torch": {"TORCHDYNAMO_DISABLE": "1"}},
)


# Where a task's synthetic data lies under WORK/data ({split}: train or val), as the _data helper
# writes it, and the other files it reads, by config field.
SYNTHETIC_DATA = {
    "ocr": ("ocr/{split}", {"data.char_dict": "ocr/charset.txt"}),
    "resnet50": ("imagenet/{split}.h5", {}),
}


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def data_sets(work: Path, task: str, val: bool = True, train_split: str = "train") -> list[str]:
    """--set items for ``task``'s synthetic data (by split) and the files it reads besides."""
    (split, files), data = SYNTHETIC_DATA[task], work / "data"
    items = [f"{field}={data / path}" for field, path in files.items()]
    items.append(f"data.train={data / split.format(split=train_split)}")
    return [*items, f"data.val={data / split.format(split='val')}" if val else "data.val=null"]


def train_commands(plan: Plan, work: Path) -> dict[str, list[str]]:
    """Every ``python -m train`` command line of ``plan`` by run name (the smoke runs' legs
    ``.1``, ``.2`` and ``.straight``); ``throughput.synthetic``: the ``_synthetic`` helper's
    --config and --set items."""
    device, on = f"train.device={plan.device}", {True: "true", False: "false"}

    def train(name: str, config: str, framework: str, *overrides: str, resume=False) -> list[str]:
        overrides = (f"framework={framework}", device, *overrides, *plan.train_sets)
        out, end = str(work / "runs" / name), "--resume" if resume else "--overwrite"
        return ["--config", config, "--output-dir", out, *sets(*overrides), end]

    def steps(count: int, warmup: int) -> list[str]:
        every = (f"train.eval_every={count}", f"train.checkpoint_every={count}")
        return [f"train.max_steps={count}", *every, f"optim.warmup_steps={warmup}"]

    # A throughput run: the first logging window is the warm-up, every later one is measured;
    # no validation data (nothing to evaluate), one checkpoint at the end.
    timed = [*steps(plan.bench_steps, plan.warmup_steps), f"train.log_every={plan.warmup_steps}"]
    bench = ["train.amp=bf16", *data_sets(work, "resnet50", val=False)]
    bench += [f"loader.batch_size={plan.bench_batch}", *plan.bench_sets]
    synthetic = ["--config", RESNET_SINGLE, *sets("framework=torch", device, *bench)]
    commands = {"throughput.synthetic": synthetic}
    loader = [*bench, f"loader.num_workers={LOADER_WORKERS}"]
    for name, prefetch in ((TIMED_CHECKS[1], True), ("prefetcher.off", False)):
        prefetcher = f"loader.device_prefetch={on[prefetch]}"
        commands[name] = train(name, RESNET_SINGLE, "torch", *loader, prefetcher, *timed)
    ring = [*data_sets(work, "ocr", val=False), f"loader.batch_size={plan.ocr_bench_batch}"]
    ring += [f"loader.num_workers={plan.ocr_bench_workers}", *plan.ocr_bench_sets]
    for leg in ("on", "off"):
        name, knob = f"throughput.paddle.ocr.ring_{leg}", f"loader.batch_ring={on[leg == 'on']}"
        commands[name] = train(name, OCR_SINGLE, "paddle", *ring, knob, *timed)
    # train.compile off and on: torch's ResNet-50 loader run, Paddle's OCR smoke config; every
    # step logged, so the first step's time (the compile) and the later ones' can be told apart.
    compiled = [*steps(plan.bench_steps, plan.warmup_steps), "train.log_every=1"]
    for framework, task in COMPILE_RUNS:
        base = [RESNET_SINGLE, framework, *loader, "loader.device_prefetch=true", *timed]
        if framework == "paddle":
            base = [f"configs/{task}/smoke.yaml", framework, *data_sets(work, task, val=False)]
            base += plan.amp_sets[task]
        for leg in ("off", "on"):
            name = f"compile.{framework}.{task}.{leg}"
            commands[name] = train(name, *base, f"train.compile={on[leg == 'on']}", *compiled)
    for name in (n for n in CORRECTNESS_CHECKS if n.startswith("amp.")):
        _, framework, task, dtype = name.split(".")
        amp = [f"train.amp={dtype}", *steps(plan.amp_steps, max(1, plan.amp_steps // 4))]
        amp += [*data_sets(work, task), *plan.amp_sets[task]]
        commands[name] = train(name, f"configs/{task}/smoke.yaml", framework, *amp)
    # Smoke: leg 1 from scratch to smoke_steps[0], leg 2 --resume to [1], and the same steps
    # straight from scratch in a folder of its own. A constant rate after the warm-up: the first
    # leg then follows the straight run's rates, so their final losses can be compared.
    for framework, task in SMOKE_RUNS:
        name = f"smoke.{framework}.{task}"
        common = [f"configs/{task}/smoke.yaml", framework]
        common += [*data_sets(work, task, train_split=plan.smoke_split), *plan.smoke_sets[task]]
        common.append("optim.schedule=constant")
        first, total = (f"train.max_steps={count}" for count in plan.smoke_steps)
        commands[f"{name}.1"] = train(name, *common, first)
        commands[f"{name}.2"] = train(name, *common, total, resume=True)
        commands[f"{name}.straight"] = train(f"{name}.straight", *common, total)
    name, count = "finetune.paddle.ppocrv4", plan.finetune_steps
    finetune = [*data_sets(work, "ocr"), f"model.init_from={FINETUNE_INIT or 'null'}"]
    finetune += [*steps(count, max(1, count // 4)), *plan.finetune_sets]
    commands[name] = train(name, "configs/ocr/finetune_ppocrv4.yaml", "paddle", *finetune)
    return commands
