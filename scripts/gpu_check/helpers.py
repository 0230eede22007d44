"""The helper commands, run by a framework's interpreter as ``python -m scripts.gpu_check _NAME
--stats FILE ...`` from the repository root, each answering in FILE; they import the frameworks."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

from datasets.safe_files import write_atomic

from .commands import DRY_PLAN, GPU_PLAN, train_commands

# What the data layer imports beside the framework: a preinstalled GPU host has the first four,
# the wheelhouse brings the rest (requirements/gpu-wheelhouse.txt).
PROJECT_IMPORTS = ("cv2", "h5py", "PIL", "yaml", "lmdb", "simplejpeg", "isal")
RUN_LINE = re.compile(r"INFO train: run .*?: \w+ \w+ on (.+?), \d+ rank")
RESUMED = re.compile(r"resumed from (\S+) \(epoch (\d+), step (\d+)\)")
CPU_AMP_WARNING = "but the device is the CPU: training in float32"


def answer(args: argparse.Namespace, payload: dict) -> int:
    write_atomic(args.stats, json.dumps(payload, default=str))
    return 0


def short_error(error: BaseException) -> str:
    """An exception's type and the last line of its message that names an error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if "rror" in x), lines[-1] if lines else "")
    return f"{type(error).__name__}: {line}"[:600]


def helper_probe(args: argparse.Namespace) -> int:
    """The build's facts, then each op on its own, so that the first failing one names the
    library; the training step has the kernels a build can lack while its forward ops run."""
    facts: dict = {"framework": args.framework, "device": args.device}
    ops: dict[str, str] = {}
    try:
        probe = _probe_torch if args.framework == "torch" else _probe_paddle
        for name, op in probe(facts, args.device == "gpu").items():
            try:
                op()
                ops[name] = "ok"
            except Exception as error:
                ops[name] = short_error(error)
    except BaseException as error:  # noqa: BLE001  (report, whatever it is)
        return answer(args, {**facts, "ok": False, "error": short_error(error), "ops": ops})
    bad = "; ".join(f"{name}: {result}" for name, result in ops.items() if result != "ok")
    return answer(args, {**facts, "ok": not bad, "ops": ops, **({"error": bad} if bad else {})})


def _small_net(nn, dims: str, width: int):
    """Conv, BatchNorm, ReLU, pooling, a linear head; ``dims``: "2d" (torch), "2D" (Paddle)."""
    conv, norm, pool = (getattr(nn, k + dims) for k in ("Conv", "BatchNorm", "AdaptiveAvgPool"))
    head = (nn.ReLU(), pool(1), nn.Flatten(), nn.Linear(width, 4))
    return nn.Sequential(conv(3, width, 3, padding=1), norm(width), *head)


def _fit_torch(torch, model, images, labels, steps: int) -> list[float]:
    """``steps`` Adam steps of cross-entropy on one batch: the losses."""
    optimizer, losses = torch.optim.Adam(model.parameters(), lr=1e-2), []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _trained(losses: list[float], weight_moved: bool, running_mean: float) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert weight_moved, "Adam did not change the weights"
    assert running_mean > 0, "BatchNorm's running mean did not move"


def _twelve(value: float) -> None:
    assert value == 12.0, value


def _toolchain() -> dict:
    """What torch.compile lacks here for a CUDA run, as the torch backend checks it."""
    try:
        from train.backends.torch.trainer import _check_compile_toolchain

        _check_compile_toolchain("cuda")
        return {"missing": []}
    except Exception as error:  # RunError: "train.compile: true needs A and B, which ..."
        needs = str(error).partition(" needs ")[2].partition(", which ")[0]
        return {"missing": needs.split(" and ") if needs else [f"no answer: {short_error(error)}"]}


def _probe_torch(facts: dict, gpu: bool) -> dict:
    import numpy
    import torch
    import torch.nn.functional as F

    facts.update(version=torch.__version__, cuda=torch.version.cuda, numpy=numpy.__version__)
    facts.update(compiled_with_cuda=torch.version.cuda is not None, python=sys.version.split()[0])
    facts["cudnn_runtime"] = torch.backends.cudnn.version()
    facts["imports"] = {name: _origin(name) for name in PROJECT_IMPORTS}
    missing = [name for name, origin in facts["imports"].items() if origin is None]
    if missing:
        facts["missing_imports"] = missing
        raise ImportError(f"the project's data layer needs {', '.join(missing)}")
    facts["toolchain"] = _toolchain()
    if gpu and not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    if gpu:
        facts.update(
            device_name=torch.cuda.get_device_name(0), arch_list=torch.cuda.get_arch_list()
        )
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    device, nn = torch.device("cuda", 0) if gpu else torch.device("cpu"), torch.nn

    def randn(*shape):
        return torch.randn(*shape, device=device)

    def ctc():
        long = {"dtype": torch.long, "device": device}
        targets = torch.tensor([[1, 2], [3, 4]], **long)
        lengths = torch.full((2,), 10, **long), torch.full((2,), 2, **long)
        float(F.ctc_loss(randn(10, 2, 5).log_softmax(2), targets, *lengths))

    def train_step():
        torch.manual_seed(0)
        net = _small_net(nn, "2d", 8).to(device).train()
        before, images = net[0].weight.detach().clone(), randn(8, 3, 16, 16)
        losses = _fit_torch(torch, net, images, torch.randint(0, 4, (8,), device=device), 2)
        moved = bool((net[0].weight != before).any())
        _trained(losses, moved, float(net[1].running_mean.abs().sum()))

    lstm = nn.LSTM(8, 8, bidirectional=True)
    return {
        "elementwise": lambda: _twelve(float((torch.arange(4.0, device=device) * 2).sum())),
        "matmul": lambda: float((randn(64, 64) @ randn(64, 64)).sum()),
        "conv2d": lambda: float(nn.Conv2d(3, 8, 3).to(device)(randn(2, 3, 16, 16)).sum()),
        "lstm": lambda: float(lstm.to(device)(randn(5, 2, 8))[0].sum()),
        "ctc_loss": ctc,
        "train_step": train_step,
    }


def _probe_paddle(facts: dict, gpu: bool) -> dict:
    try:
        import paddle
        import paddle.nn.functional as F
    except ImportError as error:
        facts["import_error"] = short_error(error)
        raise
    compiled = bool(paddle.is_compiled_with_cuda())
    cuda, cudnn = (paddle.version.cuda(), paddle.version.cudnn()) if compiled else (None, None)
    facts.update(version=paddle.__version__, compiled_with_cuda=compiled, cuda=cuda, cudnn=cudnn)
    if gpu and not compiled:
        raise RuntimeError("this is Paddle's CPU build")
    if gpu and paddle.device.cuda.device_count() == 0:
        raise RuntimeError("Paddle sees no GPU (paddle.device.cuda.device_count() == 0)")
    paddle.set_device("gpu:0" if gpu else "cpu")
    if gpu:
        capability = tuple(paddle.device.cuda.get_device_capability(0))
        facts.update(
            device_name=paddle.device.cuda.get_device_name(0),
            capability=".".join(map(str, capability)),
        )
        facts["cudnn_runtime"] = paddle.get_cudnn_version()
        facts["arch_problem"] = paddle_arch_problem(facts["version"], facts["cuda"], capability)
        if facts["arch_problem"] and facts["arch_problem"]["fatal"]:
            # A CUDA 11.x build on Hopper passes small ops and aborts later in training: no op
            # runs, the build is refused by its facts.
            raise RuntimeError(facts["arch_problem"]["reason"])
    nn, randn = paddle.nn, paddle.randn

    def ctc():
        labels = paddle.to_tensor([[1, 2], [3, 4]], dtype="int32")
        lengths = (paddle.full([2], 10, dtype="int64"), paddle.full([2], 2, dtype="int64"))
        float(F.ctc_loss(randn([10, 2, 5]), labels, *lengths, blank=0, reduction="mean"))

    def train_step():
        paddle.seed(0)
        net = _small_net(nn, "2D", 8)
        net.train()
        optimizer = paddle.optimizer.Adam(learning_rate=1e-2, parameters=net.parameters())
        images, labels = randn([8, 3, 16, 16]), paddle.randint(0, 4, [8])
        before, losses = net[0].weight.numpy().copy(), []
        for _ in range(2):
            loss = F.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        moved = bool((net[0].weight.numpy() != before).any())
        _trained(losses, moved, float(net[1]._mean.abs().sum()))

    return {
        "elementwise": lambda: _twelve(float((paddle.arange(4, dtype="float32") * 2).sum())),
        "matmul": lambda: float(paddle.matmul(randn([64, 64]), randn([64, 64])).sum()),
        "conv2d": lambda: float(nn.Conv2D(3, 8, 3)(randn([2, 3, 16, 16])).sum()),
        "lstm": lambda: float(nn.LSTM(8, 8, direction="bidirect")(randn([2, 5, 8]))[0].sum()),
        "ctc_loss": ctc,
        "train_step": train_step,
    }


def paddle_arch_problem(version: str, cuda: str | None, capability: tuple) -> dict | None:
    """The doctor's verdict on this Paddle build for a GPU of ``capability``: None, or its
    reason, fix and whether it is fatal."""
    from train.backends.gpu_probe import FrameworkCuda
    from train.backends.gpu_verdicts import arch_problem

    build = FrameworkCuda("paddle", version=version, cuda=cuda, compiled=cuda is not None)
    problem = arch_problem(build, (int(capability[0]), int(capability[1])))
    return None if problem is None else problem._asdict()


def _origin(name: str) -> str | None:
    """Where module ``name`` is imported from; None when it does not import."""
    try:
        return str(getattr(importlib.import_module(name), "__file__", None) or name)
    except ImportError:
        return None


def helper_configs(args: argparse.Namespace) -> int:
    """load_config() on each training command line of both plans: the errors, by name."""
    from train.config.load import load_config

    plans = {"gpu": GPU_PLAN, "dry-run": DRY_PLAN}
    commands = {
        f"{label}:{name}": argv
        for label, plan in plans.items()
        for name, argv in train_commands(plan, Path(args.work)).items()
    }
    errors = {}
    for name, argv in commands.items():
        overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        try:
            load_config(argv[argv.index("--config") + 1], overrides)
        except Exception as error:  # ConfigError, or whatever else the loader raises
            said = str(error)
            errors[name] = said if said.startswith("config error") else short_error(error)
    return answer(args, {"validated": len(commands), "errors": errors})


def _chunk(job: tuple) -> list:
    """A pool's job: ``count`` digit lines or ImageNet-like JPEGs of one seed."""
    from datasets import synthetic

    kind, count, *rest = job
    if kind == "imagenet":
        return list(synthetic.imagenet_samples(count, *rest))
    charset, font = synthetic.ocr_charset("digits")
    return list(synthetic.ocr_samples(count, charset, font, rest[0], max_len=6))


def helper_data(args: argparse.Namespace) -> int:
    """Digit lines (LMDBs, a tenth for val) and ImageNet-like JPEGs (HDF5) with the project's
    writers, drawn by a pool of processes in chunks of a seed each (the same for any pool)."""
    import multiprocessing

    from datasets.hdf5_images import Hdf5ImageWriter
    from datasets.lmdb_ocr import LmdbOcrWriter
    from datasets.synthetic import ocr_charset, write_all

    started = time.perf_counter()
    ocr, imagenet = Path(args.out) / "ocr", Path(args.out) / "imagenet"
    ocr.mkdir(parents=True, exist_ok=True)
    write_atomic(ocr / "charset.txt", "".join(c + "\n" for c in ocr_charset("digits")[0]))
    val_lines = max(8, args.ocr_lines // 10)
    names = [f"class_{i:04d}" for i in range(args.classes)]

    def drawn(kind: str, count: int, seed: int, size: int, *extra):
        jobs = [(kind, min(size, count - i), *extra, seed + i) for i in range(0, count, size)]
        return (sample for part in pool.imap(_chunk, jobs) for sample in part)

    with multiprocessing.get_context("fork").Pool(max(1, min(16, os.cpu_count() or 1))) as pool:
        for split, lines, images, seed in (
            ("train", args.ocr_lines - val_lines, args.images_train, 0),
            ("val", val_lines, args.images_val, 1_000_003),
        ):
            write_all(LmdbOcrWriter(ocr / split, overwrite=True), drawn("ocr", lines, seed, 500))
            writer = Hdf5ImageWriter(imagenet / f"{split}.h5", names, overwrite=True)
            samples = drawn("imagenet", images, seed, 32, args.classes)
            write_all(writer, ((x, y, f"{split}-{i:06d}.jpg") for i, (x, y) in enumerate(samples)))
    sizes = {k: getattr(args, k) for k in ("ocr_lines", "images_train", "images_val", "classes")}
    return answer(args, {**sizes, "seconds": round(time.perf_counter() - started, 1)})


def _peak_memory_mb() -> tuple[str, float | None]:
    """The framework's device and its peak allocated device memory in this process (MiB)."""
    torch, paddle = sys.modules.get("torch"), sys.modules.get("paddle")
    if torch is not None and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}", torch.cuda.max_memory_allocated() / 2**20
    if torch is not None or paddle is None:
        return "cpu" if torch is not None else "none", None
    device = paddle.device.get_device()
    gpu = device.startswith("gpu")
    return device, paddle.device.cuda.max_memory_allocated() / 2**20 if gpu else None


def _run_facts(train_args: list[str], device: str | None) -> dict:
    """What the run left, read with the trainer's own readers; from train.log the device it
    trained on, the step it resumed from, whether AMP fell back to float32."""
    from train.checkpoint import latest
    from train.report import read_metrics

    run_dir = Path(train_args[train_args.index("--output-dir") + 1])
    log, resolved, summary = (
        (run_dir / name).read_text("utf-8", "replace") if (run_dir / name).is_file() else ""
        for name in ("train.log", "config.resolved.yaml", "summary.json")
    )
    trained_on, resumed, checkpoint = RUN_LINE.findall(log), RESUMED.findall(log), latest(run_dir)
    facts = {"device": trained_on[-1] if trained_on else device, "resolved": resolved}
    facts["records"] = [r for r in read_metrics(run_dir) if r.get("type") == "train"]
    facts["summary"] = json.loads(summary) if summary else {}
    facts["checkpoint"] = checkpoint.name if checkpoint else None
    facts["resumed_from_step"] = int(resumed[-1][2]) if resumed else None
    return {**facts, "float32_warning": CPU_AMP_WARNING in log}


def helper_train(args: argparse.Namespace) -> int:
    """``python -m train ARGS`` in this process, then its device, peak memory, what it left."""
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
        try:
            stats["run"] = _run_facts(args.train_args, stats.get("device"))
        except Exception as error:
            stats["run_error"] = short_error(error)
        stats["exit"] = code
        if scales is not None:
            stats["loss_scale"] = _scale_trajectory(scales)
        answer(args, stats)
    if isinstance(code, str):
        print(code, file=sys.stderr)
    return 1 if isinstance(code, str) else int(code or 0)


def _record_loss_scale(train_args: list[str]) -> list[float]:
    """After each update of an enabled GradScaler (the framework's class, patched in this
    process before the run imports it), its scale. Reading it waits for the device once per
    step: only the AMP checks, which are not timed, ask for it."""
    paddle = "framework=paddle" in train_args
    scaler_class = importlib.import_module("paddle" if paddle else "torch").amp.GradScaler
    update, scales = scaler_class.update, []

    def recording_update(self, *args, **kwargs):
        result = update(self, *args, **kwargs)
        with contextlib.suppress(Exception):  # telemetry never ends the run
            if self.is_enable() if paddle else self.is_enabled():
                scales.append(float(self._scale if paddle else self.get_scale()))
        return result

    scaler_class.update = recording_update
    return scales


def _scale_trajectory(scales: list[float]) -> dict | None:
    """[update number, scale] at the first update and each change; None: no enabled scaler."""
    if not scales:
        return None
    changes = [[1, scales[0]]]
    changes += [[n, b] for n, (a, b) in enumerate(zip(scales, scales[1:]), start=2) if a != b]
    trajectory = {"source": "GradScaler.update", "updates": len(scales)}
    return {**trajectory, "changes": changes, "final": scales[-1]}


def helper_synthetic(args: argparse.Namespace) -> int:
    """The torch backend's own build() and train_step() on random device tensors, no loader."""
    import torch

    from train.backends import make_backend
    from train.config.load import load_config

    config = load_config(args.config, args.overrides)
    backend = make_backend(config)
    runtime, trainer = backend.runtime, backend.trainer
    runtime.init_distributed()
    gpu = runtime.uses_gpu
    if not gpu:
        torch.set_num_threads(1)  # the dry-run's CPU figure measures nothing; spare the host
    runtime.seed_everything(config.seed, config.deterministic)
    size, batch_size = config.data.image_size, config.loader.batch_size
    total = args.warmup + args.steps
    backend.build(config.model, config.optim, (3, size, size), args.classes, total)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else "cpu"
    images = torch.randn(batch_size, 3, size, size, device=device)
    images = images.contiguous(memory_format=torch.channels_last) if gpu else images
    batch = {"image": images, "label": torch.randint(0, args.classes, (batch_size,), device=device)}
    for steps in (args.warmup, args.steps):  # the warm-up, then the timed steps
        started = time.perf_counter()
        for _ in range(steps):
            loss = trainer.train_step(batch)
        final = trainer.to_float(loss)
        runtime.synchronize()
    stats = {"images_per_s": args.steps * batch_size / (time.perf_counter() - started)}
    stats.update(batch=batch_size, image_size=size, steps=args.steps, model=config.model.name)
    stats.update(amp=config.train.amp if gpu else "none (CPU)", device=runtime.device_name)
    stats.update(loss=final, peak_mem_mb=torch.cuda.max_memory_allocated() / 2**20 if gpu else None)
    runtime.shutdown()
    return answer(args, stats)


def helper_ranks(args: argparse.Namespace) -> int:
    """A rank under torchrun: DDP over gloo on the one GPU (or the CPU), each rank on its own
    batch; rank 0 answers whether the ranks ended with equal parameters."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = args.device == "gpu"
    if gpu:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them too)
    net = _small_net(torch.nn, "2d", 16).to(device)
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0] if gpu else None)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    images = torch.randn(16, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 4, (16,), generator=generator).to(device)
    started = time.perf_counter()
    losses = _fit_torch(torch, model, images, labels, args.steps)
    step_s = (time.perf_counter() - started) / args.steps
    flat = torch.cat([p.detach().flatten() for p in net.parameters()]).cpu()
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        stats = {"world_size": world, "backend": dist.get_backend(), "steps": args.steps}
        stats["device"] = f"cuda:0 ({torch.cuda.get_device_name(0)})" if gpu else "cpu"
        stats.update(loss_first=losses[0], loss_last=losses[-1], loss_fell=losses[-1] < losses[0])
        stats["param_max_diff"] = max(float((g - gathered[0]).abs().max()) for g in gathered)
        answer(args, {**stats, "step_s": step_s})
    dist.destroy_process_group()
    return 0


# Each helper's options beside --stats, all required (INTEGERS: those that are numbers).
OPTIONS = {
    "_probe": ["--framework", "--device"],
    "_configs": ["--work"],
    "_data": ["--out", "--ocr-lines", "--images-train", "--images-val", "--classes"],
    "_train": [],
    "_ranks": ["--steps", "--device"],
    "_synthetic": ["--config", "--classes", "--warmup", "--steps"],
}
INTEGERS = {"--ocr-lines", "--images-train", "--images-val", "--classes", "--warmup", "--steps"}


def helper_main(argv: list[str]) -> int:
    """Run the helper command ``argv[0]`` (a name starting with "_"); its exit code."""
    parser = argparse.ArgumentParser(prog="scripts/gpu_check (helper)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, options in OPTIONS.items():
        command = sub.add_parser(name)
        for option in ("--stats", *options):
            command.add_argument(option, required=True, type=int if option in INTEGERS else str)
    sub.choices["_train"].add_argument("train_args", nargs=argparse.REMAINDER)
    sub.choices["_synthetic"].add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    if args.command == "_train" and args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    return globals()[f"helper{args.command}"](args)
