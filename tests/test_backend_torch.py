"""TorchBackend on the CPU: learning, on-device normalization, exact resume, safe checkpoint
loading, loader knobs and a two-process gloo group.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" \
        tests/test_backend_torch.py

The CUDA paths (side-stream prefetch, AMP, NCCL) need a GPU and are not run here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from datasets.dataset import build_image_dataset, build_ocr_dataset  # noqa: E402
from datasets.ocr_transforms import CharDict  # noqa: E402
from datasets.sampler import EpochSampler  # noqa: E402
from train.backends.base import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from train.backends.torch.backend import (  # noqa: E402
    TorchBackend,
    UnsafeCheckpointError,
    lr_factor,
)
from train.config import Config, config_from_dict  # noqa: E402
from train.cpus import usable_cores  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers
def make_config(task: str, data_path: Path, **sections: dict) -> Config:
    """A small CPU config over fixture data; each keyword updates that config section."""
    raw: dict = {
        "task": task,
        "framework": "torch",
        "seed": 0,
        "data": {"train": str(data_path), "augment": False},
        "loader": {"batch_size": 8, "num_workers": 0},
        "optim": {"name": "adamw", "lr": 1.0e-3, "schedule": "constant"},
        "train": {"device": "cpu"},
    }
    if task == "ocr":
        raw["data"]["char_dict"] = str(data_path.parent / "charset.txt")
        raw["model"] = {"name": "crnn_tiny", "hidden_size": 64}
    else:
        raw["data"].update(image_size=64, eval_resize=64)
        raw["model"] = {"name": "resnet18"}
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return config_from_dict(raw)


def make_dataset(config: Config, train: bool = True):
    """(dataset, num_classes) as the training loop builds them."""
    data = config.data
    if config.task == "ocr":
        chars = CharDict.from_file(data.char_dict)
        dataset = build_ocr_dataset(
            data.train,
            chars,
            train=train,
            seed=config.seed,
            image_shape=tuple(data.image_shape),
            max_text_length=data.max_text_length,
            augment=data.augment,
        )
        return dataset, chars.num_classes
    dataset = build_image_dataset(
        data.train,
        train=train,
        seed=config.seed,
        image_size=data.image_size,
        eval_resize=data.eval_resize,
    )
    return dataset, len(dataset.source.class_names)


def start_backend(config: Config) -> TorchBackend:
    backend = TorchBackend(config)
    backend.init_distributed()
    backend.seed_everything(config.seed, config.deterministic)
    return backend


def device_batches(backend: TorchBackend, config: Config, count: int) -> tuple[list, int]:
    """The first `count` normalized batches of epoch 0 (loaded in the main process)."""
    dataset, num_classes = make_dataset(config)
    loader = backend.make_loader(dataset, EpochSampler(len(dataset)), config.loader, 0, True)
    return list(itertools.islice(backend.device_batches(loader), count)), num_classes


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """make_loader sets the main process's thread count on the CPU; keep tests independent."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["ocr", "resnet50"])
def task_data(request, ocr_lmdb, image_h5) -> tuple[str, Path]:
    return request.param, ocr_lmdb if request.param == "ocr" else image_h5


# ---------------------------------------------------------------- 1. learning
@pytest.mark.parametrize(
    "task, lr, steps", [("ocr", 3.0e-3, 30), ("resnet50", 1.0e-3, 30)], ids=["ocr", "resnet18"]
)
def test_overfits_one_batch(task, lr, steps, ocr_lmdb, image_h5):
    config = make_config(task, ocr_lmdb if task == "ocr" else image_h5, optim={"lr": lr})
    backend = start_backend(config)
    (batch,), num_classes = device_batches(backend, config, 1)
    backend.build(num_classes, total_steps=steps)
    losses = [backend.to_float(backend.train_step(batch)) for _ in range(steps)]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses

    predicted = backend.predict(batch)
    assert predicted.dtype == np.int64
    if task == "ocr":
        assert predicted.shape == (8, 80)  # W 320 / 4 time steps
        assert predicted.min() >= 0 and predicted.max() < num_classes
    else:  # 4 classes: the top-5 is padded with -1, which matches no label
        assert predicted.shape == (8, 5)
        assert (predicted[:, 4] == -1).all() and (predicted[:, :4] >= 0).all()
    assert backend.num_parameters() > 0
    assert backend.current_lr() == pytest.approx(lr)


# ---------------------------------------------------------------- 2. device batches
def test_device_batches_normalize_and_keep_labels(task_data):
    task, path = task_data
    config = make_config(task, path)
    backend = start_backend(config)
    dataset, _ = make_dataset(config)
    sampler = EpochSampler(len(dataset))
    loader = backend.make_loader(dataset, sampler, config.loader, 0, True)
    host = next(iter(loader))
    batch = next(iter(backend.device_batches(loader)))  # same sampler epoch: same batch

    pixels = host["image"].numpy()
    assert pixels.dtype == np.uint8  # uint8 all the way to the device
    if task == "ocr":
        expected = (pixels.astype(np.float32) / 255 - 0.5) / 0.5
    else:
        mean, std = np.array(IMAGENET_MEAN), np.array(IMAGENET_STD)
        expected = (pixels / 255 - mean) / std
    expected = expected.transpose(0, 3, 1, 2)  # both tasks: NHWC on the host, NCHW on the device
    image = batch["image"]
    assert image.dtype == torch.float32 and image.device.type == "cpu"
    assert tuple(image.shape) == expected.shape and image.is_contiguous()
    np.testing.assert_allclose(image.numpy(), expected, rtol=0, atol=1e-5)

    assert set(batch) == set(host)
    for key in set(host) - {"image"}:
        assert batch[key].dtype == host[key].dtype and torch.equal(batch[key], host[key])
    labels = backend.batch_labels(batch)
    assert set(labels) == set(host) - {"image"}
    assert all(isinstance(value, np.ndarray) for value in labels.values())


# ---------------------------------------------------------------- 3. exact resume
RESUME_OPTIM = {  # exercise momentum/Adam state, warmup, both decaying schedules and clipping
    "ocr": {
        "name": "adamw",
        "lr": 2.0e-3,
        "warmup_steps": 2,
        "schedule": "cosine",
        "grad_clip": 5.0,
    },
    "resnet50": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "step"},
}


def test_resume_is_bit_identical(task_data, tmp_path):
    task, path = task_data
    config = make_config(task, path, deterministic=True, optim=RESUME_OPTIM[task])
    first = start_backend(config)
    batches, num_classes = device_batches(first, config, 5)
    batches = [batches[i % len(batches)] for i in range(5)]  # the HDF5 fixture has 3 batches
    before, after = batches[:2], batches[2:]
    first.build(num_classes, total_steps=6)
    for batch in before:
        first.train_step(batch)
    first.save_state(tmp_path)
    rng_at_checkpoint = torch.get_rng_state()
    at_checkpoint = {k: v.clone() for k, v in first.net.state_dict().items()}
    for batch in after:
        first.train_step(batch)
    uninterrupted = first.net.state_dict()

    resumed = start_backend(config)
    resumed.build(num_classes, total_steps=6)
    resumed.load_state(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng_at_checkpoint)
    for batch in after:
        resumed.train_step(batch)

    weights = resumed.net.state_dict()
    assert weights.keys() == uninterrupted.keys()
    different = [k for k in weights if not torch.equal(weights[k], uninterrupted[k])]
    assert different == []
    assert resumed.current_lr() == first.current_lr()
    assert resumed.scheduler.last_epoch == first.scheduler.last_epoch == 5
    assert not all(torch.equal(at_checkpoint[k], uninterrupted[k]) for k in at_checkpoint)


# ---------------------------------------------------------------- 4. safe loading
def _record_call(marker: str) -> str:
    """What unpickling the payload below would run: the proof that loading executed code."""
    Path(marker).write_text("unpickling ran code")
    return marker


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return _record_call, (self.marker,)


def _small_ocr_backend(ocr_lmdb: Path) -> TorchBackend:
    config = make_config("ocr", ocr_lmdb, data={"image_shape": [3, 16, 32]})
    backend = start_backend(config)
    backend.build(num_classes=5, total_steps=10)
    return backend


@pytest.mark.parametrize("part", ["model", "optimizer", "rng"])
def test_load_state_refuses_pickled_objects(part, ocr_lmdb, tmp_path):
    backend = _small_ocr_backend(ocr_lmdb)
    backend.save_state(tmp_path)
    marker = tmp_path / "executed.txt"
    torch.save({"state": _Payload(marker)}, tmp_path / f"{part}.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"refused to load .*{part}\.pt.*weights_only"):
        backend.load_state(tmp_path)
    assert not marker.exists()


def test_load_state_names_a_missing_file(ocr_lmdb, tmp_path):
    backend = _small_ocr_backend(ocr_lmdb)
    backend.save_state(tmp_path)
    (tmp_path / "scheduler.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no scheduler\.pt"):
        backend.load_state(tmp_path)


# ---------------------------------------------------------------- 5. loader knobs
def _epoch(backend, dataset, config, workers: int, epochs: int) -> list[dict]:
    sampler = EpochSampler(len(dataset), seed=config.seed)
    loader = backend.make_loader(dataset, sampler, config.loader, workers, True)
    batches = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches.extend(loader)
    return batches


@pytest.mark.parametrize(
    "context, workers, persistent", [("fork", 2, True), ("spawn", 1, False)], ids=str
)
def test_batches_do_not_depend_on_workers(context, workers, persistent, ocr_lmdb):
    loader_knobs = {
        "batch_size": 16,
        "num_workers": workers,
        "prefetch_factor": 3,
        "persistent_workers": persistent,
        "multiprocessing_context": context,
        "timeout_s": 30.0,
    }
    config = make_config("ocr", ocr_lmdb, data={"augment": True}, loader=loader_knobs)
    backend = start_backend(config)
    dataset, _ = make_dataset(config)
    epochs = 2 if persistent else 1  # persistent workers must follow the sampler's new epoch
    reference = _epoch(backend, dataset, config, 0, epochs)
    with_workers = _epoch(backend, dataset, config, workers, epochs)
    assert len(with_workers) == len(reference) == epochs * 96 // 16
    for got, want in zip(with_workers, reference):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    if epochs == 2:  # a different shuffle and augmentation in epoch 1
        assert not torch.equal(reference[0]["image"], reference[6]["image"])


def test_loader_honours_every_knob(ocr_lmdb):
    knobs = {
        "batch_size": 16,
        "eval_batch_size": 40,
        "num_workers": 2,
        "prefetch_factor": 3,
        "persistent_workers": True,
        "pin_memory": True,
        "multiprocessing_context": "forkserver",
        "timeout_s": 30.0,
    }
    config = make_config("ocr", ocr_lmdb, loader=knobs)
    backend = start_backend(config)
    dataset, _ = make_dataset(config)
    train = backend.make_loader(dataset, EpochSampler(len(dataset)), config.loader, 2, True)
    # Main-process threads leave one core per worker (at least one thread).
    assert torch.get_num_threads() == max(1, usable_cores() - 2)
    assert (train.batch_size, train.drop_last) == (16, True)
    assert (train.num_workers, train.prefetch_factor, train.persistent_workers) == (2, 3, True)
    assert train.timeout == 30.0
    assert train.multiprocessing_context.get_start_method() == "forkserver"
    assert train.pin_memory is False  # no GPU: page-locking buys nothing

    sampler = EpochSampler(len(dataset), shuffle=False)
    evaluation = backend.make_loader(dataset, sampler, config.loader, 0, False)
    assert (evaluation.batch_size, evaluation.drop_last) == (40, False)
    assert evaluation.prefetch_factor is None and evaluation.timeout == 0  # no workers
    sizes = [len(batch["image"]) for batch in evaluation]
    assert sizes == [40, 40, 16]  # every evaluation sample counts


# ---------------------------------------------------------------- small pieces
def test_lr_schedules():
    warm_cosine = lr_factor("cosine", warmup_steps=4, total_steps=20)
    assert [warm_cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warm_cosine(4) == 1.0 and warm_cosine(12) == pytest.approx(0.5)
    assert warm_cosine(20) == pytest.approx(0.0) and warm_cosine(25) == pytest.approx(0.0)
    step = lr_factor("step", warmup_steps=0, total_steps=30)
    assert [step(s) for s in (0, 9, 10, 19, 20, 29)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert lr_factor("constant", 2, 10)(0) == 0.5 and lr_factor("constant", 2, 10)(7) == 1.0


def test_amp_is_off_on_cpu_and_said_once(ocr_lmdb, caplog):
    config = make_config("ocr", ocr_lmdb, train={"amp": "bf16"}, data={"image_shape": [3, 16, 32]})
    backend = start_backend(config)
    with caplog.at_level(logging.WARNING):
        backend.build(num_classes=5, total_steps=10)
    assert [r.message for r in caplog.records if "amp" in r.message] == [
        "train.amp is bf16 but the device is the CPU: training in float32"
    ]
    assert backend.amp_dtype is None and not backend.scaler.is_enabled()


def test_profile_ranges_on_cpu(ocr_lmdb):
    assert (
        "nullcontext"
        in type(start_backend(make_config("ocr", ocr_lmdb)).profile_range("x")).__name__
    )
    backend = start_backend(make_config("ocr", ocr_lmdb, train={"profile": True}))
    with torch.profiler.profile() as profiler, backend.profile_range("data_wait"):
        torch.ones(4).sum()
    assert "data_wait" in {event.name for event in profiler.events()}


# ---------------------------------------------------------------- 6. two processes, gloo
DIST_WORKER = r"""
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from train.backends.torch.backend import TorchBackend
from train.config import config_from_dict

backend = TorchBackend(config_from_dict(json.loads(sys.argv[1])))
info = backend.init_distributed()
backend.seed_everything(0, True)
total = backend.all_reduce_sum(np.array([info.rank + 1.0, 0.5]))
backend.barrier()
backend.build(num_classes=5, total_steps=4)
rng = np.random.default_rng(info.rank)  # different data per rank; DDP keeps replicas equal
host = {
    "image": torch.from_numpy(rng.integers(0, 256, (2, 16, 32, 3), dtype=np.uint8)),
    "label": torch.tensor([[1, 2, 3], [4, 3, 0]], dtype=torch.int32),
    "length": torch.tensor([3, 2], dtype=torch.int32),
}
for batch in backend.device_batches([host, host]):
    backend.train_step(batch)
checksum = sum(float(p.double().sum()) for p in backend.net.parameters())
report = {"rank": info.rank, "world": info.world_size, "sum": total.tolist(),
          "backend": dist.get_backend(), "ddp": type(backend.model).__name__, "checksum": checksum}
backend.barrier()
backend.shutdown()
print("RESULT " + json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_process_gloo_all_reduce_barrier_and_ddp(ocr_lmdb):
    raw = {
        "task": "ocr",
        "framework": "torch",
        "data": {"train": str(ocr_lmdb), "char_dict": "unused.txt", "image_shape": [3, 16, 32]},
        "model": {"name": "crnn_tiny", "hidden_size": 16},
        "train": {"device": "cpu"},
    }
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on host networking
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", DIST_WORKER, json.dumps(raw)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=60)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output
    reports = [
        json.loads(line.removeprefix("RESULT "))
        for output in outputs
        for line in output.splitlines()
        if line.startswith("RESULT ")
    ]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["world"] == 2 and report["backend"] == "gloo"
        assert report["sum"] == [3.0, 1.0]
        assert report["ddp"] == "DistributedDataParallel"
    assert reports[0]["checksum"] == reports[1]["checksum"]  # gradients were averaged
