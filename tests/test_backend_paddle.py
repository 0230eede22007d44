"""PaddleBackend on the CPU, what is particular to it: optimizer state keyed by parameter names
across resumes, .npz checkpoints, the loader's epoch-start poll and per-batch timeout, CTC
decoding against PaddleOCR's, a 2-process gloo collective and profiler events. What every
backend must do is tested once for both in test_backend_contract.py.

    TEST_FRAMEWORK=paddle .venv-paddle/bin/python -m pytest -m "not torch" \
        tests/test_backend_paddle.py tests/test_backend_contract.py tests/test_paddle_png.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from datasets.ocr_transforms import CharDict
from datasets.sampler import EpochSampler
from tests.backends import build, first_batches, make_config, open_dataset, start
from train.checkpoint import UnsafeCheckpointError
from train.launch import launch_command
from train.metrics import ctc_greedy_decode

pytestmark = pytest.mark.paddle
paddle = pytest.importorskip("paddle")

ROOT = Path(__file__).resolve().parent.parent


def ocr_config(lmdb: Path, **sections):
    """crnn_tiny with Adam, deterministic, over the fixture LMDB; keywords update sections."""
    optim = {"name": "adam", "lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}
    sections["optim"] = {**optim, **sections.get("optim", {})}
    return make_config("paddle", "ocr", lmdb, deterministic=True, **sections)


# --- checkpoints ----------------------------------------------------------------------------------
def tensors(backend) -> dict[str, np.ndarray]:
    state = {f"model/{k}": v.numpy() for k, v in backend.trainer.net.state_dict().items()}
    state.update({f"optim/{k}": v for k, v in backend.state.optimizer_tensors().items()})
    return state


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resumed_run_is_bit_identical(ocr_lmdb, tmp_path, optimizer):
    """Paddle keys optimizer state by parameter names: a resumed backend must find every
    accumulator under the name it was saved with (the contract test compares losses only)."""
    config = ocr_config(
        ocr_lmdb,
        data={"augment": True},
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
    batches, num_classes = first_batches(start(config), config, 6)

    whole = start(config)
    build(whole, config, num_classes, total_steps=6)
    losses = overfit_each(whole, batches)

    first_half = start(config)
    build(first_half, config, num_classes, total_steps=6)
    assert overfit_each(first_half, batches[:3]) == losses[:3]
    first_half.state.save_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.npz",
        "optimizer.npz",
        "state.json",
    ]

    resumed = start(config, seed=12345)  # a different seed: everything must come from disk
    build(resumed, config, num_classes, total_steps=6)
    resumed.state.load_state(tmp_path)
    assert resumed.trainer.current_lr() == first_half.trainer.current_lr()
    assert overfit_each(resumed, batches[3:]) == losses[3:]
    assert resumed.trainer.step == whole.trainer.step == 6
    assert resumed.trainer.current_lr() == whole.trainer.current_lr()
    expected, got = tensors(whole), tensors(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def overfit_each(backend, batches: list[dict]) -> list[float]:
    return [backend.trainer.to_float(backend.trainer.train_step(batch)) for batch in batches]


@pytest.fixture
def checkpoint(ocr_lmdb, tmp_path):
    config = ocr_config(ocr_lmdb, model={"hidden_size": 16})
    backend = start(config)
    build(backend, config, open_dataset(config)[1], total_steps=10)
    backend.state.save_state(tmp_path)
    return backend, tmp_path


def test_load_state_refuses_a_pickled_object_in_the_npz(checkpoint):
    backend, directory = checkpoint
    arrays = dict(np.load(directory / "model.npz"))
    arrays["payload"] = np.array([{"run": "code"}], dtype=object)  # needs pickle to load
    np.savez(directory / "model.npz", **arrays)
    with pytest.raises(UnsafeCheckpointError, match="'payload'.*pickled Python object"):
        backend.state.load_state(directory)


def test_load_state_names_what_does_not_fit(checkpoint, ocr_lmdb):
    _, directory = checkpoint
    config = ocr_config(ocr_lmdb, model={"hidden_size": 32})
    other = start(config)
    build(other, config, 63, total_steps=10)
    with pytest.raises(ValueError, match="does not fit this model.*rnn"):
        other.state.load_state(directory)


def test_weight_decay_skips_one_dimensional_parameters(checkpoint):
    """train/schedule.py's rule, as the torch backend applies it: no decay on biases and norm
    weights; BatchNorm's running statistics (frozen parameters in Paddle) are not optimized."""
    backend, _ = checkpoint
    decayed, free = backend.trainer.optimizer._param_groups
    assert decayed["weight_decay"] == 1e-4 and free["weight_decay"] == 0.0
    assert all(len(p.shape) > 1 for p in decayed["params"])
    assert all(len(p.shape) == 1 for p in free["params"])
    trainable = [p for p in backend.trainer.net.parameters() if p.trainable]
    assert len(decayed["params"]) + len(free["params"]) == len(trainable)


# --- loaders ----------------------------------------------------------------------------------
def test_persistent_workers_start_each_epoch_without_paddles_half_second_poll(ocr_lmdb):
    """Paddle's persistent-worker reset waited in 0.5 s sleeps at every epoch start; with the
    poll shortened, iter() returns as soon as the workers have acknowledged (milliseconds)."""
    loader_config = {"batch_size": 16, "num_workers": 1, "persistent_workers": True}
    config = ocr_config(ocr_lmdb, loader=loader_config)
    backend = start(config)
    dataset, _ = open_dataset(config)
    sampler = EpochSampler(len(dataset), seed=3)
    loader = backend.batches.make_loader(dataset, sampler, config.loader, train=True)
    waits = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        started_at = time.perf_counter()
        batches = iter(loader)  # from epoch 1 on, this is where Paddle resets its workers
        waits.append(time.perf_counter() - started_at)
        assert sum(1 for _ in batches) == 96 // 16
    assert max(waits[1:]) < 0.4, waits  # each was >= 0.5 s before


class SlowDataset:
    """Sample 5 takes far longer than the loader's timeout (a stuck storage read)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, item):
        _, index = item
        if index == 5:
            time.sleep(20)
        return {"image": np.zeros((3, 4, 4), np.uint8), "label": np.int64(index)}


def test_a_stuck_worker_raises_timeout_instead_of_hanging(ocr_lmdb, monkeypatch):
    from train.backends.paddle import compat

    at_exit = []
    exits = types.SimpleNamespace(register=lambda *call: at_exit.append(call))
    monkeypatch.setattr(compat, "atexit", exits)
    config = ocr_config(ocr_lmdb, loader={"batch_size": 2, "num_workers": 1, "timeout_s": 2})
    sampler = EpochSampler(8, shuffle=False)
    loader = start(config).batches.make_loader(SlowDataset(), sampler, config.loader, train=True)
    earlier_workers = set(multiprocessing.active_children())
    began = time.perf_counter()
    with pytest.raises(TimeoutError, match="loader.timeout_s"):
        for _ in loader:
            pass
    assert time.perf_counter() - began < 15
    # The stuck epoch's threads wait in Paddle's C++ reader until exit, where a C++ unwind
    # during finalization aborts the process: the exit handler ends them and the worker first.
    ((handler, *args),) = at_exit
    workers = set(multiprocessing.active_children()) - earlier_workers
    assert workers and threads_named("paddle-loader-pump")
    handler(*args)
    assert not threads_named("paddle-loader-pump")
    assert not any(w.is_alive() for w in workers)
    assert time.perf_counter() - began < 15


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


# --- CTC decoding vs PaddleOCR ---------------------------------------------------------------
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


# --- distributed -----------------------------------------------------------------------------
COLLECTIVE = """
import json, sys
import numpy as np
import paddle
from train.backends import make_backend
from train.config.load import config_from_dict

config = config_from_dict({
    "task": "classification", "framework": "paddle", "deterministic": True,
    "data": {"train": "unused.h5"}, "model": {"name": "resnet18"},
    "optim": {"name": "sgd", "lr": 0.01}, "train": {"device": "cpu"},
})
backend = make_backend(config)
info = backend.runtime.init_distributed()
total = backend.runtime.all_reduce_sum(np.array([info.rank + 1.0, 0.25]))
backend.runtime.barrier()
backend.runtime.seed_everything(0, True)
backend.build(config.model, config.optim, (3, 32, 32), 4, total_steps=2)
rng = np.random.default_rng(info.rank)  # each rank its own data
images = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
host = {"image": paddle.to_tensor(images), "label": paddle.to_tensor(np.arange(4) % 4)}
(batch,) = backend.batches.device_batches([host])
loss = backend.trainer.to_float(backend.trainer.train_step(batch))
# Trainable weights only: BatchNorm's running statistics follow each rank's own data.
trainable = [p for p in backend.trainer.net.parameters() if p.trainable]
checksum = float(sum(np.abs(p.numpy()).sum() for p in trainable))
print(json.dumps({"rank": info.rank, "world": info.world_size, "sum": total.tolist(),
                  "loss": loss, "checksum": checksum}), flush=True)
backend.runtime.shutdown()
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
    done = subprocess.run(
        launch_command("paddle", sys.executable, 2, [script], log_dir=logs),
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


# --- profiler -------------------------------------------------------------------------------
def test_profile_range_is_a_record_event_only_when_profiling(ocr_lmdb):
    quiet = start(ocr_config(ocr_lmdb))
    with quiet.runtime.profile_range("step"):
        pass
    profiling = start(ocr_config(ocr_lmdb, train={"profile": True}))
    marker = profiling.runtime.profile_range("step")
    assert isinstance(marker, paddle.profiler.RecordEvent)
    with marker:
        pass
