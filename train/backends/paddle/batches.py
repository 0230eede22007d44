"""The Paddle backend's Batches (train/backends/base.py): its loader (train/backends/paddle/
data.py) over the datasets, and each batch on the device, normalized there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle

from train.backends import common
from train.backends.paddle import data as paddle_data


class PaddleBatches(common.BatchesBase):
    """Loaders that deliver to the training device themselves (places=its GPU), and their
    batches normalized on the device's compute stream."""

    def set_cpu_threads(self, num_workers: int) -> None:
        # Nothing to share: CPU threads stay at Paddle's FLAGS_paddle_num_threads (default 1;
        # set the environment variable to raise it). More threads than free cores make Paddle's
        # OpenMP kernels spin: 2 threads on a busy 2-core host ran a crnn_tiny step 3-5x slower
        # than 1 thread.
        return None

    def make_loader(self, dataset, sampler, loader_config, train: bool) -> Any:
        return paddle_data.make_loader(
            dataset,
            sampler,
            common.LoaderKnobs.of(loader_config, train),
            use_shared_memory=loader_config.use_shared_memory,
            batch_ring=loader_config.batch_ring,
            places=self.runtime.place,
        )

    def device_batches(self, loader) -> Iterator[dict[str, Any]]:
        # On a GPU the loader was built with places=this GPU: its batches arrive there, each
        # staged in pinned memory and copied on a side CUDA stream one batch ahead of use, so
        # the copy of batch k+1 overlaps step k (through the batch ring: data.PinnedCopies;
        # without it: Paddle's buffered reader). What is left is to normalize, which runs on
        # the device's compute stream.
        for batch in loader:
            yield self._on_device(batch)

    def to_numpy(self, tensor: paddle.Tensor) -> np.ndarray:
        return tensor.numpy()

    def _on_device(self, batch: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        batch = dict(batch)
        gpu_id = self.runtime.gpu_id
        if gpu_id is not None:  # a no-op for loader batches, which are there already
            for key, value in batch.items():
                place = value.place
                if not (place.is_gpu_place() and place.gpu_device_id() == gpu_id):
                    batch[key] = value.cuda(gpu_id, blocking=False)
        batch["image"] = self._normalize(batch["image"])
        return batch

    def _normalize(self, images: paddle.Tensor) -> paddle.Tensor:
        """uint8 [N,H,W,C] -> float32 [N,C,H,W] on the device, normalized with the pixel
        contract's per-channel scale and shift (train/tasks.py) in one multiply-add."""
        # Transpose the uint8 batch: a quarter of the bytes of the float32 one.
        images = images.transpose([0, 3, 1, 2]).astype("float32")
        if self._stats is None:  # device constants, made once (not a host copy per batch)
            self._stats = tuple(
                paddle.to_tensor(a) for a in self.task.pixel_scale_shift(self.model_spec)
            )
        scale, shift = self._stats
        return images * scale + shift
