"""PaddleBackend on the CPU: learning, device-side normalization, checkpoints, loaders, CTC
decoding against PaddleOCR's, and a 2-process gloo collective.

    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" \
        tests/test_backend_paddle.py tests/test_paddle_png.py
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from datasets.dataset import build_image_dataset, build_ocr_dataset
from datasets.ocr_transforms import CharDict
from datasets.sampler import EpochSampler
from train.backends.base import IMAGENET_MEAN, IMAGENET_STD
from train.config import config_from_dict
from train.metrics import ctc_greedy_decode

pytestmark = pytest.mark.paddle
paddle = pytest.importorskip("paddle")

from train.backends.paddle.backend import (  # noqa: E402  (needs paddle)
    PaddleBackend,
    UnsafeCheckpointError,
    lr_factor,
)

ROOT = Path(__file__).resolve().parent.parent


# --- helpers ----------------------------------------------------------------------------------
def ocr_config(lmdb: Path, **sections):
    data = {
        "task": "ocr",
        "framework": "paddle",
        "deterministic": True,
        "data": {"train": str(lmdb), "char_dict": str(lmdb.parent / "charset.txt")},
        "loader": {"batch_size": 8, "num_workers": 0},
        "model": {"name": "crnn_tiny", "hidden_size": 64},
        "optim": {"name": "adam", "lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"device": "cpu"},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def resnet_config(h5: Path, **sections):
    data = {
        "task": "resnet50",
        "framework": "paddle",
        "deterministic": True,
        "data": {"train": str(h5), "image_size": 64, "eval_resize": 64},
        "loader": {"batch_size": 8, "num_workers": 0},
        "model": {"name": "resnet18"},
        "optim": {"name": "adamw", "lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"device": "cpu"},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def started(config, seed: int | None = None) -> PaddleBackend:
    backend = PaddleBackend(config)
    backend.init_distributed()
    backend.seed_everything(config.seed if seed is None else seed, config.deterministic)
    return backend


def ocr_dataset(lmdb: Path, augment: bool = False):
    chars = CharDict.from_file(lmdb.parent / "charset.txt")
    return build_ocr_dataset(lmdb, chars, train=True, augment=augment), chars


def device_batches(backend, dataset, count: int, epoch: int = 0) -> list[dict]:
    sampler = EpochSampler(len(dataset), seed=0)
    sampler.set_epoch(epoch)
    loader = backend.make_loader(dataset, sampler, backend.config.loader, 0, train=True)
    batches = []
    for batch in backend.device_batches(loader):
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


def overfit(backend, batch: dict, steps: int) -> list[float]:
    return [backend.to_float(backend.train_step(batch)) for _ in range(steps)]


# --- 1. learning ------------------------------------------------------------------------------
def test_crnn_tiny_overfits_one_batch(ocr_lmdb):
    start = time.perf_counter()
    backend = started(ocr_config(ocr_lmdb))
    dataset, chars = ocr_dataset(ocr_lmdb)
    (batch,) = device_batches(backend, dataset, 1)
    backend.build(chars.num_classes, total_steps=30)
    losses = overfit(backend, batch, 30)
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses
    predicted = backend.predict(batch)
    assert predicted.dtype == np.int64 and predicted.shape == (8, 80)  # T = 320 / 4
    assert predicted.min() >= 0 and predicted.max() < chars.num_classes
    print(f"crnn_tiny: {losses[0]:.2f} -> {losses[-1]:.2f} in {time.perf_counter() - start:.1f}s")


def test_resnet18_overfits_one_batch(image_h5):
    start = time.perf_counter()
    backend = started(resnet_config(image_h5, loader={"batch_size": 4}))
    dataset = build_image_dataset(image_h5, train=True, image_size=64, eval_resize=64)
    (batch,) = device_batches(backend, dataset, 1)
    assert batch["image"].shape == [4, 3, 64, 64]
    backend.build(num_classes=4, total_steps=30)
    losses = overfit(backend, batch, 30)
    assert losses[-1] < 0.5 * losses[0], losses
    top5 = backend.predict(batch)
    assert top5.dtype == np.int64 and top5.shape == (4, 5)
    assert (top5[:, 4] == -1).all(), "4 classes: the fifth guess is padding"
    assert sorted(top5[0, :4]) == [0, 1, 2, 3]
    print(f"resnet18: {losses[0]:.2f} -> {losses[-1]:.2f} in {time.perf_counter() - start:.1f}s")


# --- 2. device-side normalization ---------------------------------------------------------------
def test_device_batches_normalize_ocr_images_and_keep_labels(ocr_lmdb):
    backend = started(ocr_config(ocr_lmdb))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 6, 10, 3), dtype=np.uint8)  # N, H, W, C
    labels = rng.integers(0, 60, (2, 25), dtype=np.int32)
    lengths = np.array([3, 7], dtype=np.int32)
    host = {"image": images, "label": labels, "length": lengths}
    (batch,) = backend.device_batches([{k: paddle.to_tensor(v) for k, v in host.items()}])
    expected = (images.transpose(0, 3, 1, 2).astype(np.float32) / 255 - 0.5) / 0.5
    assert batch["image"].dtype == paddle.float32 and batch["image"].shape == [2, 3, 6, 10]
    np.testing.assert_allclose(batch["image"].numpy(), expected, rtol=1e-6, atol=1e-6)
    for key in ("label", "length"):
        np.testing.assert_array_equal(batch[key].numpy(), host[key])
        assert batch[key].numpy().dtype == host[key].dtype
    assert backend.batch_labels(batch).keys() == {"label", "length"}


def test_device_batches_normalize_resnet_images_to_nchw(image_h5):
    backend = started(resnet_config(image_h5))
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)  # N, H, W, RGB
    labels = np.array([3, 1], dtype=np.int64)
    host = {"image": paddle.to_tensor(images), "label": paddle.to_tensor(labels)}
    (batch,) = backend.device_batches([host])
    mean = np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)
    std = np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    expected = (images.transpose(0, 3, 1, 2) / 255.0 - mean) / std
    assert batch["image"].shape == [2, 3, 5, 7]
    np.testing.assert_allclose(batch["image"].numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(batch["label"].numpy(), labels)
    assert batch["label"].numpy().dtype == np.int64


# --- 3. and 4. checkpoints ------------------------------------------------------------------------
def tensors(backend) -> dict[str, np.ndarray]:
    state = {f"model/{k}": v.numpy() for k, v in backend.net.state_dict().items()}
    state.update({f"optim/{k}": v for k, v in backend._optimizer_tensors().items()})
    return state


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resumed_run_is_bit_identical(ocr_lmdb, tmp_path, optimizer):
    config = ocr_config(
        ocr_lmdb,
        loader={"batch_size": 4},
        model={"hidden_size": 32},
        optim={
            "name": optimizer,
            "lr": 0.01,
            "warmup_steps": 2,
            "schedule": "cosine",
            "grad_clip": 1.0,
        },
    )
    dataset, chars = ocr_dataset(ocr_lmdb, augment=True)
    batches = device_batches(started(config), dataset, 6)

    whole = started(config)
    whole.build(chars.num_classes, total_steps=6)
    losses = overfit_each(whole, batches)

    first_half = started(config)
    first_half.build(chars.num_classes, total_steps=6)
    assert overfit_each(first_half, batches[:3]) == losses[:3]
    first_half.save_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.npz",
        "optimizer.npz",
        "state.json",
    ]

    resumed = started(config, seed=12345)  # a different seed: everything must come from disk
    resumed.build(chars.num_classes, total_steps=6)
    resumed.load_state(tmp_path)
    assert resumed.current_lr() == first_half.current_lr()
    assert overfit_each(resumed, batches[3:]) == losses[3:]
    assert resumed.step == whole.step == 6
    assert resumed.current_lr() == whole.current_lr()
    expected, got = tensors(whole), tensors(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def overfit_each(backend, batches: list[dict]) -> list[float]:
    return [backend.to_float(backend.train_step(batch)) for batch in batches]


@pytest.fixture
def checkpoint(ocr_lmdb, tmp_path) -> tuple[PaddleBackend, Path]:
    backend = started(ocr_config(ocr_lmdb, model={"hidden_size": 16}))
    _, chars = ocr_dataset(ocr_lmdb)
    backend.build(chars.num_classes, total_steps=10)
    backend.save_state(tmp_path)
    return backend, tmp_path


def test_load_state_refuses_a_pickled_object_in_the_npz(checkpoint):
    backend, directory = checkpoint
    arrays = dict(np.load(directory / "model.npz"))
    arrays["payload"] = np.array([{"run": "code"}], dtype=object)  # needs pickle to load
    np.savez(directory / "model.npz", **arrays)
    with pytest.raises(UnsafeCheckpointError, match="'payload'.*pickled Python object"):
        backend.load_state(directory)


def test_load_state_refuses_a_pickle_file(checkpoint):
    backend, directory = checkpoint
    (directory / "optimizer.npz").write_bytes(pickle.dumps({"state": 1}))
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=False"):
        backend.load_state(directory)


def test_load_state_names_what_does_not_fit(checkpoint, ocr_lmdb):
    _, directory = checkpoint
    other = started(ocr_config(ocr_lmdb, model={"hidden_size": 32}))
    other.build(63, total_steps=10)
    with pytest.raises(ValueError, match="does not fit this model.*rnn"):
        other.load_state(directory)


# --- 5. loaders -----------------------------------------------------------------------------------
def host_arrays(backend, dataset, num_workers: int, epochs: int) -> list[dict[str, np.ndarray]]:
    loader_config = backend.config.loader
    sampler = EpochSampler(len(dataset), seed=3)
    loader = backend.make_loader(dataset, sampler, loader_config, num_workers, train=True)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += [{k: v.numpy() for k, v in batch.items()} for batch in loader]
    return out


def test_two_persistent_workers_give_the_batches_of_the_main_process(ocr_lmdb):
    workers = {"batch_size": 16, "num_workers": 2, "persistent_workers": True, "timeout_s": 60}
    backend = started(ocr_config(ocr_lmdb, loader=workers))
    dataset, _ = ocr_dataset(ocr_lmdb, augment=True)  # augmentation seeded per sample
    expected = host_arrays(backend, dataset, num_workers=0, epochs=2)
    got = host_arrays(backend, dataset, num_workers=2, epochs=2)
    assert len(got) == len(expected) == 2 * (96 // 16)
    for index, (ours, theirs) in enumerate(zip(got, expected)):
        assert ours.keys() == theirs.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"batch {index} {key}")


def test_persistent_workers_start_each_epoch_without_paddles_half_second_poll(ocr_lmdb):
    """Paddle's persistent-worker reset waited in 0.5 s sleeps at every epoch start; with the
    poll shortened, iter() returns as soon as the workers have acknowledged (milliseconds)."""
    loader_config = {"batch_size": 16, "num_workers": 1, "persistent_workers": True}
    backend = started(ocr_config(ocr_lmdb, loader=loader_config))
    dataset, _ = ocr_dataset(ocr_lmdb)
    sampler = EpochSampler(len(dataset), seed=3)
    loader = backend.make_loader(dataset, sampler, backend.config.loader, 1, train=True)
    waits = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        started_at = time.perf_counter()
        batches = iter(loader)  # from epoch 1 on, this is where Paddle resets its workers
        waits.append(time.perf_counter() - started_at)
        assert sum(1 for _ in batches) == 96 // 16
    assert max(waits[1:]) < 0.4, waits  # each was >= 0.5 s before


def test_eval_loader_uses_eval_batch_size_and_keeps_the_last_batch(ocr_lmdb):
    backend = started(ocr_config(ocr_lmdb, loader={"batch_size": 40, "eval_batch_size": 20}))
    dataset, _ = ocr_dataset(ocr_lmdb)
    sampler = EpochSampler(len(dataset), shuffle=False)
    train = backend.make_loader(dataset, sampler, backend.config.loader, 0, train=True)
    evaluation = backend.make_loader(dataset, sampler, backend.config.loader, 0, train=False)
    assert len(train) == 96 // 40  # drop_last for training
    assert len(evaluation) == 5  # 4 x 20 + 16: every validation sample counts
    assert [len(b["image"]) for b in evaluation][-1] == 16


class SlowDataset:
    """Sample 5 takes far longer than the loader's timeout (a stuck storage read)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, item):
        _, index = item
        if index == 5:
            time.sleep(20)
        return {"image": np.zeros((3, 4, 4), np.uint8), "label": np.int64(index)}


def test_a_stuck_worker_raises_timeout_instead_of_hanging(ocr_lmdb):
    stuck = {"batch_size": 2, "num_workers": 1, "timeout_s": 2}
    backend = started(ocr_config(ocr_lmdb, loader=stuck))
    sampler = EpochSampler(8, shuffle=False)
    loader = backend.make_loader(SlowDataset(), sampler, backend.config.loader, 1, train=True)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="loader.timeout_s"):
        for _ in loader:
            pass
    assert time.perf_counter() - start < 15


# --- 6. CTC decoding vs PaddleOCR ---------------------------------------------------------------
@pytest.mark.parametrize("use_space_char", [False, True])
def test_greedy_ctc_decoding_matches_paddleocr(ocr_lmdb, use_space_char):
    import paddleocr  # noqa: F401  (puts ppocr on sys.path)
    from ppocr.postprocess.rec_postprocess import CTCLabelDecode

    charset = ocr_lmdb.parent / "charset.txt"
    chars = CharDict.from_file(charset, use_space_char=use_space_char)
    theirs = CTCLabelDecode(character_dict_path=str(charset), use_space_char=use_space_char)
    rng = np.random.default_rng(0)
    # Mostly blanks and runs of repeats, as a trained model emits, plus random noise.
    classes = rng.integers(0, chars.num_classes, (16, 80))
    classes[rng.random((16, 80)) < 0.5] = 0
    classes[:, 1::2] = np.where(rng.random((16, 40)) < 0.5, classes[:, ::2], classes[:, 1::2])
    logits = rng.normal(0, 1, (16, 80, chars.num_classes)).astype(np.float32)
    np.put_along_axis(logits, classes[..., None], 10.0, axis=2)
    ours = [chars.decode(row) for row in ctc_greedy_decode(logits.argmax(axis=2))]
    assert ours == [text for text, _ in theirs(logits)]
    assert any(ours) and len(set(ours)) > 1


# --- 7. distributed -----------------------------------------------------------------------------
COLLECTIVE = """
import json, sys
import numpy as np
import paddle
from train.backends.paddle.backend import PaddleBackend
from train.config import config_from_dict

config = config_from_dict({
    "task": "resnet50", "framework": "paddle", "deterministic": True,
    "data": {"train": "unused.h5"}, "model": {"name": "resnet18"},
    "optim": {"name": "sgd", "lr": 0.01}, "train": {"device": "cpu"},
})
backend = PaddleBackend(config)
info = backend.init_distributed()
total = backend.all_reduce_sum(np.array([info.rank + 1.0, 0.25]))
backend.barrier()
backend.seed_everything(0, True)
backend.build(4, total_steps=2)
rng = np.random.default_rng(info.rank)  # each rank its own data
images = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
host = {"image": paddle.to_tensor(images), "label": paddle.to_tensor(np.arange(4) % 4)}
(batch,) = backend.device_batches([host])
loss = backend.to_float(backend.train_step(batch))
# Trainable weights only: BatchNorm's running statistics follow each rank's own data.
checksum = float(sum(np.abs(p.numpy()).sum() for p in backend.net.parameters() if p.trainable))
print(json.dumps({"rank": info.rank, "world": info.world_size, "sum": total.tolist(),
                  "loss": loss, "checksum": checksum}), flush=True)
backend.shutdown()
"""


def test_two_process_cpu_collective_with_paddle_launch(tmp_path):
    """python -m paddle.distributed.launch, 2 CPU processes over gloo: all_reduce_sum, barrier,
    and a DataParallel step that leaves both ranks with the same weights."""
    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    script = tmp_path / "collective.py"
    script.write_text(COLLECTIVE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    env["PYTHONPATH"] = str(ROOT)
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, "--log_dir", str(logs), str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    worker_logs = {p.name: p.read_text(errors="replace") for p in logs.glob("workerlog.*")}
    assert done.returncode == 0, done.stdout[-2000:] + "".join(worker_logs.values())[-4000:]
    results = [
        json.loads(line)
        for text in worker_logs.values()
        for line in text.splitlines()
        if line.startswith('{"rank"')
    ]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["world"] == 2
        assert result["sum"] == [3.0, 0.5]
    assert results[0]["loss"] != results[1]["loss"]  # different data per rank...
    assert results[0]["checksum"] == results[1]["checksum"]  # ...same weights after the step


# --- small contracts ----------------------------------------------------------------------------
def test_lr_factor_warms_up_then_follows_the_schedule():
    cosine = lr_factor("cosine", warmup_steps=4, total_steps=104)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(4) == 1.0 and cosine(54) == pytest.approx(0.5) and cosine(104) == 0.0
    step = lr_factor("step", warmup_steps=0, total_steps=90)
    assert (step(29), step(30), step(60)) == (1.0, pytest.approx(0.1), pytest.approx(0.01))
    assert lr_factor("constant", 0, 10)(9) == 1.0


def test_gpu_device_on_a_cpu_build_says_how_to_fix(ocr_lmdb):
    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("this host has a GPU")
    backend = PaddleBackend(ocr_config(ocr_lmdb, train={"device": "gpu"}))
    with pytest.raises(RuntimeError, match="train.device: cpu"):
        backend.init_distributed()


def test_profile_range_is_a_record_event_only_when_profiling(ocr_lmdb):
    quiet = started(ocr_config(ocr_lmdb))
    with quiet.profile_range("step"):
        pass
    profiling = started(ocr_config(ocr_lmdb, train={"profile": True}))
    marker = profiling.profile_range("step")
    assert isinstance(marker, paddle.profiler.RecordEvent)
    with marker:
        pass
