"""The PyTorch backend's GPU-only decisions, reached on the CPU through seams: the memory format
of batches and weights on CUDA, the fp16 loss scaler on a resume whose train.amp changed, each
rank's generator states in a checkpoint (two gloo processes), and train.compile's toolchain.
tests/test_gpu_paths.py holds the other GPU seams; scripts/gpu_check.sh runs them on a GPU.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" \
        tests/test_torch_gpu_paths.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from tests.backends import TINY_OCR_DATA, build, make_config, start  # noqa: E402
from tests.test_backend_torch import run_gloo_workers  # noqa: E402
from tests.test_distributed import local_master  # noqa: E402
from tests.test_train import FAST, ROOT, data_overrides, set_args  # noqa: E402
from train.backends.base import DistInfo  # noqa: E402
from train.backends.torch import state as torch_state  # noqa: E402
from train.backends.torch import trainer as torch_trainer  # noqa: E402
from train.backends.torch.models import FAMILIES, memory_format  # noqa: E402
from train.errors import RunError  # noqa: E402
from train.launch import launch_command  # noqa: E402

pytestmark = pytest.mark.torch


# ---------------------------------------------------------------- layout of batches and weights
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_memory_format_is_channels_last_only_on_cuda_for_the_families_marked_so(family):
    want = torch.channels_last if FAMILIES[family].channels_last else torch.contiguous_format
    assert memory_format("cuda", family) == want
    assert memory_format("cpu", family) == torch.contiguous_format
    assert memory_format("cuda", None) == torch.contiguous_format  # before build()


def built_as_on_cuda(config, monkeypatch):
    """A backend built as on a GPU (the seam: its device says cuda; Module.to keeps the
    weights on the CPU but applies the memory format; the pixel constants are CPU tensors)."""
    backend = start(config)
    backend.runtime.device = torch.device("cuda", 0)
    to = torch.nn.Module.to

    def to_memory_format_only(module, *args, **kwargs):
        if "memory_format" in kwargs:
            return to(module, memory_format=kwargs["memory_format"])
        return module

    monkeypatch.setattr(torch.nn.Module, "to", to_memory_format_only)
    build(backend, config, num_classes=5, total_steps=4)
    scale, shift = backend.task.pixel_scale_shift(backend.batches.model_spec)
    backend.batches._stats = (torch.from_numpy(scale), torch.from_numpy(shift))
    return backend


@pytest.mark.parametrize(
    "task, model, family", [("ocr", "crnn_tiny", "crnn"), ("resnet50", "resnet18", "resnet")]
)
def test_cuda_batches_take_the_layout_of_the_models_weights(
    task, model, family, ocr_lmdb, image_h5, monkeypatch
):
    """On CUDA only the families marked channels_last get channels_last batches: a CRNN's
    batches stay plain NCHW, like its weights, instead of being converted back in every
    convolution."""
    data = ocr_lmdb if task == "ocr" else image_h5
    shape = TINY_OCR_DATA if task == "ocr" else {"image_size": 32}
    config = make_config("torch", task, data, data=shape, model={"name": model})
    backend = built_as_on_cuda(config, monkeypatch)
    images = torch.randint(0, 256, (2, 16, 32, 3), dtype=torch.uint8)
    batch = backend.batches._normalize(images)
    conv_weights = [
        m.weight for m in backend.trainer.net.modules() if isinstance(m, torch.nn.Conv2d)
    ]
    if FAMILIES[family].channels_last:
        assert batch.is_contiguous(memory_format=torch.channels_last)
        assert not batch.is_contiguous()
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights)
    else:
        assert batch.is_contiguous() and not batch.is_contiguous(memory_format=torch.channels_last)
        assert all(w.is_contiguous() for w in conv_weights)


def test_cpu_batches_are_plain_nchw(image_h5):
    config = make_config("torch", "resnet50", image_h5, data={"image_size": 32})
    backend = start(config)
    build(backend, config, num_classes=4, total_steps=4)
    batch = backend.batches._normalize(torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8))
    assert batch.shape == (2, 3, 32, 32) and batch.dtype == torch.float32
    assert batch.is_contiguous()


# ---------------------------------------------------------------- fp16 scaler on a resume
def test_scaler_state_to_load_for_each_change_of_train_amp(caplog):
    fp16_state = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5}
    fp16_state |= {"growth_interval": 2000, "_growth_tracker": 7}
    with caplog.at_level("INFO"):
        # none/bf16 -> fp16: nothing saved, the enabled scaler starts fresh (and says so)
        assert torch_state._scaler_state_to_load({}, enabled=True) is None
    assert any("starts at its initial scale" in r.getMessage() for r in caplog.records)
    assert torch_state._scaler_state_to_load(fp16_state, enabled=True) == fp16_state
    # fp16 -> none/bf16, and none/bf16 -> none/bf16: the disabled scaler loads nothing
    assert torch_state._scaler_state_to_load(fp16_state, enabled=False) is None
    assert torch_state._scaler_state_to_load({}, enabled=False) is None


def small_ocr_backend(ocr_lmdb):
    config = make_config("torch", "ocr", ocr_lmdb, data=TINY_OCR_DATA)
    backend = start(config)
    build(backend, config, num_classes=5, total_steps=10)
    return backend


def enabled_scaler():
    """An enabled GradScaler: the CPU one (the seam: on a CPU-only host GradScaler("cuda")
    disables itself). Its state_dict is what an fp16 run saves."""
    return torch.amp.GradScaler("cpu", enabled=True, init_scale=2.0**16)


def test_resume_with_fp16_from_a_checkpoint_without_scaler_state(ocr_lmdb, tmp_path):
    saved = small_ocr_backend(ocr_lmdb)  # train.amp none: the scaler is disabled
    saved.state.save_state(tmp_path)
    assert torch.load(tmp_path / "scaler.pt", weights_only=True) == {}
    resumed = small_ocr_backend(ocr_lmdb)
    resumed.trainer.scaler = enabled_scaler()  # train.amp changed to fp16
    resumed.state.load_state(tmp_path)  # GradScaler.load_state_dict({}) raised here
    assert resumed.trainer.scaler.is_enabled() and resumed.trainer.scaler.get_scale() == 2.0**16


def test_resume_without_fp16_from_a_checkpoint_with_scaler_state(ocr_lmdb, tmp_path):
    saved = small_ocr_backend(ocr_lmdb)
    saved.trainer.scaler = enabled_scaler()
    saved.trainer.scaler.scale(torch.ones(()))  # its scale starts at the first scale()
    saved.trainer.scaler.update(new_scale=512.0)
    saved.state.save_state(tmp_path)
    assert torch.load(tmp_path / "scaler.pt", weights_only=True)["scale"] == 512.0
    resumed = small_ocr_backend(ocr_lmdb)  # train.amp none or bf16: the scaler is disabled
    resumed.state.load_state(tmp_path)
    assert not resumed.trainer.scaler.is_enabled() and resumed.trainer.scaler.state_dict() == {}


# ---------------------------------------------------------------- each rank's RNG state
def test_rank_rng_state_picks_this_ranks_entry_or_rank_0s(caplog):
    entries = [{"torch_cpu": torch.full((4,), rank, dtype=torch.uint8)} for rank in range(2)]
    state = {**entries[0], "ranks": entries}
    pick = torch_state._rank_rng_state
    with caplog.at_level("INFO"):
        assert pick(state, DistInfo(rank=1, world_size=2)) is entries[1]
        assert pick(state, DistInfo(rank=0, world_size=2)) is entries[0]
        assert not caplog.records
        # Another world size: every rank takes rank 0's (the file's top level), said once.
        assert pick(state, DistInfo(rank=2, world_size=3)) is state
        assert pick(state, DistInfo(rank=0, world_size=3)) is state
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "checkpoint holds the RNG states of 2 rank(s), this run has 3: every rank "
        "restores rank 0's"
    ]
    single = {"torch_cpu": entries[0]["torch_cpu"]}  # one process's checkpoint
    assert pick(single, DistInfo()) is single


RNG_WORKER = r"""
import json, random, sys
import numpy as np
import torch
from train.backends import make_backend
from train.config.load import config_from_dict

config = config_from_dict(json.loads(sys.argv[1]))
directory = sys.argv[2]
backend = make_backend(config)
info = backend.runtime.init_distributed()
backend.runtime.seed_everything(0, True)
backend.build(config.model, config.optim, (3, 16, 32), num_classes=5, total_steps=4)
# Each rank's generators in a state of its own, as ranks drawing different numbers leave them.
torch.manual_seed(100 + info.rank)
random.seed(100 + info.rank)
np.random.seed(100 + info.rank)
saved = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
backend.state.prepare_save()
if info.is_main:
    backend.state.save_state(directory)
backend.runtime.barrier()
torch.rand(5), random.random(), np.random.rand(3)  # move every generator on
backend.state.load_state(directory)
report = {
    "rank": info.rank,
    "torch": torch.equal(torch.get_rng_state(), saved[0]),
    "python": random.getstate() == saved[1],
    "numpy": bool(np.array_equal(np.random.get_state()[1], saved[2])),
    "draw": torch.rand(2).tolist(),
}
backend.runtime.barrier()
backend.runtime.shutdown()
print("RESULT " + json.dumps(report))
"""


def test_each_of_two_gloo_ranks_restores_its_own_generator_states(ocr_lmdb, tmp_path):
    """Rank 0 writes the checkpoint; prepare_save (every rank) gathered the ranks' states into
    it, so each rank's torch, Python and numpy generators resume where that rank's were, not
    where rank 0's were."""
    raw = {
        "task": "ocr",
        "framework": "torch",
        "data": {"train": str(ocr_lmdb), "char_dict": "unused.txt", **TINY_OCR_DATA},
        "model": {"name": "crnn_tiny", "hidden_size": 16},
        "train": {"device": "cpu"},
    }
    reports = run_gloo_workers(RNG_WORKER, [json.dumps(raw), str(tmp_path)], timeout=120)
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert (report["torch"], report["python"], report["numpy"]) == (True, True, True), report
    assert reports[0]["draw"] != reports[1]["draw"]
    rng = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert len(rng["ranks"]) == 2
    assert torch.equal(rng["ranks"][0]["torch_cpu"], rng["torch_cpu"])  # the top level: rank 0


def test_torchrun_checkpoint_holds_every_ranks_generator_states(tmp_path, ocr_lmdb, image_h5):
    """Through the loop: Run.save has every rank gather before rank 0 writes (2 ranks, 2
    steps, a checkpoint at step 2)."""
    out = tmp_path / "run"
    sets = ["framework=torch", *FAST, *data_overrides("ocr", ocr_lmdb, image_h5)]
    sets += ["train.max_steps=2", "train.checkpoint_every=2", "train.eval_every=2"]
    sets += ["loader.num_workers=0", "optim.warmup_steps=0"]
    args = ["-m", "train", "--config", "configs/ocr/smoke.yaml", "--output-dir", str(out)]
    cmd = launch_command("torch", sys.executable, 2, args + set_args(sets), master=local_master())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rng = torch.load(out / "checkpoints" / "step-00000002" / "rng.pt", weights_only=True)
    assert len(rng["ranks"]) == 2
    assert all(set(entry) >= {"torch_cpu", "python", "numpy"} for entry in rng["ranks"])


# ---------------------------------------------------------------- train.compile's toolchain
def test_compile_without_a_compiler_fails_at_build_naming_the_fix(ocr_lmdb, monkeypatch):
    """train.compile: true where inductor would find no C++ compiler: build() stops with what
    is missing and both ways out, instead of InvalidCxxCompiler deep in the first step."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    config = make_config("torch", "ocr", ocr_lmdb, data=TINY_OCR_DATA, train={"compile": True})
    backend = start(config)
    with pytest.raises(RunError) as raised:
        build(backend, config, num_classes=5, total_steps=4)
    message = str(raised.value)
    assert "needs a C++ compiler (/nonexistent/g++, or $CXX)" in message
    assert "apt-get install gcc g++" in message and "train.compile=false" in message
    assert "C compiler (" not in message  # Triton's: only on CUDA


def test_compile_toolchain_on_cuda_also_needs_a_c_compiler(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/gcc")
    with pytest.raises(RunError, match=r"a C compiler \(/nonexistent/gcc\)"):
        torch_trainer._check_compile_toolchain("cuda")


def test_compile_toolchain_of_a_host_with_gcc_passes():
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler on this host")
    torch_trainer._check_compile_toolchain("cpu")  # no error
