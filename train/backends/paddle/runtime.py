"""The Paddle backend's Runtime (train/backends/base.py): ranks from paddle.distributed.launch's
environment, the GPU, the generators, the collectives, profiler markers and VisualDL's scalar
log."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from train.backends import common, launcher_dist
from train.backends.base import DeviceUnavailableError, DistInfo
from train.backends.gpu_probe import FrameworkCuda

log = logging.getLogger(__name__)

STORE_TIMEOUT_S = 900  # Paddle 2.6's rendezvous (TCPStore) timeout: see init_distributed


class PaddleRuntime(common.RuntimeBase):
    """This process under paddle.distributed.launch: its rank, its GPU (``gpu_id``, None on the
    CPU, and ``place``, which the other parts read), its generators and the collectives."""

    def __init__(self, train) -> None:
        super().__init__(train)
        self.gpu_id: int | None = None  # None: CPU

    def init_distributed(self) -> DistInfo:
        self.dist = launcher_dist("paddle")  # set by python -m paddle.distributed.launch
        self.gpu_id = self._pick_gpu()
        _allow_tf32()
        device = "cpu" if self.gpu_id is None else f"gpu:{self.gpu_id}"
        paddle.set_device(device)
        if self.dist.world_size > 1 and not dist.is_initialized():
            # The NCCL process group's timeout (ms), which Paddle 2.6 reads from the environment
            # in init_parallel_env (ParallelEnv; its default is 30 min).
            os.environ["PADDLE_PG_TIMEOUT"] = str(int(self.train.dist_timeout_s * 1000))
            # The rendezvous before it has a timeout of its own that nothing can set: every rank
            # waits at most 900 s for all ranks to reach init_parallel_env. Paddle 2.6.2 makes
            # its TCPStore with core.create_or_get_global_tcp_store() (distributed/parallel.py,
            # line 1099), which passes no timeout, so TCPStore's default argument holds
            # (include/paddle/phi/core/distributed/store/tcp_store.h, line 128: timeout = 900).
            # The FLAGS_stop_check_timeout read on the line before is never used.
            if self.train.dist_timeout_s > STORE_TIMEOUT_S:
                log.info(
                    "train.dist_timeout_s=%g s covers Paddle's collectives; its start-up "
                    "rendezvous waits at most %d s for all ranks (fixed in Paddle 2.6): a rank "
                    "that arrives later, such as one still staging s3:// data, fails the start "
                    "(a restart reuses what data.remote_cache_dir already holds)",
                    self.train.dist_timeout_s,
                    STORE_TIMEOUT_S,
                )
            if self.gpu_id is None:
                # On a GPU host the launcher hands each rank a GPU (FLAGS_selected_gpus) and no
                # backend, and a CUDA build then picks NCCL: gloo is the CPU's.
                os.environ["PADDLE_DISTRI_BACKEND"] = "gloo"
            dist.init_parallel_env()
            # init_parallel_env sets the expected place itself (the launcher's GPU on a CUDA
            # build, whatever train.device says): ours again.
            paddle.set_device(device)
        return self.dist

    def _pick_gpu(self) -> int | None:
        if not common.choose_gpu(self.train.device, cuda_facts()):
            return None
        gpus = paddle.device.cuda.device_count()
        # The launcher gives each rank its GPU in FLAGS_selected_gpus (--devices 0,1,...).
        selected = os.environ.get("FLAGS_selected_gpus", "").split(",")[0]  # noqa: SIM112
        gpu = int(selected) if selected.strip() else self.dist.local_rank
        if gpu >= gpus:
            raise DeviceUnavailableError(
                f"rank {self.dist.rank} wants GPU {gpu} but only {gpus} are visible",
                "start at most one process per GPU (paddle.distributed.launch --devices)",
            )
        return gpu

    @property
    def place(self) -> Any:
        return paddle.CPUPlace() if self.gpu_id is None else paddle.CUDAPlace(self.gpu_id)

    @property
    def device_index(self) -> int | None:
        return self.gpu_id

    @property
    def device_name(self) -> str:
        if self.gpu_id is None:
            return "cpu"
        return f"gpu:{self.gpu_id} ({paddle.device.cuda.get_device_name(self.gpu_id)})"

    def allocate_bytes(self, count: int) -> paddle.Tensor:
        # Paddle raises MemoryError ("(ResourceExhausted) Fail to alloc memory of ...") for the
        # host's allocator and for the GPU's alike.
        return paddle.empty([count], dtype="uint8")

    def seed_framework(self, seed: int, deterministic: bool) -> None:
        paddle.seed(seed)  # the CPU and every CUDA generator
        if deterministic:
            _set_flags_that_exist(
                FLAGS_cpu_deterministic=True,
                # CUDA builds only; a CPU build rejects them as unknown.
                FLAGS_cudnn_deterministic=True,
                FLAGS_cudnn_exhaustive_search=False,
                FLAGS_embedding_deterministic=1,
            )

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        if self.dist.world_size == 1:
            return values
        tensor = paddle.to_tensor(np.asarray(values, dtype=np.float64), place=self.place)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.numpy()

    def barrier(self) -> None:
        if self.dist.world_size > 1:
            dist.barrier()

    def synchronize(self) -> None:
        if self.gpu_id is not None:
            paddle.device.cuda.synchronize(self.gpu_id)

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        if not self.train.profile:
            return contextlib.nullcontext()
        return paddle.profiler.RecordEvent(name)  # shows in paddle.profiler timelines

    def scalar_writer(self, log_dir: Path) -> Any | None:
        try:
            from visualdl import LogWriter

            return LogWriter(logdir=str(log_dir))
        except Exception:  # visualdl is not installed: no scalar log
            return None

    def shutdown(self) -> None:
        if self.dist.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _allow_tf32() -> None:
    """TF32 tensor cores for float32 matrix multiplies (cuBLAS) and convolutions (cuDNN): Paddle
    2.6's defaults, said explicitly because the torch backend sets the same (see its
    _allow_tf32). Only CUDA builds have these switches."""
    core = paddle.base.core
    for switch in ("set_cublas_switch", "set_cudnn_switch"):
        if hasattr(core, switch):
            getattr(core, switch)(True)


def cuda_facts() -> FrameworkCuda:
    """What this Paddle build says about CUDA (as gpu_probe.py's probe asks it): whether
    it is a CUDA build and the GPUs it can use."""
    compiled = bool(paddle.device.is_compiled_with_cuda())
    count, said = 0, ""
    if compiled:
        try:
            count = paddle.device.cuda.device_count()
        except Exception as error:  # a CUDA runtime that cannot start
            said = str(error).strip().splitlines()[0][:500] if str(error).strip() else ""
    return FrameworkCuda(
        "paddle",
        version=paddle.__version__,
        cuda=paddle.version.cuda() if compiled else None,
        compiled=compiled,
        count=count,
        warnings=said,
    )


def _set_flags_that_exist(**flags: Any) -> None:
    """paddle.set_flags, skipping flags this build does not define (CUDA-only ones on CPU)."""
    for name, value in flags.items():
        try:
            paddle.set_flags({name: value})
        except ValueError:
            log.debug("this Paddle build has no %s; not set", name)
