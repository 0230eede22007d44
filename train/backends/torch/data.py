"""torch.utils.data.DataLoader over the framework-free datasets.

Batches stay uint8 through worker IPC (4x fewer bytes in /dev/shm than float32) and are
normalized on the device by the backend (TorchBackend.device_batches). Each worker runs
single-threaded: the loader already gives one process per core, and OpenCV/torch thread pools
inside workers only fight.
"""

from __future__ import annotations

from collections.abc import Iterator

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader

from datasets.handles import stop_signals_held
from datasets.sampler import EpochBatchSampler, EpochSampler, WholeBatches
from train.backends.common import LoaderKnobs, stack_samples


def collate_uint8(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack each field into one contiguous array; torch.from_numpy shares its memory."""
    return {key: torch.from_numpy(value) for key, value in stack_samples(samples).items()}


def whole_batch_uint8(batches: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """collate_fn over WholeBatches: the fetch returned ``[batch]``, already one array per
    field (RecordDataset.get_batch); torch.from_numpy shares its memory."""
    (batch,) = batches
    return {key: torch.from_numpy(value) for key, value in batch.items()}


def _worker_init(worker_id: int) -> None:
    start_worker = getattr(torch.utils.data.get_worker_info().dataset, "start_worker", None)
    if start_worker is not None:
        start_worker()  # before anything slow: see datasets.handles.die_with_parent
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


class _EpochLoader(DataLoader):
    """A DataLoader whose epoch stops its workers when an interrupt (KeyboardInterrupt) leaves
    ``next()``. Torch stops them when its iterator is collected, but the interrupt's traceback
    holds the iterator's frames, and IPython keeps the last traceback (sys.last_traceback and
    its own, for %debug): a notebook cell interrupted while it waited for a batch kept the
    workers, their open files and their shared memory after ``del it`` until the next error or
    a kernel restart. Closing the epoch's batches (an interrupted evaluation) stops them too.
    Other errors leave the workers as they are, for train.__main__'s report of what each was
    reading. Persistent workers belong to the loader and are left alone."""

    def __iter__(self):
        with stop_signals_held():  # workers start here: see datasets.handles
            batches = super().__iter__()
        if self.num_workers == 0 or self.persistent_workers:
            return batches
        return _stop_workers_on_interrupt(batches)


def _stop_workers_on_interrupt(batches) -> Iterator:
    try:
        yield from batches
    except (KeyboardInterrupt, GeneratorExit):
        # GeneratorExit: the epoch's batches were closed (an interrupted evaluation, after the
        # stop's checkpoint): stop the workers by message now. Left to the iterator's collection,
        # they outlived it whenever a traceback held the iterator, and Python's exit-time
        # SIGTERM to them can be lost (datasets.handles.stop_signals_held).
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        raise


def make_loader(
    dataset, sampler: EpochSampler, knobs: LoaderKnobs, *, pin_memory: bool = False, seed: int = 0
) -> DataLoader:
    """A DataLoader with uint8 collation and every knob of ``knobs``; worker-only knobs are
    dropped when there are no workers (DataLoader rejects them there). pin_memory is the
    caller's decision (only useful with a GPU). At 0 workers a dataset with ``get_batch`` is
    fetched a whole batch per call (datasets.sampler.WholeBatches): its samples are written
    into the batch's arrays, with nothing left to stack."""
    workers = knobs.num_workers > 0
    if workers or not hasattr(dataset, "get_batch"):
        batching = {
            "batch_size": knobs.batch_size,
            "sampler": sampler,
            "drop_last": knobs.drop_last,
            "collate_fn": collate_uint8,
        }
    else:
        batches = EpochBatchSampler(sampler, knobs.batch_size, knobs.drop_last)
        batching = {"batch_sampler": WholeBatches(batches), "collate_fn": whole_batch_uint8}
    return _EpochLoader(
        dataset,
        num_workers=knobs.num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        timeout=knobs.timeout_s if workers else 0,
        worker_init_fn=_worker_init if workers else None,
        multiprocessing_context=knobs.multiprocessing_context if workers else None,
        # Worker seeding: the loader draws each epoch's base seed from this generator, and every
        # worker seeds torch, random and numpy with base seed + worker id. So a run's worker seeds
        # follow config.seed. Augmentation does not depend on them anyway: the dataset seeds each
        # sample from (seed, epoch, index), which makes batches independent of the worker count.
        generator=torch.Generator().manual_seed(seed),
        prefetch_factor=knobs.prefetch_factor if workers else None,
        persistent_workers=knobs.persistent_workers and workers,
        **batching,
    )
