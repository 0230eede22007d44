"""The backend contract (train/backends/base.py), run against both backends on the CPU: what the
training loop relies on, written once. Each backend's own module (test_backend_torch.py,
test_backend_paddle.py) tests only what is particular to it.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" \
        tests/test_backend_contract.py
    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" \
        tests/test_backend_contract.py
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest

from datasets.sampler import EpochSampler
from tests.backends import (
    TINY_OCR_DATA,
    Payload,
    build,
    first_batches,
    host_batches,
    make_config,
    open_dataset,
    start,
)
from train import tasks
from train.backends import make_backend
from train.checkpoint import UnsafeCheckpointError

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]
TASKS = ["ocr", "classification"]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(params=FRAMEWORKS)
def framework(request) -> str:
    return request.param


@pytest.fixture
def data_of(ocr_lmdb, image_h5):
    return {"ocr": ocr_lmdb, "classification": image_h5}


# ---------------------------------------------------------------- learning and predictions
# Small inputs, a fraction of the full-size steps' cost: OCR lines 160 wide (40 CTC time steps
# still hold the fixture's lines of at most 10 characters), ResNet-18 on 32 pixels (it still
# ends on a 1x1 map). Nothing these tests check depends on the size.
SMALL_IMAGES = {
    "ocr": {"image_shape": [3, 32, 160]},
    "classification": {"image_size": 32, "eval_resize": 32},
}
# On these inputs both models halve their loss on one batch within 5 steps (OCR, the slower)
# and stay near a fifth of it (OCR) or below a tenth (ResNet) from step 6 on, in both
# frameworks: 12 steps leave a wide margin.
OVERFIT_STEPS = 12


@pytest.mark.parametrize("task", TASKS)
def test_overfits_one_batch_and_predicts_in_the_contracts_layout(framework, task, data_of):
    optim = {"ocr": {"name": "adam", "lr": 3.0e-3}, "classification": {}}[task]
    config = make_config(framework, task, data_of[task], optim=optim, data=SMALL_IMAGES[task])
    backend = start(config)
    (batch,), num_classes = first_batches(backend, config, 1)
    build(backend, config, num_classes, total_steps=OVERFIT_STEPS)
    losses = [
        backend.trainer.to_float(backend.trainer.train_step(batch)) for _ in range(OVERFIT_STEPS)
    ]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses

    predicted = backend.trainer.predict(batch)
    assert predicted.dtype == np.int64
    if task == "ocr":
        assert predicted.shape == (8, 40)  # W 160 / 4 time steps
        assert predicted.min() >= 0 and predicted.max() < num_classes
    else:  # 4 classes: the top-5 is padded with -1, which matches no label
        assert predicted.shape == (8, 5)
        assert (predicted[:, 4] == -1).all() and (predicted[:, :4] >= 0).all()
        assert sorted(predicted[0, :4]) == [0, 1, 2, 3]
    assert backend.trainer.num_parameters() > 0
    assert backend.trainer.current_lr() == pytest.approx(config.optim.lr)


@pytest.mark.parametrize("task", TASKS)
def test_device_batches_normalize_on_the_device_and_keep_labels(framework, task, data_of):
    config = make_config(framework, task, data_of[task])
    backend = start(config)
    dataset, _ = open_dataset(config)
    loader = backend.batches.make_loader(dataset, EpochSampler(len(dataset)), config.loader, True)
    host = {key: backend.batches.to_numpy(value) for key, value in next(iter(loader)).items()}
    batch = next(iter(backend.batches.device_batches(loader)))  # same sampler epoch: the same batch

    pixels = host["image"]
    assert pixels.dtype == np.uint8  # uint8 all the way to the device
    spec = tasks.get(task)
    mean = np.array(spec.mean).reshape(1, 1, 1, -1)
    std = np.array(spec.std).reshape(1, 1, 1, -1)
    expected = ((pixels / 255 - mean) / std).transpose(0, 3, 1, 2)  # NHWC -> NCHW
    image = backend.batches.to_numpy(batch["image"])
    assert image.dtype == np.float32 and image.shape == expected.shape
    np.testing.assert_allclose(image, expected, rtol=0, atol=1e-5)

    assert set(batch) == set(host) == {"image", *spec.label_keys}
    labels = backend.batches.batch_labels(batch)
    assert set(labels) == set(spec.label_keys)
    for key, value in labels.items():
        assert isinstance(value, np.ndarray) and value.dtype == host[key].dtype
        np.testing.assert_array_equal(value, host[key])


# ---------------------------------------------------------------- checkpoints
RESUME_OPTIM = {  # momentum/Adam state, warmup, both decaying schedules and clipping
    "ocr": {
        "name": "adamw",
        "lr": 2.0e-3,
        "warmup_steps": 2,
        "schedule": "cosine",
        "grad_clip": 5.0,
    },
    "classification": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "step"},
}


@pytest.mark.parametrize("task", TASKS)
def test_a_resumed_run_continues_bit_identically(framework, task, data_of, tmp_path):
    """Four steps in one run against two, a checkpoint and two more in a fresh backend: the
    resumed steps run past the warmup, on the decaying part of the schedule."""
    config = make_config(
        framework,
        task,
        data_of[task],
        deterministic=True,
        optim=RESUME_OPTIM[task],
        data=SMALL_IMAGES[task],
    )
    batches, num_classes = first_batches(start(config), config, 4)

    whole = start(config)
    build(whole, config, num_classes, total_steps=6)
    losses = [whole.trainer.to_float(whole.trainer.train_step(batch)) for batch in batches]

    first = start(config)
    build(first, config, num_classes, total_steps=6)
    assert [
        first.trainer.to_float(first.trainer.train_step(batch)) for batch in batches[:2]
    ] == losses[:2]
    first.state.save_state(tmp_path)

    resumed = start(config, seed=12345)  # another seed: everything must come from the files
    build(resumed, config, num_classes, total_steps=6)
    resumed.state.load_state(tmp_path)
    assert resumed.trainer.current_lr() == first.trainer.current_lr()
    assert [
        resumed.trainer.to_float(resumed.trainer.train_step(batch)) for batch in batches[2:]
    ] == losses[2:]
    assert resumed.trainer.current_lr() == whole.trainer.current_lr()
    for batch in batches[:2]:
        np.testing.assert_array_equal(resumed.trainer.predict(batch), whole.trainer.predict(batch))


def test_grad_clip_bounds_the_norm_of_all_gradients_together(framework, ocr_lmdb):
    """optim.grad_clip limits the global norm over every parameter, decayed or not (two
    optimizer groups): plain SGD at lr 1 moves the weights by exactly the clipped gradients."""
    clip = 1e-3  # far below this model's gradient norm: the step is clipped
    optim = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "grad_clip": clip}
    config = make_config(framework, "ocr", ocr_lmdb, optim=optim)
    backend = start(config)
    (batch,), num_classes = first_batches(backend, config, 1)
    build(backend, config, num_classes, total_steps=2)

    def weights() -> list[np.ndarray]:
        params = backend.trainer.net.parameters()
        return [
            backend.batches.to_numpy(p.detach()).astype(np.float64)
            for p in params
            if getattr(p, "trainable", getattr(p, "requires_grad", False))
        ]

    before = weights()
    backend.trainer.train_step(batch)
    moved = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, weights())))
    assert moved == pytest.approx(clip, rel=1e-3)


@pytest.fixture
def checkpoint(framework, ocr_lmdb, tmp_path):
    """A small OCR backend and the checkpoint it saved in tmp_path / "ckpt"."""
    config = make_config(framework, "ocr", ocr_lmdb, data=TINY_OCR_DATA)
    backend = start(config)
    build(backend, config, num_classes=5, total_steps=10)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    backend.state.save_state(directory)
    return backend, directory


def test_load_state_runs_no_pickled_code(checkpoint, tmp_path):
    """Every tensor file of a checkpoint, replaced by a pickle that would run code, is refused
    with UnsafeCheckpointError and runs nothing."""
    backend, directory = checkpoint
    files = sorted(p.name for p in directory.iterdir() if p.suffix in (".pt", ".npz"))
    assert files
    for name in files:
        original = (directory / name).read_bytes()
        marker = tmp_path / f"ran-{name}"
        (directory / name).write_bytes(pickle.dumps({"state": Payload(marker)}, protocol=2))
        with pytest.raises(UnsafeCheckpointError, match="refused to load .*" + name):
            backend.state.load_state(directory)
        assert not marker.exists(), name
        (directory / name).write_bytes(original)
    backend.state.load_state(directory)  # restored: loads again


def test_load_state_names_a_missing_file(checkpoint):
    backend, directory = checkpoint
    for path in sorted(directory.iterdir()):
        original = path.read_bytes()
        path.unlink()
        with pytest.raises(FileNotFoundError, match=path.name.replace(".", r"\.")):
            backend.state.load_state(directory)
        path.write_bytes(original)


# ---------------------------------------------------------------- loaders
def test_evaluation_loader_uses_eval_batch_size_and_keeps_the_last_batch(framework, ocr_lmdb):
    knobs = {"batch_size": 40, "eval_batch_size": 20}
    config = make_config(framework, "ocr", ocr_lmdb, loader=knobs)
    backend = start(config)
    dataset, _ = open_dataset(config)
    sampler = EpochSampler(len(dataset), shuffle=False)
    train = backend.batches.make_loader(dataset, sampler, config.loader, train=True)
    evaluation = backend.batches.make_loader(dataset, sampler, config.loader, train=False)
    assert [len(batch["image"]) for batch in train] == [40, 40]  # 96 // 40: drop_last
    assert [len(batch["image"]) for batch in evaluation] == [20, 20, 20, 20, 16]  # every sample


def test_persistent_workers_give_the_batches_of_the_main_process(framework, ocr_lmdb):
    knobs = {"batch_size": 16, "num_workers": 2, "persistent_workers": True, "timeout_s": 60}
    config = make_config(framework, "ocr", ocr_lmdb, data={"augment": True}, loader=knobs)
    backend = start(config)
    dataset, _ = open_dataset(config)  # augmentation is seeded per sample
    expected = host_batches(backend, dataset, config, workers=0, epochs=2)
    got = host_batches(backend, dataset, config, workers=2, epochs=2)
    assert len(got) == len(expected) == 2 * (96 // 16)
    for index, (ours, theirs) in enumerate(zip(got, expected)):
        assert ours.keys() == theirs.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"batch {index} {key}")
    # persistent workers followed the sampler into epoch 1: another shuffle and augmentation
    assert not np.array_equal(expected[0]["image"], expected[6]["image"])


# ---------------------------------------------------------------- settings
def test_amp_is_off_on_the_cpu_and_said_once(framework, ocr_lmdb, caplog):
    config = make_config(framework, "ocr", ocr_lmdb, train={"amp": "bf16"}, data=TINY_OCR_DATA)
    backend = start(config)
    with caplog.at_level(logging.WARNING):
        build(backend, config, num_classes=5, total_steps=10)
    assert [r.message for r in caplog.records if "amp" in r.message] == [
        "train.amp is bf16 but the device is the CPU: training in float32"
    ]
    assert backend.trainer.amp_dtype is None


def test_gpu_device_without_a_gpu_says_how_to_fix(framework, ocr_lmdb):
    backend = make_backend(make_config(framework, "ocr", ocr_lmdb, train={"device": "gpu"}))
    if backend.name == "torch":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has a GPU")
    else:
        import paddle

        if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            pytest.skip("this host has a GPU")
    with pytest.raises(RuntimeError, match="train.device: cpu"):
        backend.runtime.init_distributed()


def test_each_loss_kind_has_a_loss_and_a_decoding_in_the_backend(framework):
    backend_models = {
        "torch": "train.backends.torch.models",
        "paddle": "train.backends.paddle.models",
    }[framework]
    models = __import__(backend_models, fromlist=["HEADS", "FAMILIES"])
    assert set(models.HEADS) == set(tasks.LOSSES)
    families = {model.family for task in tasks.TASKS.values() for model in task.models}
    assert families <= set(models.FAMILIES)
