"""The ``python -m train`` command lines of a plan: smoke (two legs), AMP, loader throughput and
the synthetic-input run. Pure functions of (plan, work folder), so that the ``configs`` check can
validate every command of both plans, the GPU one included, wherever it runs (make test runs the
dry-run).
"""

from __future__ import annotations

from pathlib import Path

from .plan import AMP_DTYPES, COMPILE_RUNS, FRAMEWORKS, TASKS, WORKER_COUNTS, Plan
from .util import sets


def data_sets(work: Path, task: str, val: bool = True, train_split: str = "train") -> list[str]:
    """--set items for the synthetic data: OCR LMDBs or HDF5 files, by split."""
    data = work / "data"
    if task == "ocr":
        split = {name: data / "ocr" / name for name in ("train", "val")}
        items = [f"data.char_dict={data / 'ocr' / 'charset.txt'}"]
    else:
        split = {name: data / "imagenet" / f"{name}.h5" for name in ("train", "val")}
        items = []
    items.append(f"data.train={split[train_split]}")
    items.append(f"data.val={split['val']}" if val else "data.val=null")
    return items


def smoke_args(plan: Plan, work: Path, framework: str, task: str, leg: int) -> list[str]:
    """Leg 1: the smoke config from scratch to smoke_steps[0]; leg 2: --resume to [1]."""
    name = f"smoke.{framework}.{task}"
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        *data_sets(work, task, train_split=plan.smoke_split),
        *plan.smoke_sets[task],
        f"train.max_steps={plan.smoke_steps[leg - 1]}",
    ]
    return [
        "--config",
        f"configs/{task}/smoke.yaml",
        "--output-dir",
        str(work / "runs" / name),
        *sets(*overrides),
        "--overwrite" if leg == 1 else "--resume",
    ]


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
    return [
        "--config",
        f"configs/{task}/smoke.yaml",
        "--output-dir",
        str(work / "runs" / name),
        "--overwrite",
        *sets(*overrides),
    ]


def bench_overrides(plan: Plan, work: Path) -> list[str]:
    """single_gpu.yaml as the throughput runs and the synthetic-input run use it."""
    return [
        "framework=torch",
        f"train.device={plan.device}",
        "train.amp=bf16",
        *data_sets(work, "resnet50", val=False),
        f"loader.batch_size={plan.bench_batch}",
        *plan.bench_sets,
    ]


def bench_args(plan: Plan, work: Path, name: str, workers: int, prefetch: bool = True) -> list[str]:
    """A loader throughput run; ``prefetch`` False switches the torch backend's side-stream
    prefetcher off (loader.device_prefetch)."""
    overrides = [
        *bench_overrides(plan, work),
        f"loader.num_workers={workers}",
        f"loader.device_prefetch={'true' if prefetch else 'false'}",
        f"train.max_steps={plan.bench_steps}",
        f"train.log_every={plan.bench_log_every}",
        f"train.checkpoint_every={plan.bench_steps}",
        f"optim.warmup_steps={plan.bench_steps // 2}",  # base.yaml's 500 is past the end
    ]
    return [
        "--config",
        "configs/resnet50/single_gpu.yaml",
        "--output-dir",
        str(work / "runs" / name),
        "--overwrite",
        *sets(*overrides),
    ]


def compile_args(plan: Plan, work: Path, framework: str, task: str, compiled: bool) -> list[str]:
    """A train.compile run, off or on: torch's single_gpu ResNet-50 as the loader runs use it
    (widest worker count), Paddle's OCR smoke config; every step logged, so the first step's
    time (the compile) and the later ones' can be told apart."""
    name = f"compile.{framework}.{task}.{'on' if compiled else 'off'}"
    steps = plan.compile_steps
    common = [
        f"train.compile={'true' if compiled else 'false'}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        f"train.checkpoint_every={steps}",
    ]
    if framework == "torch":
        args = bench_args(plan, work, name, WORKER_COUNTS[-1])
        return [*args, *sets(*common)]
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        f"train.eval_every={steps}",
        f"optim.warmup_steps={max(1, steps // 4)}",
        *data_sets(work, task),
        *plan.amp_sets[task],
        *common,
    ]
    return [
        "--config",
        f"configs/{task}/smoke.yaml",
        "--output-dir",
        str(work / "runs" / name),
        "--overwrite",
        *sets(*overrides),
    ]


def all_train_commands(plan: Plan, work: Path) -> dict[str, list[str]]:
    """Every ``python -m train`` command line of ``plan``, by run name."""
    commands = {}
    for framework, task in (("paddle", "ocr"), ("torch", "resnet50")):
        for leg in (1, 2):
            commands[f"smoke.{framework}.{task}.{leg}"] = smoke_args(
                plan, work, framework, task, leg
            )
    for framework in FRAMEWORKS:
        for task in TASKS:
            for dtype in AMP_DTYPES:
                name = f"amp.{framework}.{task}.{dtype}"
                commands[name] = amp_args(plan, work, framework, task, dtype)
    for workers in WORKER_COUNTS:
        name = f"throughput.loader.w{workers}"
        commands[name] = bench_args(plan, work, name, workers)
    commands["prefetcher.off"] = bench_args(
        plan, work, "prefetcher.off", WORKER_COUNTS[-1], prefetch=False
    )
    for framework, task in COMPILE_RUNS:
        for compiled in (False, True):
            name = f"compile.{framework}.{task}.{'on' if compiled else 'off'}"
            commands[name] = compile_args(plan, work, framework, task, compiled)
    commands["throughput.synthetic"] = [
        "--config",
        "configs/resnet50/single_gpu.yaml",
        *sets(*bench_overrides(plan, work)),
    ]
    return commands
