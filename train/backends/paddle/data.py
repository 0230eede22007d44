"""paddle.io.DataLoader over the framework-free datasets.

Batches stay uint8 numpy through worker IPC (4x fewer bytes than float32), and the training step
normalizes on the device. With ``use_shared_memory`` and ``batch_ring`` (the defaults) workers
stack each batch straight into a slot of a /dev/shm ring this process owns
(datasets/batch_ring.py) and send only its number through Paddle's queue: one copy per batch,
where Paddle's own shared-memory hand-over (``batch_ring`` off) makes two in the worker.
Batches from the ring reach the training device one batch ahead of use (:class:`PinnedCopies`
on a GPU, :class:`HostCopies` on the CPU); without the ring, Paddle's buffered reader copies
them. At 0 workers the dataset fills each batch in one call (datasets.sampler.WholeBatches).
Paddle's loader always uses the process-wide multiprocessing start method, so a spawn context is
selected with ``multiprocessing.set_start_method`` before the loader is built. What works around
Paddle 2.6 here (zlib, the epoch-start poll, leaked pipes, the timeout) is in compat.py.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import cv2
import numpy as np
import paddle

from datasets.batch_buffers import BatchBuffers
from datasets.batch_ring import BatchRing, RingBatches, RingCollate, ticket_of
from datasets.handles import start_loader_worker, stop_signals_held
from datasets.sampler import EpochBatchSampler, EpochSampler, WholeBatches
from train.backends.common import LoaderKnobs, TicketPassingDataset, ring_slots, stack_samples
from train.backends.paddle.compat import (
    check_zlib_load_order,
    closing_pipes,
    release_stuck_iterator,
    with_deadline,
    zlib_preloaded_in_new_processes,
)
from train.device_wait import waiting_for_device


class PaddleDataset(TicketPassingDataset, paddle.io.Dataset):
    """paddle.io.Dataset face of a framework-free dataset (no copy, no extra state), the
    ring's tickets passed through."""


def _as_tensor(array):
    """A CPU paddle Tensor over ``array``'s own memory, which it keeps alive (a reference).
    paddle.to_tensor and Paddle's loader (numpy -> LoDTensor.set) copy a 2.9 MB uint8 OCR batch
    in about 2.4 ms, 25 times numpy's memcpy: at 0 workers, 37 us a sample, a fifth of its
    decode. Only for arrays nobody writes to afterwards (a freshly stacked batch)."""
    return paddle.base.core.eager.Tensor(value=array, place=paddle.CPUPlace(), zero_copy=True)


def stack_to_tensors(samples: list[dict]) -> dict:
    """collate_fn at 0 workers: stack_samples, then each field a Tensor over the stacked array
    (Paddle's single-process loader passes Tensors through as they are, no copy)."""
    return {key: _as_tensor(value) for key, value in stack_samples(samples).items()}


def whole_batch_to_tensors(batches: list[dict]) -> dict:
    """collate_fn at 0 workers over WholeBatches: the fetch returned ``[batch]``, whose samples
    the dataset already wrote into one array per field (RecordDataset.get_batch)."""
    (batch,) = batches
    return {key: _as_tensor(value) for key, value in batch.items()}


def _worker_init(worker_id: int) -> None:
    # before anything slow: see datasets.handles.die_with_parent
    start_loader_worker(paddle.io.get_worker_info().dataset.dataset)
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

    def __init__(
        self,
        loader: paddle.io.DataLoader,
        timeout_s: float,
        ring: BatchRing | None = None,
        place: Any = None,
    ) -> None:
        self.loader = loader
        self.timeout_s = timeout_s
        self.ring = ring
        self.place = place or paddle.CPUPlace()
        if ring is not None:  # the files go with the loader, or at exit at the latest
            self._unlink_ring = weakref.finalize(self, ring.unlink)
            on_gpu = isinstance(self.place, paddle.CUDAPlace)
            # What the ring's slots are copied into, and from there onto the device.
            self.copies = PinnedCopies(self.place) if on_gpu else HostCopies()

    @property
    def copies_per_batch(self) -> int:
        """Copies of a collated batch's bytes on their way to the trainer's tensor: the ring
        slot, copied once into the tensor (on a GPU into pinned memory, which the device then
        reads by DMA); Paddle's own shared memory: into a LoDTensor, then
        into a new /dev/shm file (worker.py, _reduce_lodtensor); pipes: pickled into the pipe
        and unpickled (2), then made a tensor (1); no workers: none (the collated arrays become
        Tensors as they are: whole_batch_to_tensors, stack_to_tensors)."""
        if not self.loader.num_workers:
            return 0
        if self.ring is not None:
            return 1
        return 2 if self.loader.use_shared_memory else 3

    @property
    def batch_sampler(self) -> EpochBatchSampler:
        batches = self.loader.batch_sampler
        return batches.batches if isinstance(batches, (RingBatches, WholeBatches)) else batches

    @property
    def sampler(self) -> EpochSampler:
        return self.loader.batch_sampler.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._epoch()

    def _batches(self) -> Iterator:
        check_zlib_load_order()  # fork workers inherit this process's bindings
        # In this thread: Paddle starts its workers here (once, with persistent workers), with
        # the stop signals held until they have left this process group (datasets.handles).
        with stop_signals_held():
            if self.loader.num_workers and _start_method() != "fork":
                with zlib_preloaded_in_new_processes():
                    iterator = iter(self.loader)
            else:
                iterator = iter(self.loader)
        batches = iterator
        if self.loader.num_workers and not self.loader._persistent_workers:
            batches = closing_pipes(batches)
        if self.loader.num_workers and self.timeout_s > 0:
            release = functools.partial(release_stuck_iterator, iterator)
            batches = with_deadline(batches, self.timeout_s, release)
        return batches

    def _epoch(self) -> Iterator:
        if self.ring is None:
            return self._batches()
        # Before Paddle's iterator starts: a persistent worker still waiting for a slot with a
        # batch of the last (abandoned) epoch drops it, so Paddle's reset can drain it.
        self.ring.start_generation()
        return self._from_ring(self._batches())

    def _from_ring(self, tickets: Iterator) -> Iterator[dict[str, Any]]:
        """The epoch's batches, one ahead: batch k+1 is copied out of its slot (which is then
        released) and its copy to the device started before batch k is handed over, so on a
        GPU that copy runs while the trainer's step on batch k does."""
        copies, upcoming = self.copies, None
        try:
            for ticket in tickets:
                staged = copies.stage(self.ring.take(*ticket_of(ticket)))
                self.ring.release()  # copied out: the slot is free for the batch seq + slots
                started = copies.start(staged)
                if upcoming is not None:
                    yield copies.ready(upcoming)
                upcoming = started
            if upcoming is not None:  # the epoch's last batch
                batch, upcoming = copies.ready(upcoming), None
                yield batch
        finally:
            upcoming = None  # an abandoned epoch's batch in hand goes with it
            self.ring.end_generation()  # first: workers waiting for a slot let go
            close = getattr(tickets, "close", None)
            if close is not None:
                close()  # the epoch's workers stop (unless persistent)
            if not self.loader._persistent_workers:
                self.ring.shrink()


class HostCopies:
    """On the CPU: a ring slot's fields copied into arrays of earlier batches that nothing
    refers to any more (datasets/batch_buffers.py: a fresh array would page-fault on every
    page), each a Tensor over its array (_as_tensor). Already where the step reads them, so
    starting and finishing the copy to the device are nothing."""

    def __init__(self) -> None:
        self.buffers = BatchBuffers()

    def stage(self, views: dict[str, np.ndarray]) -> dict[str, paddle.Tensor]:
        batch = {}
        for key, view in views.items():
            out = self.buffers.empty(view.shape, view.dtype)
            out[...] = view
            batch[key] = _as_tensor(out)
        return batch

    def start(self, staged: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        return staged

    def ready(self, started: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        return started


class PinnedCopies:
    """On a GPU: a ring slot's fields copied into page-locked host buffers that are used again
    and again (two sets, batch k into set k % 2), then copied to the device without blocking
    the host on a side CUDA stream, while the compute stream runs the step on the batch before.

    - Before the compute stream reads a batch, it waits for that batch's copy (an event).
    - Before the side stream copies, it waits for the work already queued on the compute
      stream: device memory that earlier steps freed may be handed to this copy, and Paddle's
      allocator frees it when Python drops the tensor, not when the step has run.
    - A set of host buffers is written again (two batches later) only after its last copy to
      the device has finished (its event).

    Paddle's current CUDA stream belongs to the device, not to a thread: a stream guard in
    one thread moves every thread's kernels to the side stream. So the side stream is used
    from the main thread only (training); from another thread (the evaluation batches of
    train/stops.py's StopAwareBatches) the copy goes on the compute stream, still from pinned
    memory and without blocking the host, but in line with the kernels."""

    SETS = 2

    def __init__(self, place: paddle.CUDAPlace) -> None:
        self.place = place
        self._sets: list[dict[str, tuple[paddle.Tensor, np.ndarray]]] = [
            {} for _ in range(self.SETS)
        ]
        self._copied: list[Any] = [None] * self.SETS  # each set's last copy: its event
        self._next = 0
        self._side_stream = None  # made at the first copy (the device is set by then)

    def stage(self, views: dict[str, np.ndarray]) -> tuple[int, dict[str, paddle.Tensor]]:
        index, self._next = self._next, (self._next + 1) % self.SETS
        if self._copied[index] is not None:
            # The device's back-pressure (its copy queued behind earlier steps' kernels), not
            # the loader's: telemetry counts it as device wait.
            with waiting_for_device():
                self._copied[index].synchronize()  # its last batch is on the device
            self._copied[index] = None
        buffers, staged = self._sets[index], {}
        for key, view in views.items():
            held = buffers.get(key)
            if held is None or held[1].shape != view.shape or held[1].dtype != view.dtype:
                held = buffers[key] = _pinned(view.shape, view.dtype)
            held[1][...] = view  # the one host copy: out of the slot
            staged[key] = held[0]
        return index, staged

    def start(self, staged: tuple[int, dict[str, paddle.Tensor]]) -> tuple[dict, Any]:
        index, tensors = staged
        compute = paddle.device.current_stream(self.place)
        stream = compute
        if threading.current_thread() is threading.main_thread():
            if self._side_stream is None:
                self._side_stream = paddle.device.Stream(self.place)
            stream = self._side_stream
            stream.wait_stream(compute)
        gpu = self.place.get_device_id()
        with paddle.device.stream_guard(stream if stream is not compute else None):
            batch = {key: value.cuda(gpu, blocking=False) for key, value in tensors.items()}
        self._copied[index] = copied = stream.record_event()
        return batch, copied

    def ready(self, started: tuple[dict, Any]) -> dict[str, paddle.Tensor]:
        batch, copied = started
        paddle.device.current_stream(self.place).wait_event(copied)
        return batch


def _pinned(shape: tuple[int, ...], dtype: np.dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """A page-locked host Tensor of ``shape`` and ``dtype``, and a numpy array over its memory
    (which the Tensor owns: keep both)."""
    tensor = paddle.to_tensor(np.empty(shape, dtype), place=paddle.CUDAPinnedPlace())
    count = int(np.prod(shape))
    memory = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(tensor.data_ptr())
    return tensor, np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


def make_loader(
    dataset,
    sampler: EpochSampler,
    knobs: LoaderKnobs,
    *,
    use_shared_memory=True,
    batch_ring=True,
    places=None,
) -> PaddleLoader:
    """A paddle.io.DataLoader with every knob of ``knobs``, batching ``sampler`` by an
    EpochBatchSampler; ``places`` is the training device, where the batches arrive. With
    workers, ``use_shared_memory`` and ``batch_ring``, batches come through a BatchRing of
    ring_slots(knobs) slots, and PaddleLoader copies them to a GPU one batch ahead of use
    (PinnedCopies); otherwise Paddle's buffered reader does, from pinned memory on its own
    stream."""
    check_zlib_load_order()
    workers = knobs.num_workers > 0
    context = knobs.multiprocessing_context
    if workers and context and _start_method() != context:
        multiprocessing.set_start_method(context, force=True)
    batches = EpochBatchSampler(sampler, knobs.batch_size, knobs.drop_last)
    # With workers, batches cross a process boundary as numpy (the ring, or Paddle's queue).
    collate = stack_samples if workers else stack_to_tensors
    if not workers and hasattr(dataset, "get_batch"):
        # One dataset call per batch, its samples written into the batch's arrays: at 0 workers
        # the fetch is the training process's own time, and this saves a tenth of it on OCR.
        batches, collate = WholeBatches(batches), whole_batch_to_tensors
    ring = None
    place = places[0] if isinstance(places, (list, tuple)) else places
    if workers and use_shared_memory and batch_ring:
        ring = BatchRing.create(ring_slots(knobs))
        batches, collate = RingBatches(batches, ring), RingCollate(ring)
        use_shared_memory = False  # Paddle's queue carries 3 numbers per batch: a pipe will do
        # The tickets stay on the host (reading one on a GPU would sync each batch); the
        # batches go to ``place`` from the ring (PaddleLoader._from_ring).
        places = paddle.CPUPlace()
    # The buffered reader's thread is there to copy batches to the device ahead of use. At 0
    # workers on the CPU it has nothing to copy: the fetch thread (Paddle's _thread_loop) still
    # decodes ahead of the training step into its queue, and the extra hand-off cost 0.013-0.025
    # ms of CPU per OCR sample (of 0.21-0.29). With workers it stays as it was.
    on_cpu = place is None or isinstance(place, paddle.CPUPlace)
    loader = paddle.io.DataLoader(
        PaddleDataset(dataset),
        places=places,
        batch_sampler=batches,
        num_workers=knobs.num_workers,
        collate_fn=collate,
        use_buffer_reader=workers or not on_cpu,
        use_shared_memory=use_shared_memory,
        prefetch_factor=knobs.prefetch_factor,
        # Not loader.timeout_s: in Paddle this is the dead-worker poll interval (0 = 5 s).
        timeout=0,
        worker_init_fn=_worker_init if workers else None,
        persistent_workers=knobs.persistent_workers and workers,
        return_list=True,
    )
    return PaddleLoader(loader, knobs.timeout_s, ring, place)
