"""paddle.io.DataLoader over the framework-free datasets.

Batches stay uint8 numpy through worker IPC; with ``use_shared_memory`` Paddle moves them
through /dev/shm (4x fewer bytes than float32), and the training step normalizes on the device.
Paddle's loader always uses the process-wide multiprocessing start method, so a spawn context is
selected with ``multiprocessing.set_start_method`` before the loader is built. What works around
Paddle 2.6 here (zlib, the epoch-start poll, leaked pipes, the timeout) is in compat.py.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import cv2
import paddle

from datasets.sampler import EpochBatchSampler, EpochSampler
from train.backends.common import LoaderKnobs, stack_samples
from train.backends.paddle.compat import (
    check_zlib_load_order,
    closing_pipes,
    with_deadline,
    zlib_preloaded_in_new_processes,
)


class PaddleDataset(paddle.io.Dataset):
    """paddle.io.Dataset face of a framework-free dataset (no copy, no extra state)."""

    def __init__(self, dataset) -> None:
        super().__init__()
        self.dataset = dataset

    def __getitem__(self, item):
        return self.dataset[item]

    def __len__(self) -> int:
        return len(self.dataset)


def _worker_init(worker_id: int) -> None:
    start_worker = getattr(paddle.io.get_worker_info().dataset.dataset, "start_worker", None)
    if start_worker is not None:
        start_worker()  # before anything slow: see datasets.handles.die_with_parent
    # A spawned worker imports paddle (to unpickle its loop) before this module: check again
    # (a forkserver started before the first loader did not get the LD_PRELOAD fix).
    check_zlib_load_order()
    cv2.setNumThreads(1)  # one process per core already; OpenCV's pool would oversubscribe


def _start_method() -> str:
    """The start method Paddle's workers will use, without fixing the default as a side effect."""
    method = multiprocessing.get_start_method(allow_none=True)
    return method or multiprocessing.get_all_start_methods()[0]  # the first is the default


class PaddleLoader:
    """A paddle.io.DataLoader plus what Paddle lacks (compat.py): the zlib load-order checks,
    closed pipes after each epoch, and a real per-batch timeout (``timeout_s``)."""

    def __init__(self, loader: paddle.io.DataLoader, timeout_s: float) -> None:
        self.loader = loader
        self.timeout_s = timeout_s

    @property
    def batch_sampler(self) -> EpochBatchSampler:
        return self.loader.batch_sampler

    @property
    def sampler(self) -> EpochSampler:
        return self.loader.batch_sampler.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        check_zlib_load_order()  # fork workers inherit this process's bindings
        # In this thread: Paddle starts its workers here (once, with persistent workers).
        if self.loader.num_workers and _start_method() != "fork":
            with zlib_preloaded_in_new_processes():
                batches = iter(self.loader)
        else:
            batches = iter(self.loader)
        if self.loader.num_workers and not self.loader._persistent_workers:
            batches = closing_pipes(batches)
        if self.loader.num_workers == 0 or self.timeout_s <= 0:
            return batches
        return with_deadline(batches, self.timeout_s)


def make_loader(
    dataset, sampler: EpochSampler, knobs: LoaderKnobs, *, use_shared_memory=True, places=None
) -> PaddleLoader:
    """A paddle.io.DataLoader with every knob of ``knobs``, batching ``sampler`` by an
    EpochBatchSampler; ``places`` is the training device: on a GPU, Paddle's buffered reader
    copies each batch there from pinned memory on its own stream, ahead of use."""
    check_zlib_load_order()
    workers = knobs.num_workers > 0
    context = knobs.multiprocessing_context
    if workers and context and _start_method() != context:
        multiprocessing.set_start_method(context, force=True)
    loader = paddle.io.DataLoader(
        PaddleDataset(dataset),
        places=places,
        batch_sampler=EpochBatchSampler(sampler, knobs.batch_size, knobs.drop_last),
        num_workers=knobs.num_workers,
        collate_fn=stack_samples,
        use_buffer_reader=True,
        use_shared_memory=use_shared_memory,
        prefetch_factor=knobs.prefetch_factor or 2,
        # Not loader.timeout_s: in Paddle this is the dead-worker poll interval (0 = 5 s).
        timeout=0,
        worker_init_fn=_worker_init if workers else None,
        persistent_workers=knobs.persistent_workers and workers,
        return_list=True,
    )
    return PaddleLoader(loader, knobs.timeout_s)
