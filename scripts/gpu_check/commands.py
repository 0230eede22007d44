"""The ``python -m train`` (and ``python -m train.export``) command lines of a plan: throughput
runs, train.compile off and on, AMP steps, smoke (two legs and a straight run), the PP-OCRv4
fine-tune. Pure functions of (plan, work folder), so that the ``configs`` check can validate
every command of both plans, the GPU one included, wherever it runs (make test runs the dry-run).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .plan import (
    AMP_DTYPES,
    COMPILE_RUNS,
    FRAMEWORKS,
    LOADER_WORKERS,
    RING_LEGS,
    TASKS,
    Plan,
)
from .util import sets


class SyntheticData(NamedTuple):
    """Where a task's synthetic data lies under WORK/data, as helpers.py writes it."""

    split: str  # a split's path, {split} for its name: "train" or "val"
    files: tuple[tuple[str, str], ...] = ()  # (data field, path) of the task's other inputs


SYNTHETIC_DATA = {
    "ocr": SyntheticData("ocr/{split}", (("data.char_dict", "ocr/charset.txt"),)),
    "resnet50": SyntheticData("imagenet/{split}.h5"),
}


def data_sets(work: Path, task: str, val: bool = True, train_split: str = "train") -> list[str]:
    """--set items for ``task``'s synthetic data (OCR LMDBs or HDF5 files, by split) and the
    files it reads besides."""
    data, synthetic = work / "data", SYNTHETIC_DATA[task]
    items = [f"{field}={data / path}" for field, path in synthetic.files]
    items.append(f"data.train={data / synthetic.split.format(split=train_split)}")
    items.append(
        f"data.val={data / synthetic.split.format(split='val')}" if val else "data.val=null"
    )
    return items


def _train_args(
    plan: Plan, config: str, out: Path, overrides: list[str], resume: bool = False
) -> list[str]:
    return [
        "--config",
        config,
        "--output-dir",
        str(out),
        *sets(*overrides, *plan.train_sets),
        "--resume" if resume else "--overwrite",
    ]


def _timed(plan: Plan, steps: int | None = None) -> list[str]:
    """A throughput run's steps: the first logging window is the warm-up, every later one is
    measured; no validation data, one checkpoint at the end."""
    steps = steps or plan.bench_steps
    return [
        f"train.max_steps={steps}",
        f"train.log_every={plan.warmup_steps}",
        f"train.eval_every={steps}",  # no validation data: nothing to evaluate
        f"train.checkpoint_every={steps}",
        f"optim.warmup_steps={plan.warmup_steps}",  # base.yaml's 500 is past the end
    ]


def smoke_args(plan: Plan, work: Path, framework: str, task: str, leg: int) -> list[str]:
    """Leg 1: the smoke config from scratch to smoke_steps[0]; leg 2: --resume to [1]; leg 0:
    straight from scratch to [1] in a folder of its own (the resumed run's loss compared)."""
    name = f"smoke.{framework}.{task}" + (".straight" if leg == 0 else "")
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        *data_sets(work, task, train_split=plan.smoke_split),
        *plan.smoke_sets[task],
        # A constant rate after the warm-up: the first leg, which ends at its own max_steps,
        # then follows the same rates as the straight run (a cosine would decay over 4 steps in
        # one and over 6 in the other), so their final losses can be compared.
        "optim.schedule=constant",
        f"train.max_steps={plan.smoke_steps[0] if leg == 1 else plan.smoke_steps[1]}",
    ]
    return _train_args(
        plan, f"configs/{task}/smoke.yaml", work / "runs" / name, overrides, leg == 2
    )


def amp_args(plan: Plan, work: Path, framework: str, task: str, dtype: str) -> list[str]:
    steps = plan.amp_steps
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        f"train.amp={dtype}",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"train.checkpoint_every={steps}",
        f"optim.warmup_steps={max(1, steps // 4)}",  # the smoke configs' 20-30 are past the end
        *data_sets(work, task),
        *plan.amp_sets[task],
    ]
    name = f"amp.{framework}.{task}.{dtype}"
    return _train_args(plan, f"configs/{task}/smoke.yaml", work / "runs" / name, overrides)


def bench_overrides(plan: Plan, work: Path) -> list[str]:
    """single_gpu.yaml as the ResNet throughput runs and the synthetic-input run use it."""
    return [
        "framework=torch",
        f"train.device={plan.device}",
        "train.amp=bf16",
        *data_sets(work, "resnet50", val=False),
        f"loader.batch_size={plan.bench_batch}",
        *plan.bench_sets,
    ]


def bench_args(plan: Plan, work: Path, name: str, prefetch: bool = True) -> list[str]:
    """The ResNet-50 loader throughput run at LOADER_WORKERS workers; ``prefetch`` False switches
    the torch backend's side-stream prefetcher off (loader.device_prefetch)."""
    overrides = [
        *bench_overrides(plan, work),
        f"loader.num_workers={LOADER_WORKERS}",
        f"loader.device_prefetch={'true' if prefetch else 'false'}",
        *_timed(plan),
    ]
    return _train_args(plan, "configs/resnet50/single_gpu.yaml", work / "runs" / name, overrides)


def ring_args(plan: Plan, work: Path, leg: str) -> list[str]:
    """The Paddle OCR throughput run (single_gpu.yaml: CRNN, shared-memory workers) with
    loader.batch_ring on or off."""
    name = f"throughput.paddle.ocr.ring_{leg}"
    overrides = [
        "framework=paddle",
        f"train.device={plan.device}",
        *data_sets(work, "ocr", val=False),
        f"loader.batch_size={plan.ocr_bench_batch}",
        f"loader.num_workers={plan.ocr_bench_workers}",
        f"loader.batch_ring={'true' if leg == 'on' else 'false'}",
        *plan.ocr_bench_sets,
        *_timed(plan),
    ]
    return _train_args(plan, "configs/ocr/single_gpu.yaml", work / "runs" / name, overrides)


def compile_args(plan: Plan, work: Path, framework: str, task: str, compiled: bool) -> list[str]:
    """A train.compile run, off or on: torch's ResNet-50 loader run, Paddle's OCR smoke config;
    every step logged, so the first step's time (the compile) and the later ones' can be told
    apart."""
    name = f"compile.{framework}.{task}.{'on' if compiled else 'off'}"
    steps = plan.bench_steps
    common = [
        f"train.compile={'true' if compiled else 'false'}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        f"train.checkpoint_every={steps}",
    ]
    if framework == "torch":
        return [*bench_args(plan, work, name), *sets(*common)]
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        f"train.eval_every={steps}",
        f"optim.warmup_steps={plan.warmup_steps}",
        *data_sets(work, task, val=False),
        *plan.amp_sets[task],
        *common,
    ]
    return _train_args(plan, f"configs/{task}/smoke.yaml", work / "runs" / name, overrides)


def finetune_args(plan: Plan, work: Path, init_from: str | None) -> list[str]:
    """The PP-OCRv4 recognizer (finetune_ppocrv4.yaml) on the synthetic digit lines: from the
    released weights when scripts/convert_weights.py has written them (the head re-initialized
    for the digit dictionary), else from scratch."""
    steps = plan.finetune_steps
    overrides = [
        "framework=paddle",
        f"train.device={plan.device}",
        *data_sets(work, "ocr"),
        f"model.init_from={init_from or 'null'}",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"train.checkpoint_every={steps}",
        f"optim.warmup_steps={max(1, steps // 4)}",
        *plan.finetune_sets,
    ]
    out = work / "runs" / "finetune.paddle.ppocrv4"
    return _train_args(plan, "configs/ocr/finetune_ppocrv4.yaml", out, overrides)


def dist_args(plan: Plan) -> list[str]:
    return ["--steps", str(plan.dist_steps), "--device", plan.device]


def all_train_commands(plan: Plan, work: Path) -> dict[str, list[str]]:
    """Every ``python -m train`` command line of ``plan``, by run name."""
    commands = {}
    commands["throughput.synthetic"] = [
        "--config",
        "configs/resnet50/single_gpu.yaml",
        *sets(*bench_overrides(plan, work)),
    ]
    name = f"throughput.loader.w{LOADER_WORKERS}"
    commands[name] = bench_args(plan, work, name)
    commands["prefetcher.off"] = bench_args(plan, work, "prefetcher.off", prefetch=False)
    for framework, task_name in COMPILE_RUNS:
        for compiled in (False, True):
            name = f"compile.{framework}.{task_name}.{'on' if compiled else 'off'}"
            commands[name] = compile_args(plan, work, framework, task_name, compiled)
    for leg in RING_LEGS:
        commands[f"throughput.paddle.ocr.ring_{leg}"] = ring_args(plan, work, leg)
    for framework in FRAMEWORKS:
        for task_name in TASKS:
            for dtype in AMP_DTYPES:
                name = f"amp.{framework}.{task_name}.{dtype}"
                commands[name] = amp_args(plan, work, framework, task_name, dtype)
    for framework, task_name in (("torch", "resnet50"), ("paddle", "ocr")):
        for leg, label in ((1, "1"), (2, "2"), (0, "straight")):
            commands[f"smoke.{framework}.{task_name}.{label}"] = smoke_args(
                plan, work, framework, task_name, leg
            )
    commands["finetune.paddle.ppocrv4"] = finetune_args(plan, work, None)
    return commands
