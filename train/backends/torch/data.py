"""torch.utils.data.DataLoader over the framework-free datasets.

Batches stay uint8 through worker IPC (4x fewer bytes in /dev/shm than float32) and are
normalized on the device by the backend (TorchBatches.device_batches). Each worker runs
single-threaded: the loader already gives one process per core, and OpenCV/torch thread pools
inside workers only fight.

With workers, batches come through a BatchRing (datasets/batch_ring.py, ``loader.batch_ring``):
torch's own hand-over moves each stacked batch into a new /dev/shm file, one page fault per
4 KB page (about 1,190 per ResNet-50 batch of 32); through the ring a worker stacks its samples
into a slot that stays mapped and the trainer copies the slot out (RingLoader).
"""

from __future__ import annotations

import multiprocessing
import weakref
from collections.abc import Iterator

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader

from datasets.batch_buffers import BatchBuffers
from datasets.batch_ring import BatchRing, RingBatches, RingCollate, ticket_of
from datasets.handles import start_loader_worker, stop_signals_held
from datasets.sampler import EpochBatchSampler, EpochSampler, WholeBatches
from train.backends.common import LoaderKnobs, TicketPassingDataset, ring_slots, stack_samples


def collate_uint8(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack each field into one contiguous array; torch.from_numpy shares its memory."""
    return {key: torch.from_numpy(value) for key, value in stack_samples(samples).items()}


def whole_batch_uint8(batches: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """collate_fn over WholeBatches: the fetch returned ``[batch]``, already one array per
    field (RecordDataset.get_batch); torch.from_numpy shares its memory."""
    (batch,) = batches
    return {key: torch.from_numpy(value) for key, value in batch.items()}


class _RingDataset(TicketPassingDataset, torch.utils.data.Dataset):
    """The dataset as torch's loader sees it, the ring's tickets passed through."""


def _worker_init(worker_id: int) -> None:
    dataset = torch.utils.data.get_worker_info().dataset
    dataset = dataset.dataset if isinstance(dataset, _RingDataset) else dataset
    start_loader_worker(dataset)  # before anything slow: see datasets.handles.die_with_parent
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

    _epoch_batches = None  # the torch iterator of the last epoch started (stop_epoch_workers)

    def __iter__(self):
        with stop_signals_held():  # workers start here: see datasets.handles
            batches = super().__iter__()
        if self.num_workers == 0 or self.persistent_workers:
            return batches
        self._epoch_batches = weakref.ref(batches)
        return _stop_workers_on_interrupt(batches)

    def stop_epoch_workers(self) -> None:
        """Stop the workers of the epoch started last, from any thread, as its iterator's own
        shutdown does (torch's _shutdown_workers: a message to each, a join of 5 s at most,
        then SIGTERM). For a stop whose evaluation was interrupted while a helper thread waited
        in the epoch's next() (train/stops.py, StopAwareBatches): that thread cannot close the
        epoch's generator from outside, and if it never returns (a spawned worker that died as
        it unpickled its start-up, with the batch it owed never coming), the workers that are
        left wait for work forever and Python's exit waits on them (multiprocessing joins its
        children at exit; their exit-time SIGTERM can arrive while they still hold the stop
        signals, datasets.handles). Persistent workers belong to the loader: left alone."""
        batches = self._epoch_batches() if self._epoch_batches is not None else None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


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


class RingLoader:
    """An _EpochLoader whose workers hand batches over through a BatchRing: a worker stacks its
    samples straight into the batch's slot (RingCollate) and the loader sends the trainer only
    the slot's number; the trainer copies the slot out (the hand-over's one copy) and frees it.

    Torch's own hand-over moves each stacked batch into a new /dev/shm file, into pages mapped
    for that batch alone: a page fault per 4 KB (about 1,190 per ResNet-50 batch of 32, 3.3 us
    each on the benchmark host) on top of the copy. The slots stay mapped, and the trainer copies
    into pinned memory (for the GPU) or into the arrays of earlier batches that nothing refers to
    any more (datasets/batch_buffers.py), so no page is faulted in per batch. ResNet-50 on 2
    cores: 8-15% less CPU per sample, 8-20% more samples/s at 2 workers, about the same at 1
    (docs/benchmarks.md, python -m bench.torch_ring). /dev/shm holds the ring's slots, exactly
    the batches in flight that train.preflight counts."""

    def __init__(self, loader: DataLoader, ring: BatchRing, pin_memory: bool) -> None:
        self.loader = loader
        self.ring = ring
        self.pin_memory = pin_memory
        self._unlink_ring = weakref.finalize(self, ring.unlink)  # at exit at the latest
        self._host_buffers = BatchBuffers()

    copies_per_batch = 1  # the slot into the trainer's tensor (bench/handover.py)

    def stop_epoch_workers(self) -> None:
        """_EpochLoader.stop_epoch_workers of the DataLoader the ring's tickets come from."""
        self.loader.stop_epoch_workers()

    @property
    def num_workers(self) -> int:
        return self.loader.num_workers

    @property
    def persistent_workers(self) -> bool:
        return self.loader.persistent_workers

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Before the loader's iterator starts (it asks RingBatches for batches at once): a
        # persistent worker still waiting for a slot with a batch of the last, abandoned epoch
        # drops it, and the new epoch's batches are numbered from 0.
        self.ring.start_generation()
        return self._from_ring(iter(self.loader))

    def _copied(self, view: np.ndarray) -> torch.Tensor:
        if self.pin_memory:  # what the DataLoader's pin thread would do, straight from the slot
            source = torch.from_numpy(view)
            return torch.empty(source.shape, dtype=source.dtype, pin_memory=True).copy_(source)
        out = self._host_buffers.empty(view.shape, view.dtype)
        out[...] = view
        return torch.from_numpy(out)

    def _from_ring(self, tickets: Iterator) -> Iterator[dict[str, torch.Tensor]]:
        try:
            for ticket in tickets:
                views = self.ring.take(*ticket_of(ticket))
                batch = {key: self._copied(view) for key, view in views.items()}
                self.ring.release()  # copied: the slot is free for batch seq + slots
                yield batch
        finally:
            self.ring.end_generation()  # first: workers waiting for a slot let go
            close = getattr(tickets, "close", None)
            if close is not None:
                close()  # the epoch's workers stop (_stop_workers_on_interrupt), unless persistent
            if not self.loader.persistent_workers:
                self.ring.shrink()  # the slots' pages go back to /dev/shm between epochs


def _preload_in_fork_server(dataset) -> None:
    """Have multiprocessing's fork server import torch, OpenCV and the dataset's modules.

    A forkserver worker is forked from the fork server, a clean process multiprocessing starts
    at first use; with nothing preloaded each worker imports torch, OpenCV and the dataset's
    modules itself, about 2 CPU-s a worker, and again at every epoch's start without
    persistent_workers. Imported once in the server, they are in every worker it forks. The
    imports start no threads there (torch's and OpenCV's pools start at first use; each worker
    sets them to one thread), which is what forking from the server keeps safe. The server
    reads the list when it starts: a call after that changes nothing for the running one.
    "__main__" is multiprocessing's own default (the script's main module, when it has a path).
    """
    multiprocessing.set_forkserver_preload(["__main__", __name__, type(dataset).__module__])


def make_loader(
    dataset,
    sampler: EpochSampler,
    knobs: LoaderKnobs,
    *,
    pin_memory: bool = False,
    seed: int = 0,
    batch_ring: bool = True,
) -> DataLoader | RingLoader:
    """A DataLoader with uint8 collation and every knob of ``knobs``; worker-only knobs are
    dropped when there are no workers (DataLoader rejects them there). pin_memory is the
    caller's decision (only useful with a GPU). At 0 workers a dataset with ``get_batch`` is
    fetched a whole batch per call (datasets.sampler.WholeBatches): its samples are written
    into the batch's arrays, with nothing left to stack. With workers and ``batch_ring``,
    batches come through a BatchRing of ring_slots(knobs) slots (RingLoader)."""
    workers = knobs.num_workers > 0
    pin_memory = pin_memory and torch.cuda.is_available()
    if workers and knobs.multiprocessing_context == "forkserver":
        _preload_in_fork_server(dataset)
    ring = None
    if workers and batch_ring:
        ring = BatchRing.create(ring_slots(knobs))
        batches = RingBatches(EpochBatchSampler(sampler, knobs.batch_size, knobs.drop_last), ring)
        dataset = _RingDataset(dataset)
        batching = {"batch_sampler": batches, "collate_fn": RingCollate(ring)}
    elif workers or not hasattr(dataset, "get_batch"):
        batching = {
            "batch_size": knobs.batch_size,
            "sampler": sampler,
            "drop_last": knobs.drop_last,
            "collate_fn": collate_uint8,
        }
    else:
        batches = EpochBatchSampler(sampler, knobs.batch_size, knobs.drop_last)
        batching = {"batch_sampler": WholeBatches(batches), "collate_fn": whole_batch_uint8}
    loader = _EpochLoader(
        dataset,
        num_workers=knobs.num_workers,
        # Through the ring the loader carries only slot numbers: RingLoader pins the batch.
        pin_memory=pin_memory and ring is None,
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
    return loader if ring is None else RingLoader(loader, ring, pin_memory)
