"""TorchBackend on the CPU, what is particular to it: the torch loader's knobs and threads,
refusing torch.save pickles, RNG state on resume, profiler ranges and a two-process gloo group.
What every backend must do is tested once for both in test_backend_contract.py.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" \
        tests/test_backend_torch.py tests/test_backend_contract.py

The CUDA paths (side-stream prefetch, AMP, NCCL) need a GPU and are not run here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from datasets.sampler import EpochSampler  # noqa: E402
from tests.backends import (  # noqa: E402
    TINY_OCR_DATA,
    Payload,
    build,
    first_batches,
    host_batches,
    make_config,
    open_dataset,
    start,
)
from train.backends.torch.data import RingLoader  # noqa: E402
from train.checkpoint import UnsafeCheckpointError  # noqa: E402
from train.cpus import usable_cores  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """set_cpu_threads sets the main process's thread count on the CPU; keep tests independent."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- checkpoints
def _small_ocr_backend(ocr_lmdb: Path):
    config = make_config("torch", "ocr", ocr_lmdb, data=TINY_OCR_DATA)
    backend = start(config)
    build(backend, config, num_classes=5, total_steps=10)
    return backend


@pytest.mark.parametrize("part", ["model", "optimizer", "rng"])
def test_load_state_refuses_objects_in_a_torch_save_file(part, ocr_lmdb, tmp_path):
    backend = _small_ocr_backend(ocr_lmdb)
    backend.state.save_state(tmp_path)
    marker = tmp_path / "executed.txt"
    torch.save({"state": Payload(marker)}, tmp_path / f"{part}.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"refused to load .*{part}\.pt.*weights_only"):
        backend.state.load_state(tmp_path)
    assert not marker.exists()


def test_load_state_restores_the_generators(ocr_lmdb, tmp_path):
    config = make_config("torch", "ocr", ocr_lmdb, deterministic=True)
    first = start(config)
    batches, num_classes = first_batches(first, config, 2)
    build(first, config, num_classes, total_steps=4)
    for batch in batches:
        first.trainer.train_step(batch)
    first.state.save_state(tmp_path)
    at_checkpoint = torch.get_rng_state()
    torch.manual_seed(99)
    resumed = start(config, seed=7)
    build(resumed, config, num_classes, total_steps=4)
    resumed.state.load_state(tmp_path)
    assert torch.equal(torch.get_rng_state(), at_checkpoint)
    assert resumed.trainer.scheduler.last_epoch == first.trainer.scheduler.last_epoch == 2


# ---------------------------------------------------------------- loader knobs
def test_spawned_workers_give_the_batches_of_the_main_process(ocr_lmdb):
    """Persistent fork workers: test_backend_contract.py. A spawn worker is a fresh interpreter
    that unpickles the dataset and the prefetch knob."""
    loader_knobs = {
        "batch_size": 16,
        "num_workers": 1,
        "prefetch_factor": 3,
        "multiprocessing_context": "spawn",
        "timeout_s": 30.0,
    }
    config = make_config("torch", "ocr", ocr_lmdb, data={"augment": True}, loader=loader_knobs)
    backend = start(config)
    dataset, _ = open_dataset(config)
    reference = host_batches(backend, dataset, config, workers=0, epochs=1)
    with_workers = host_batches(backend, dataset, config, workers=1, epochs=1)
    assert len(with_workers) == len(reference) == 96 // 16
    for got, want in zip(with_workers, reference):
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in want)


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
    config = make_config("torch", "ocr", ocr_lmdb, loader=knobs)
    backend = start(config)
    dataset, _ = open_dataset(config)
    backend.batches.set_cpu_threads(2)
    # Main-process threads leave one core per worker (at least one thread).
    assert torch.get_num_threads() == max(1, usable_cores() - 2)
    train = backend.batches.make_loader(dataset, EpochSampler(len(dataset)), config.loader, True)
    # Workers hand batches over through the ring (loader.batch_ring): its slots are the
    # batches in flight, prefetch_factor per worker and 2 held by the trainer.
    assert isinstance(train, RingLoader) and train.ring.slots == 3 * 2 + 2
    loader, batches = train.loader, train.loader.batch_sampler.batches
    assert (batches.batch_size, batches.drop_last) == (16, True)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    assert loader.timeout == 30.0
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    assert train.pin_memory is False  # no GPU: page-locking buys nothing
    assert loader.pin_memory is False  # the loader carries slot numbers; RingLoader pins
    assert len(train) == 96 // 16

    sampler = EpochSampler(len(dataset), shuffle=False)
    no_workers = dataclasses.replace(config.loader, num_workers=0)
    evaluation = backend.batches.make_loader(dataset, sampler, no_workers, False)
    # At 0 workers the batching is a whole-batch sampler's (datasets.sampler.WholeBatches)
    batches = evaluation.batch_sampler.batches
    assert (batches.batch_size, batches.drop_last) == (40, False)
    assert evaluation.prefetch_factor is None and evaluation.timeout == 0  # no workers
    sizes = [len(batch["image"]) for batch in evaluation]
    assert sizes == [40, 40, 16]  # every evaluation sample counts


# In a fresh process: multiprocessing's fork server is one per process and reads its preload
# list once, when it starts.
FORK_SERVER_PROBE = """
import json, sys
from pathlib import Path
import psutil
from datasets.sampler import EpochSampler
from tests.backends import make_config, open_dataset, start
loader = {"num_workers": 1, "multiprocessing_context": "forkserver"}
config = make_config("torch", "ocr", Path(sys.argv[1]), loader=loader)
backend = start(config)
dataset, _ = open_dataset(config)
loader = backend.batches.make_loader(dataset, EpochSampler(len(dataset)), config.loader, True)
batches = len(list(loader))
(server,) = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
maps = Path(f"/proc/{server.pid}/maps").read_text()
print(json.dumps({"batches": batches, "torch": "libtorch_cpu" in maps, "cv2": "/cv2/" in maps}))
"""


def test_forkserver_workers_are_forked_with_torch_and_opencv_imported(ocr_lmdb):
    """loader.multiprocessing_context=forkserver: the fork server imports torch, OpenCV and the
    dataset's module before it forks the first worker, so no worker imports them (about 2 CPU-s
    each, at every epoch's start without persistent workers). The server holds their native
    libraries once it has imported them."""
    result = subprocess.run(
        [sys.executable, "-c", FORK_SERVER_PROBE, str(ocr_lmdb)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found == {"batches": found["batches"], "torch": True, "cv2": True}
    assert found["batches"] > 0


# ---------------------------------------------------------------- profiler
def test_profile_ranges_on_cpu(ocr_lmdb):
    quiet = start(make_config("torch", "ocr", ocr_lmdb))
    assert "nullcontext" in type(quiet.runtime.profile_range("x")).__name__
    backend = start(make_config("torch", "ocr", ocr_lmdb, train={"profile": True}))
    with torch.profiler.profile() as profiler, backend.runtime.profile_range("data_wait"):
        torch.ones(4).sum()
    assert "data_wait" in {event.name for event in profiler.events()}


# ---------------------------------------------------------------- two processes, gloo
DIST_WORKER = r"""
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from train.backends import make_backend
from train.config.load import config_from_dict

config = config_from_dict(json.loads(sys.argv[1]))
backend = make_backend(config)
info = backend.runtime.init_distributed()
backend.runtime.seed_everything(0, True)
total = backend.runtime.all_reduce_sum(np.array([info.rank + 1.0, 0.5]))
backend.runtime.barrier()
backend.build(config.model, config.optim, (3, 16, 32), num_classes=5, total_steps=4)
rng = np.random.default_rng(info.rank)  # different data per rank; DDP keeps replicas equal
host = {
    "image": torch.from_numpy(rng.integers(0, 256, (2, 16, 32, 3), dtype=np.uint8)),
    "label": torch.tensor([[1, 2, 3], [4, 3, 0]], dtype=torch.int32),
    "length": torch.tensor([3, 2], dtype=torch.int32),
}
for batch in backend.batches.device_batches([host, host]):
    backend.trainer.train_step(batch)
checksum = sum(float(p.double().sum()) for p in backend.trainer.net.parameters())
report = {"rank": info.rank, "world": info.world_size, "sum": total.tolist(),
          "backend": dist.get_backend(), "ddp": type(backend.trainer.model).__name__,
          "checksum": checksum}
backend.runtime.barrier()
backend.runtime.shutdown()
print("RESULT " + json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_gloo_workers(script: str, args: list[str], timeout: float) -> list[dict]:
    """Run ``python -c script *args`` as ranks 0 and 1 of a gloo group on the loopback device;
    each must exit 0. Returns the JSON reports they print on lines starting "RESULT ", by rank."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on host networking
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=timeout)[0] for worker in workers]
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
    return sorted(reports, key=lambda report: report["rank"])


def test_two_process_gloo_all_reduce_barrier_and_ddp(ocr_lmdb):
    raw = {
        "task": "ocr",
        "framework": "torch",
        "data": {"train": str(ocr_lmdb), "char_dict": "unused.txt", **TINY_OCR_DATA},
        "model": {"name": "crnn_tiny", "hidden_size": 16},
        "train": {"device": "cpu"},
    }
    reports = run_gloo_workers(DIST_WORKER, [json.dumps(raw)], timeout=60)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["world"] == 2 and report["backend"] == "gloo"
        assert report["sum"] == [3.0, 1.0]
        assert report["ddp"] == "DistributedDataParallel"
    assert reports[0]["checksum"] == reports[1]["checksum"]  # gradients were averaged


# ---------------------------------------------------------------- weight decay
def test_weight_decay_skips_one_dimensional_parameters(ocr_lmdb):
    """train/schedule.py's rule, as the Paddle backend applies it: no decay on biases and norm
    weights."""
    backend = _small_ocr_backend(ocr_lmdb)
    decayed, free = backend.trainer.optimizer.param_groups
    assert decayed["weight_decay"] == 1e-4 and free["weight_decay"] == 0.0
    assert all(p.dim() > 1 for p in decayed["params"]) and all(p.dim() == 1 for p in free["params"])
    assert len(decayed["params"]) + len(free["params"]) == len(
        list(backend.trainer.net.parameters())
    )
