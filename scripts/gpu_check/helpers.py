"""The helper commands, which the orchestrator runs as children with a framework's interpreter
(``python -m scripts.gpu_check _NAME ...``, from the repository root): ``_probe``
(device_probe.py), ``_configs`` (command lines through the config loader), ``_data`` (synthetic
datasets), ``_train`` (``python -m train`` plus peak device memory and, for fp16, the loss
scale), ``_synthetic`` (ResNet-50 steps on random device tensors), ``_toolchain`` (what
torch.compile needs) and ``_ranks`` (one rank of the two-rank gloo run, under torchrun). Each
answers in a stats file or one ``GPU-CHECK`` line. Framework and project imports happen inside
them, in that interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from .device_probe import helper_probe
from .plan import FRAMEWORKS
from .util import emit, short_error


def helper_configs(args: argparse.Namespace) -> int:
    """load_config() on the --config and --set items of each command line: the errors, by name."""
    from train.config import load_config

    commands = json.loads(Path(args.commands).read_text())
    errors = {}
    for name, argv in commands.items():
        config = argv[argv.index("--config") + 1]
        overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        try:
            load_config(config, overrides)
        except Exception as error:  # ConfigError, or whatever else the loader raises
            errors[name] = (
                short_error(error) if not str(error).startswith("config error") else str(error)
            )
    emit({"validated": len(commands), "errors": errors})
    return 0


def _imagenet_chunk(job: tuple[int, int, int]) -> list[tuple[bytes, int]]:
    from datasets.synthetic import imagenet_samples

    count, classes, seed = job
    return list(imagenet_samples(count, classes, seed))


def helper_data(args: argparse.Namespace) -> int:
    """Digit lines for the OCR (as make train-ocr) and ImageNet-like JPEGs, written with the
    project's writers; the images are drawn in parallel (one chunk per seed)."""
    started = time.perf_counter()
    out = Path(args.out)
    _write_ocr(out / "ocr", args.ocr_lines)
    _write_images(out / "imagenet", args.images_train, args.images_val, args.classes)
    emit(
        {
            "ocr_lines": args.ocr_lines,
            "images_train": args.images_train,
            "images_val": args.images_val,
            "classes": args.classes,
            "seconds": round(time.perf_counter() - started, 1),
        }
    )
    return 0


def _ocr_chunk(job: tuple[int, int]) -> list:
    from datasets.synthetic import ocr_charset, ocr_samples

    count, seed = job
    charset, font = ocr_charset("digits")
    return list(ocr_samples(count, charset, font, seed, max_len=6))


def _chunks(count: int, seed: int, size: int) -> list[tuple[int, int]]:
    """(count, seed) jobs of ``size`` samples each: one seed per chunk, the same for any pool."""
    return [(min(size, count - start), seed + start) for start in range(0, count, size)]


def _pool():
    import multiprocessing

    return multiprocessing.get_context("fork").Pool(max(1, min(16, os.cpu_count() or 1)))


def _write_ocr(ocr: Path, lines: int) -> None:
    """charset.txt and the train and val LMDBs (a tenth of the lines, at least 8, for val), the
    lines drawn by a pool of processes in chunks of 500."""
    from datasets.lmdb_ocr import LmdbOcrWriter
    from datasets.synthetic import ocr_charset, write_all

    charset, _ = ocr_charset("digits")
    ocr.mkdir(parents=True, exist_ok=True)
    (ocr / "charset.txt").write_text("".join(c + "\n" for c in charset), encoding="utf-8")
    val_lines = max(8, lines // 10)
    with _pool() as pool:
        for split, count, seed in (("train", lines - val_lines, 0), ("val", val_lines, 1_000_003)):
            rows = (
                row for part in pool.imap(_ocr_chunk, _chunks(count, seed, 500)) for row in part
            )
            write_all(LmdbOcrWriter(ocr / split, overwrite=True), rows)


def _write_images(imagenet: Path, train: int, val: int, classes: int) -> None:
    """train.h5 and val.h5, their JPEGs drawn by a pool of processes in chunks of 32."""
    from datasets.hdf5_images import Hdf5ImageWriter
    from datasets.synthetic import write_all

    names = [f"class_{i:04d}" for i in range(classes)]
    with _pool() as pool:
        for split, count, seed in (("train", train, 0), ("val", val, 1_000_003)):
            jobs = [(n, classes, s) for n, s in _chunks(count, seed, 32)]
            writer = Hdf5ImageWriter(imagenet / f"{split}.h5", names, overwrite=True)
            rows = (sample for part in pool.imap(_imagenet_chunk, jobs) for sample in part)
            write_all(
                writer,
                ((image, label, f"{split}-{i:06d}.jpg") for i, (image, label) in enumerate(rows)),
            )


def _peak_memory_mb() -> tuple[str, float | None]:
    """The framework's device and its peak allocated device memory in this process (MiB)."""
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            return f"cuda:{torch.cuda.current_device()}", torch.cuda.max_memory_allocated() / 2**20
        return "cpu", None
    if "paddle" in sys.modules:
        import paddle

        device = paddle.device.get_device()
        if device.startswith("gpu"):
            return device, paddle.device.cuda.max_memory_allocated() / 2**20
        return device, None
    return "none", None


def helper_train(args: argparse.Namespace) -> int:
    """``python -m train ARGS`` in this process (runpy, as -m does), then the peak device memory
    into the stats file."""
    import runpy

    stats: dict = {}
    code: int | str | None = 0
    scales = _record_loss_scale(args.train_args) if os.environ.get("GPU_CHECK_LOSS_SCALE") else None
    try:
        sys.argv = ["python -m train", *args.train_args]
        runpy.run_module("train", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException as error:
        stats["error"] = short_error(error)
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            stats["device"], stats["peak_mem_mb"] = _peak_memory_mb()
        stats["exit"] = code
        if scales is not None:
            stats["loss_scale"] = _scale_trajectory(scales)
        Path(args.stats).write_text(json.dumps(stats, default=str))
    if isinstance(code, str):
        print(code, file=sys.stderr)
        return 1
    return int(code or 0)


def _record_loss_scale(train_args: list[str]) -> list[float]:
    """After each update of an enabled GradScaler (the framework's class, patched in this
    process before the run imports it), its scale: the fp16 loss-scale trajectory. Reading it
    waits for the device once per step: only the AMP checks, which are not timed, ask for it."""
    scales: list[float] = []
    if "framework=paddle" in train_args:
        import paddle

        scaler_class = paddle.amp.GradScaler

        def current(scaler):
            return float(scaler._scale) if scaler.is_enable() else None
    else:
        import torch

        scaler_class = torch.amp.GradScaler

        def current(scaler):
            return float(scaler.get_scale()) if scaler.is_enabled() else None

    update = scaler_class.update

    def recording_update(self, *args, **kwargs):
        result = update(self, *args, **kwargs)
        with contextlib.suppress(Exception):  # telemetry never ends the run
            value = current(self)
            if value is not None:
                scales.append(value)
        return result

    scaler_class.update = recording_update
    return scales


def _scale_trajectory(scales: list[float]) -> dict | None:
    """The loss scale after each update, as its changes: [update number, scale] at the first
    update and at every change; None when no enabled scaler ran (the CPU)."""
    if not scales:
        return None
    changes = [[1, scales[0]]]
    for number, (before, after) in enumerate(zip(scales, scales[1:]), start=2):
        if after != before:
            changes.append([number, after])
    return {
        "source": "GradScaler.update",
        "updates": len(scales),
        "changes": changes,
        "final": scales[-1],
    }


def helper_toolchain(args: argparse.Namespace) -> int:
    """What torch.compile needs here, as the torch backend checks it: a C++ compiler (inductor's
    CPU kernels), a C compiler (Triton's CUDA launcher), Python.h of this Python."""
    import shutil
    import sysconfig

    cxx = os.environ.get("CXX", "g++")
    c_compilers = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "clang"]
    cc = next((shutil.which(c) for c in c_compilers if shutil.which(c)), None)
    include = Path(sysconfig.get_path("include"))
    found = {
        "cxx": shutil.which(cxx),
        "cc": cc,
        "python_h": str(include / "Python.h") if (include / "Python.h").is_file() else None,
    }
    missing = []
    if found["cxx"] is None:
        missing.append(f"a C++ compiler ({cxx})")
    if found["cc"] is None:
        missing.append(f"a C compiler ({' or '.join(c_compilers)})")
    if found["python_h"] is None:
        missing.append(f"Python's headers ({include}/Python.h)")
    emit({**found, "missing": missing})
    return 0


def helper_ranks(args: argparse.Namespace) -> int:
    """One rank of the two-rank run (under torchrun): DistributedDataParallel over gloo on the
    one GPU (or the CPU), a small conv net with BatchNorm, Adam, each rank on its own batches.
    Rank 0 writes whether the ranks ended with equal parameters, the loss and the step time."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = args.device == "gpu"
    if gpu:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them too)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 4),
    ).to(device)
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0] if gpu else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    images = torch.randn(16, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 4, (16,), generator=generator).to(device)
    losses = []
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    step_s = (time.perf_counter() - started) / args.steps
    flat = torch.cat([p.detach().flatten() for p in net.parameters()]).cpu()
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        stats = {
            "world_size": world,
            "backend": dist.get_backend(),
            "device": f"cuda:0 ({torch.cuda.get_device_name(0)})" if gpu else "cpu",
            "steps": args.steps,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "loss_fell": losses[-1] < losses[0],
            "param_max_diff": max(float((g - gathered[0]).abs().max()) for g in gathered),
            "step_s": step_s,
        }
        Path(args.stats).write_text(json.dumps(stats))
    dist.destroy_process_group()
    return 0


def _make_backend(config):
    """train/backends' make_backend, wherever this checkout keeps it."""
    try:
        from train.backends import make_backend
    except ImportError:  # before train/backends/__init__.py registered the backends
        from train.backends.base import make_backend
    return make_backend(config)


def _build(backend, config, num_classes: int, total_steps: int) -> None:
    """Backend.build for either form of the contract: build(model, optim, input_shape,
    num_classes, total_steps) or the older build(num_classes, total_steps)."""
    import inspect

    if "optim" in inspect.signature(backend.build).parameters:
        shape = (3, config.data.image_size, config.data.image_size)  # the ResNet task's input
        backend.build(config.model, config.optim, shape, num_classes, total_steps)
    else:
        backend.build(num_classes, total_steps)


def helper_synthetic(args: argparse.Namespace) -> int:
    """The torch backend's own build() and train_step() on random device tensors (NCHW,
    channels-last on CUDA, as its device_batches hands them over): the images/s with no loader."""
    import torch

    from train.config import load_config

    config = load_config(args.config, args.overrides)
    backend = _make_backend(config)
    backend.init_distributed()
    if not backend.uses_gpu:
        # The CPU number is no measurement (the dry-run's); one thread keeps it from spinning
        # against the other processes on a small host.
        torch.set_num_threads(1)
    backend.seed_everything(config.seed, config.deterministic)
    _build(backend, config, args.classes, args.warmup + args.steps)
    device = torch.device("cuda", torch.cuda.current_device()) if backend.uses_gpu else "cpu"
    size, batch_size = config.data.image_size, config.loader.batch_size
    images = torch.randn(batch_size, 3, size, size, device=device)
    if backend.uses_gpu:
        images = images.contiguous(memory_format=torch.channels_last)
    batch = {"image": images, "label": torch.randint(0, args.classes, (batch_size,), device=device)}
    final, elapsed = _timed_steps(backend, batch, args.warmup, args.steps)
    memory = torch.cuda.max_memory_allocated() / 2**20 if backend.uses_gpu else None
    backend.shutdown()
    stats = {
        "images_per_s": args.steps * batch_size / elapsed,
        "batch": batch_size,
        "image_size": size,
        "steps": args.steps,
        "model": config.model.name,
        "amp": config.train.amp if backend.uses_gpu else "none (CPU)",
        "device": backend.device_name,
        "loss": final,
        "peak_mem_mb": memory,
    }
    Path(args.stats).write_text(json.dumps(stats))
    return 0


def _timed_steps(backend, batch: dict, warmup: int, steps: int) -> tuple[float, float]:
    """``warmup`` untimed train steps, then ``steps`` timed ones: the last loss and the seconds."""
    for _ in range(warmup):
        loss = backend.train_step(batch)
    backend.to_float(loss)
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        loss = backend.train_step(batch)
    final = backend.to_float(loss)
    backend.synchronize()
    return final, time.perf_counter() - started


def helper_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check (helper)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("_probe")
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--device", choices=("gpu", "cpu"), required=True)
    p = sub.add_parser("_configs")
    p.add_argument("--commands", required=True)
    p = sub.add_parser("_data")
    p.add_argument("--out", required=True)
    for option in ("--ocr-lines", "--images-train", "--images-val", "--classes"):
        p.add_argument(option, type=int, required=True)
    p = sub.add_parser("_train")
    p.add_argument("--stats", required=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("_toolchain")
    p = sub.add_parser("_ranks")
    p.add_argument("--stats", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--device", choices=("gpu", "cpu"), required=True)
    p = sub.add_parser("_synthetic")
    p.add_argument("--stats", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    return parser


def helper_main(argv: list[str]) -> int:
    """Run the helper command ``argv[0]`` (a name starting with "_"); its exit code."""
    args = helper_parser().parse_args(argv)
    if args.command == "_train" and args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    handlers = {
        "_configs": helper_configs,
        "_probe": helper_probe,
        "_data": helper_data,
        "_train": helper_train,
        "_synthetic": helper_synthetic,
        "_toolchain": helper_toolchain,
        "_ranks": helper_ranks,
    }
    return handlers[args.command](args)
