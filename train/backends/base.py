"""The contract between the framework-neutral training loop (train/loop.py) and a framework.

The loop calls only these methods, in this order:

    backend = make_backend(config)            # torch or paddle, chosen by config.framework
    dist = backend.init_distributed()         # torchrun / paddle.distributed.launch env, device
    backend.seed_everything(seed, deterministic)
    train_loader = backend.make_loader(train_set, sampler, config.loader, workers, train=True)
    backend.build(num_classes, total_steps)   # model, optimizer, LR schedule, AMP, DDP wrapper
    backend.load_state(dir)                   # on --resume
    for each epoch:
        for batch in backend.device_batches(train_loader):   # on the device, normalized
            loss = backend.train_step(batch)                  # NOT synchronized
            backend.to_float(loss)                            # only at log steps (syncs)
        backend.predict(batch) / backend.batch_labels(batch)  # evaluation
        backend.save_state(tmp_dir)                           # checkpoint (atomic rename is ours)

Batch layout from the loaders (uint8 on the host, see train/backends/*/data.py):
  OCR:      {"image": uint8 [N, C, H, W] BGR, "label": int32 [N, L], "length": int32 [N]}
  ResNet50: {"image": uint8 [N, H, W, 3] RGB, "label": int64 [N]}
device_batches() moves them to the device and normalizes there: OCR (x / 255 - 0.5) / 0.5;
ResNet ImageNet mean/std after permuting to NCHW. Shipping uint8 keeps worker IPC at 1/4 of
float32 bytes.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Backend(abc.ABC):
    name: str

    def __init__(self, config) -> None:
        self.config = config  # train.config.Config

    # --- process ---------------------------------------------------------------------------
    @abc.abstractmethod
    def init_distributed(self) -> DistInfo:
        """Read the launcher's environment, join the process group when world size > 1 (gloo on
        CPU, nccl on GPU), and pick the device from config.train.device (auto: GPU if any)."""

    @property
    @abc.abstractmethod
    def device_name(self) -> str:
        """Human-readable device, e.g. "cpu" or "cuda:0 (NVIDIA H100)"."""

    @property
    def uses_gpu(self) -> bool:
        return not self.device_name.startswith("cpu")

    @abc.abstractmethod
    def seed_everything(self, seed: int, deterministic: bool) -> None:
        """Seed the framework's RNGs (plus Python's and numpy's global ones); with deterministic,
        also select deterministic kernels."""

    # --- data ------------------------------------------------------------------------------
    @abc.abstractmethod
    def make_loader(self, dataset, sampler, loader_config, num_workers: int, train: bool) -> Any:
        """The framework's DataLoader over a datasets.RecordDataset with a
        datasets.sampler.EpochSampler; every knob of loader_config honoured."""

    @abc.abstractmethod
    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        """Iterate one epoch of ``loader``, yielding batches on the device with float images
        normalized there (on CUDA: copies on a side stream, one batch ahead, from pinned memory).
        Label fields keep their keys."""

    # --- model and optimization ---------------------------------------------------------------
    @abc.abstractmethod
    def build(self, num_classes: int, total_steps: int) -> None:
        """Create the model (config.model.name), optimizer, LR schedule (warmup + schedule over
        total_steps), AMP scaler when config.train.amp != none on GPU, and the data-parallel
        wrapper when world size > 1. num_classes includes the CTC blank for OCR."""

    @abc.abstractmethod
    def train_step(self, batch: dict[str, Any]) -> Any:
        """Forward, loss, backward, clip, optimizer and LR-schedule step. Returns the loss as a
        framework scalar without synchronizing the device."""

    @abc.abstractmethod
    def to_float(self, loss: Any) -> float:
        """Loss value as a Python float (synchronizes)."""

    @abc.abstractmethod
    def current_lr(self) -> float: ...

    @abc.abstractmethod
    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        """Evaluation forward without gradients. OCR: int64 [N, T] argmax class per time step
        (0 = blank). ResNet: int64 [N, 5] top-5 class ids, best first."""

    @abc.abstractmethod
    def batch_labels(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """The batch's label fields as numpy arrays ("label", and "length" for OCR)."""

    @abc.abstractmethod
    def num_parameters(self) -> int: ...

    # --- checkpoints -------------------------------------------------------------------------
    @abc.abstractmethod
    def save_state(self, directory: Path) -> None:
        """Write model, optimizer, LR schedule, AMP scaler and framework RNG state as files in
        ``directory`` (which exists and is empty). Only formats that load without unpickling
        arbitrary objects: torch.save read back with weights_only=True; numpy .npz read with
        allow_pickle=False plus JSON for Paddle."""

    @abc.abstractmethod
    def load_state(self, directory: Path) -> None:
        """Restore everything save_state wrote (after build())."""

    # --- distributed and telemetry -----------------------------------------------------------
    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64 array over ranks (identity when world size is 1)."""
        return values

    def barrier(self) -> None:  # noqa: B027  (single-process default: nothing to wait for)
        return None

    def synchronize(self) -> None:  # noqa: B027  (CPU default: nothing queued)
        """Wait for queued device work (for honest timings at log points)."""

    def profile_range(self, name: str) -> contextlib.AbstractContextManager:
        """A profiler marker (NVTX for torch, paddle.profiler.RecordEvent) when
        config.train.profile is true, otherwise a no-op."""
        return contextlib.nullcontext()

    def shutdown(self) -> None:  # noqa: B027  (single-process default)
        """Leave the process group."""


def make_backend(config) -> Backend:
    """Import only the framework the config asks for."""
    if config.framework == "torch":
        from train.backends.torch.backend import TorchBackend

        return TorchBackend(config)
    from train.backends.paddle.backend import PaddleBackend

    return PaddleBackend(config)
