"""The torch backend's Runtime (train/backends/base.py): ranks from torchrun's environment, the
device, the generators, the collectives, NVTX/profiler markers and TensorBoard's scalar log."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from train.backends import common, launcher_dist
from train.backends.base import DeviceUnavailableError, DistInfo
from train.backends.gpu_probe import FrameworkCuda

log = logging.getLogger(__name__)


class TorchRuntime(common.RuntimeBase):
    """This process under torchrun: its rank, its device (``device``, which the other parts
    read), its generators and the collectives with the other ranks."""

    out_of_memory_errors = (torch.cuda.OutOfMemoryError, MemoryError)

    def __init__(self, train) -> None:
        super().__init__(train)
        self.device = torch.device("cpu")  # until init_distributed picks one

    def init_distributed(self) -> DistInfo:
        self.dist = launcher_dist("torch")
        world_size = self.dist.world_size
        self.device = self._pick_device()
        _allow_tf32()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if world_size > 1 and not dist.is_initialized():
            cuda = self.device.type == "cuda"
            dist.init_process_group(
                backend="nccl" if cuda else "gloo",
                rank=self.dist.rank,
                world_size=world_size,
                # The rendezvous, NCCL's setup and every collective (NCCL's default: 10 min).
                timeout=timedelta(seconds=self.train.dist_timeout_s),
                # Binds NCCL to this rank's GPU up front, so collectives never guess the device.
                device_id=self.device if cuda else None,
            )
        return self.dist

    def _pick_device(self) -> torch.device:
        if not common.choose_gpu(self.train.device, cuda_facts()):
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if self.dist.local_rank >= count:
            raise DeviceUnavailableError(
                f"LOCAL_RANK {self.dist.local_rank} but only {count} GPU(s) are visible",
                "start at most one process per GPU (torchrun --nproc-per-node)",
            )
        return torch.device("cuda", self.dist.local_rank)

    @property
    def device_index(self) -> int | None:
        return self.device.index if self.device.type == "cuda" else None

    @property
    def device_name(self) -> str:
        if self.device.type != "cuda":
            return "cpu"
        return f"cuda:{self.device.index} ({torch.cuda.get_device_name(self.device)})"

    def is_out_of_memory(self, exc: BaseException) -> bool:
        # On the CPU torch reports a failed allocation as a plain RuntimeError from c10's
        # alloc_cpu ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...").
        return super().is_out_of_memory(exc) or (
            isinstance(exc, RuntimeError) and "DefaultCPUAllocator" in str(exc)
        )

    def allocate_bytes(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=torch.uint8, device=self.device)

    def seed_framework(self, seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)  # CPU and every CUDA device
        if deterministic:
            # cuBLAS needs a fixed workspace for reproducible GEMMs; read at its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # CTC loss, NLL loss and adaptive average pooling have no deterministic CUDA backward,
        # so on a GPU those only warn instead of stopping the run. On a CPU every op used here
        # is deterministic, and a new one that is not should fail loudly.
        torch.use_deterministic_algorithms(deterministic, warn_only=self.device.type == "cuda")
        torch.backends.cudnn.deterministic = deterministic
        # Input shapes are fixed, so cuDNN's one-off autotuning pays for itself, but it may pick
        # a different (equally correct) kernel in each run.
        torch.backends.cudnn.benchmark = not deterministic

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        if self.dist.world_size == 1:
            return values
        tensor = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu().numpy()

    def barrier(self) -> None:
        if self.dist.world_size > 1:
            dist.barrier()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        if not self.train.profile:
            return contextlib.nullcontext()
        if self.device.type == "cuda":
            return torch.cuda.nvtx.range(name)  # shows in Nsight Systems timelines
        return torch.autograd.profiler.record_function(name)  # shows in torch.profiler traces

    def scalar_writer(self, log_dir: Path) -> Any | None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(str(log_dir))
        except Exception:  # tensorboard is not installed: no scalar log
            return None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _allow_tf32() -> None:
    """TF32 tensor cores (Ampere and newer) for float32 matrix multiplies and convolutions, as
    Paddle 2.6 does by default for both (cuBLAS and cuDNN). Torch's defaults differ: TF32 for
    convolutions, full float32 for matmuls, which slowed the CRNN's LSTM and linear layers and
    skewed every torch-vs-Paddle comparison. TF32 keeps float32's range with a 10-bit mantissa:
    the common choice for training; under AMP only the float32 ops use it."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def cuda_facts() -> FrameworkCuda:
    """What this torch build says about CUDA (as gpu_probe.py's probe asks it): whether
    it is a CUDA build, the GPUs it can use, and what it warned while looking (a driver too
    old, for one)."""
    compiled = torch.version.cuda is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            count = torch.cuda.device_count() if compiled and torch.cuda.is_available() else 0
        except Exception as error:  # a CUDA runtime that cannot start
            warnings.warn(str(error), stacklevel=1)
            count = 0
    said = "; ".join(dict.fromkeys(str(w.message).strip() for w in caught))[:500]
    return FrameworkCuda(
        "torch",
        version=torch.__version__,
        cuda=torch.version.cuda,
        compiled=compiled,
        count=count,
        warnings=said,
    )
