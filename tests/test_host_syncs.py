"""Host reads of device values during training: a read (``.item()``, ``.numpy()``, ``bool()``
of a tensor...) makes the host wait until the device has run everything queued before it, and
the device then idles until the host queues the next step's kernels. train_step reads nothing:
the NaN/Inf check, the skipped update and the BatchNorm restore all stay on the device, and
the loop reads the steps' losses and flags once per logging window (backend.trainer.read_steps).

The counter wraps the tensor methods that copy a value to the host, in both frameworks; the CPU
has no real synchronization to observe, but every such call is one on a GPU.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" tests/test_host_syncs.py
    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" tests/test_host_syncs.py
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

from tests.backends import build, first_batches, make_config, start

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]
# Every way a tensor's values reach the host as Python or numpy values.
READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


# Small inputs (OCR lines 160 wide, ResNet-18 on 32 pixels): host reads and the NaN steps'
# effects do not depend on the image size, the steps' cost does.
SMALL_IMAGES = {
    "ocr": {"image_shape": [3, 32, 160]},
    "classification": {"image_size": 32, "eval_resize": 32},
}


@pytest.fixture(params=FRAMEWORKS)
def framework(request) -> str:
    return request.param


class HostReads:
    """Counts calls of READS on the framework's tensors while ``active``; a read made inside
    another (Paddle's tolist calls numpy) counts once."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self._depth = 0

    def wrap(self, method):
        def counted(tensor, *args, **kwargs):
            outer = self._depth == 0
            if outer and self.active:
                self.count += 1
            self._depth += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    @contextlib.contextmanager
    def counting(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False


@pytest.fixture
def host_reads(framework, monkeypatch) -> HostReads:
    if framework == "torch":
        import torch

        tensor_type = torch.Tensor
    else:
        import paddle

        tensor_type = paddle.Tensor
    reads = HostReads()
    for name in READS:
        if hasattr(tensor_type, name):
            monkeypatch.setattr(tensor_type, name, reads.wrap(getattr(tensor_type, name)))
    return reads


def nan_batch(batch: dict) -> dict:
    return {**batch, "image": batch["image"] * math.nan}  # as train/faults.py's nan@N


def state_values(backend, framework: str) -> dict[str, np.ndarray]:
    """Every tensor a step may change: weights, BatchNorm statistics, optimizer state."""
    if framework == "torch":
        values = {
            f"model.{k}": v.detach().cpu().numpy()
            for k, v in backend.trainer.net.state_dict().items()
        }
        for index, state in enumerate(backend.trainer.optimizer.state.values()):
            for key, value in state.items():
                values[f"optim.{index}.{key}"] = value.detach().cpu().numpy()
        return values
    values = {f"model.{k}": v.numpy() for k, v in backend.trainer.net.state_dict().items()}
    for key, value in backend.trainer.optimizer.state_dict().items():
        if key not in ("LR_Scheduler", "master_weights"):
            values[f"optim.{key}"] = value.numpy()
    return values


@pytest.mark.parametrize(
    "task, optim",
    [
        ("classification", {"name": "adamw", "lr": 1.0e-3, "grad_clip": 1.0}),
        ("classification", {"name": "sgd", "lr": 1.0e-2, "momentum": 0.9}),
        ("ocr", {"name": "adam", "lr": 1.0e-3}),
    ],
    ids=["resnet-adamw-clip", "resnet-sgd-momentum", "ocr-adam"],
)
def test_train_steps_read_nothing_and_skip_nan_steps_on_the_device(
    framework, task, optim, host_reads, ocr_lmdb, image_h5
):
    """Eight steps under train.nonfinite: skip, the first and the fifth over NaN images (the
    first before any optimizer state exists: fused SGD, skipped there, would leave
    uninitialized momentum): zero host reads in the steps and one in read_steps, which flags
    exactly those two; and the weights, BatchNorm statistics and optimizer state end bit for
    bit as those of a twin that trained on the six good batches alone (constant LR): the NaN
    steps changed nothing (a host read of each step's finite flag would make 8)."""
    data = ocr_lmdb if task == "ocr" else image_h5
    train = {"device": "cpu", "nonfinite": "skip"}
    config = make_config(framework, task, data, optim=optim, data=SMALL_IMAGES[task], train=train)
    bad = {0, 4}
    good_only = start(config)
    batches, num_classes = first_batches(good_only, config, 8)
    build(good_only, config, num_classes, total_steps=8)
    for index, batch in enumerate(batches):
        if index not in bad:
            good_only.trainer.train_step(batch)

    backend = start(config)
    batches, num_classes = first_batches(backend, config, 8)
    build(backend, config, num_classes, total_steps=8)
    with host_reads.counting():
        for index, batch in enumerate(batches):
            backend.trainer.train_step(nan_batch(batch) if index in bad else batch)
    assert host_reads.count == 0, f"{host_reads.count} host reads in 8 train steps"
    with host_reads.counting():
        rows = backend.trainer.read_steps()
    assert host_reads.count == 1
    assert rows.shape == (8, 2)
    assert [int(flag) for flag in rows[:, 1]] == [int(i in bad) for i in range(8)]
    assert np.isfinite(rows[[i for i in range(8) if i not in bad], 0]).all()
    assert backend.trainer.read_steps().shape == (0, 2)  # each step is read once

    expected, got = state_values(good_only, framework), state_values(backend, framework)
    assert got.keys() == expected.keys()
    differ = [key for key in expected if not np.array_equal(expected[key], got[key])]
    assert not differ, f"the NaN steps changed {len(differ)} tensors: {differ[:5]}"


def test_the_loop_reads_the_device_once_per_logging_window(
    framework, host_reads, ocr_lmdb, tmp_path, monkeypatch
):
    """Twelve steps (one epoch of the OCR fixture) with train.log_every 4: three host reads
    in Run.train_epoch (each window's losses and flags), where the loop read each step's
    finite flag before (12) plus each window's loss (3). The policy and the logged losses
    still see every step (the window's rows)."""
    from train import loop
    from train.data import RunData
    from train.stops import StopFlag

    overrides = {"max_steps": 12, "log_every": 4, "eval_every": 100, "checkpoint_every": 100}
    config = make_config(
        framework, "ocr", ocr_lmdb, train={"device": "cpu", **overrides}, data=SMALL_IMAGES["ocr"]
    )
    backend = start(config)
    monkeypatch.setattr(loop, "install_stop_handler", StopFlag)  # the test's own signals
    read_steps = type(backend.trainer).read_steps
    windows = []

    def counted_read_steps(self):
        rows = read_steps(self)
        windows.append(len(rows))
        return rows

    monkeypatch.setattr(type(backend.trainer), "read_steps", counted_read_steps)
    train_epoch = loop.Run.train_epoch

    def counted_train_epoch(run):
        with host_reads.counting():
            return train_epoch(run)

    monkeypatch.setattr(loop.Run, "train_epoch", counted_train_epoch)
    device_batches = type(backend.batches).device_batches

    def batches_not_counted(self, loader):
        # The loader's own host tensors (torch's DataLoader draws each epoch's base seed with
        # a CPU .item()) are no device reads: not counted while a batch is being fetched.
        iterator = None
        while True:
            active, host_reads.active = host_reads.active, False
            try:
                iterator = iterator or iter(device_batches(self, loader))
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                host_reads.active = active
            yield batch

    monkeypatch.setattr(type(backend.batches), "device_batches", batches_not_counted)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = RunData.open(config, run_dir)
    try:
        summary = loop.train(config, backend, backend.runtime.dist, data, run_dir, False)
    finally:
        data.close()
    assert summary["steps"] == 12 and np.isfinite(summary["final_loss"])
    assert windows == [4, 4, 4]
    assert host_reads.count == 3, f"{host_reads.count} host reads in 12 training steps"
