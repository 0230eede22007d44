"""The torch backend's Batches (train/backends/base.py): its DataLoader (train/backends/torch/
data.py) over the datasets, and each batch copied to the device and normalized there."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from train.backends import common
from train.backends.torch.data import make_loader
from train.backends.torch.models import memory_format
from train.cpus import usable_cores

log = logging.getLogger(__name__)


class TorchBatches(common.BatchesBase):
    """Loaders with pinned memory on CUDA, and their batches on the device: on CUDA copied and
    normalized on a side stream one batch ahead of the step (loader.device_prefetch), in the
    memory format of the built model's weights."""

    def __init__(self, task, runtime) -> None:
        super().__init__(task, runtime)
        self._layout = torch.contiguous_format  # the batches' (and weights') memory format

    def normalize_for(self, model_spec) -> None:
        super().normalize_for(model_spec)
        # The layout Trainer.build gives the weights (models.memory_format: channels_last only
        # for the families that use it on CUDA).
        self._layout = memory_format(self.runtime.device.type, model_spec.family)

    def set_cpu_threads(self, num_workers: int) -> None:
        # Training on the CPU, the main process's intra-op pool and the loader workers share
        # the cores: torch's default (one thread per core) would oversubscribe them, and workers
        # starved of CPU make every step wait for data. So give this rank its share of the
        # cores minus one per worker, and never fewer than one thread.
        if self.runtime.device.type != "cpu":
            return
        cores = max(1, usable_cores() // max(1, self.runtime.dist.local_world_size))
        threads = max(1, cores - num_workers)
        torch.set_num_threads(threads)
        log.info("torch threads: %d (%d cores - %d loader workers)", threads, cores, num_workers)

    def make_loader(self, dataset, sampler, loader_config, train: bool) -> Any:
        loader = make_loader(
            dataset,
            sampler,
            common.LoaderKnobs.of(loader_config, train),
            pin_memory=loader_config.pin_memory and self.runtime.device.type == "cuda",
            seed=self.runtime.seed,
            batch_ring=loader_config.batch_ring,
        )
        loader.device_prefetch = loader_config.device_prefetch  # read by device_batches
        return loader

    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        if self.runtime.device.type == "cuda" and getattr(loader, "device_prefetch", True):
            return self._cuda_prefetch(loader)
        return (self._to_device(batch) for batch in loader)

    def to_numpy(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.cpu().numpy()

    def _to_device(self, host_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy (asynchronously when the host memory is pinned) and normalize on the device."""
        device = self.runtime.device
        batch = {key: value.to(device, non_blocking=True) for key, value in host_batch.items()}
        batch["image"] = self._normalize(batch["image"])
        return batch

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N,H,W,C] -> float32 [N,C,H,W] on the device, normalized with the pixel
        contract's per-channel scale and shift (train/tasks.py) in one multiply-add, in the
        memory format of the model's weights."""
        # permute() is a view: NHWC memory seen as NCHW is exactly the channels_last layout,
        # so for channels_last models no copy happens.
        images = images.permute(0, 3, 1, 2).float()
        scale, shift = self._pixel_constants()
        images = images.mul_(scale).add_(shift)
        return images.contiguous(memory_format=self._layout)

    def _pixel_constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and shift as [1, C, 1, 1] device tensors, made once (not a host copy per
        batch)."""
        if self._stats is None:
            scale, shift = self.task.pixel_scale_shift(self.model_spec)
            self._stats = (
                torch.from_numpy(scale).to(self.runtime.device),
                torch.from_numpy(shift).to(self.runtime.device),
            )
        return self._stats

    def _cuda_prefetch(self, loader) -> Iterator[dict[str, torch.Tensor]]:
        """Yield each batch while the next one is copied and normalized on a side stream."""
        device = self.runtime.device
        self._pixel_constants()  # made on the compute stream, before the side stream reads it
        side_stream = torch.cuda.Stream(device=device)
        # Work already queued on the compute stream (such as those constants) comes first.
        side_stream.wait_stream(torch.cuda.current_stream(device))
        host_batches = iter(loader)

        def preload() -> dict[str, torch.Tensor] | None:
            host_batch = next(host_batches, None)
            if host_batch is None:
                return None
            with torch.cuda.stream(side_stream):
                return self._to_device(host_batch)

        upcoming = preload()
        while upcoming is not None:
            batch = upcoming
            compute_stream = torch.cuda.current_stream(device)
            # The step must not read the batch before its copy and normalization finished...
            compute_stream.wait_stream(side_stream)
            # ...and the allocator must not hand its memory (allocated on the side stream) to
            # another tensor until the compute stream is done with it.
            for tensor in batch.values():
                tensor.record_stream(compute_stream)
            upcoming = preload()  # queue the next copy before the step runs on this batch
            yield batch
