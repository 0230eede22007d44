"""How each arm hands a collated batch from a loader worker to the trainer: the copies of the
batch's bytes after the samples are stacked, and the time a worker spends stacking and handing
over one batch, measured on a real batch of the trial with the same calls the arm's worker makes.

Kinds (``Pipeline.handover``):
- ``ring``: our loaders, Paddle and torch (datasets/batch_ring.py): samples stacked straight
  into a slot that stays mapped; the trainer copies the slot into its tensor: 1 copy.
- ``paddle_shm``: Paddle's own hand-over (worker.py): stack, a LoDTensor (copy 1), pickled by
  the queue into a new /dev/shm file (copy 2), which the trainer maps: 2 copies.
- ``paddle_pipe``: use_shared_memory off: stack, pickled into the pipe and read back (2), made a
  tensor (3).
- ``torch_shm``: our torch loader with ``loader.batch_ring: false``: stack, torch.from_numpy (no
  copy), the queue moves the storage into a new /dev/shm file (copy 1, into freshly mapped
  pages), which the trainer maps: 1 copy.
- ``torch_shared_collate``: torch's default_collate in a worker stacks straight into a new
  /dev/shm file: 0 copies after the stack, but into freshly mapped pages.
Without workers nothing is handed over: a Paddle batch is made a tensor (1 copy), a torch batch
shares the numpy memory (0).
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np

COPIES = {"ring": 1, "paddle_shm": 2, "paddle_pipe": 3, "torch_shm": 1, "torch_shared_collate": 0}


def as_numpy(batch) -> dict[str, np.ndarray]:
    items = batch.items() if isinstance(batch, dict) else enumerate(batch)
    return {
        str(key): np.array(value.numpy() if hasattr(value, "numpy") else value)
        for key, value in items
    }


def _samples(batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    size = len(next(iter(batch.values())))
    return [{key: value[i] for key, value in batch.items()} for i in range(size)]


def _ring() -> Callable[[list[dict]], None]:
    from datasets.batch_ring import BatchRing, RingTicket

    ring = BatchRing.create(1)
    generation = ring.start_generation()
    state = {"seq": 0}

    def handover(samples: list[dict]) -> None:
        ring.write(RingTicket(generation, state["seq"]), samples)
        ring.release()
        state["seq"] += 1

    handover.close = ring.unlink
    return handover


def _paddle(shared: bool) -> Callable[[list[dict]], None]:
    import paddle
    from paddle.base import core
    from paddle.incubate.multiprocessing.reductions import init_reductions

    init_reductions()  # what Paddle's loader registers for its queue
    from multiprocessing.reduction import ForkingPickler

    def handover(samples: list[dict]) -> None:
        for key in samples[0]:
            array = np.stack([s[key] for s in samples])
            if shared:
                tensor = core.LoDTensor()
                tensor.set(array, core.CPUPlace())
                pickle.loads(ForkingPickler.dumps(tensor))
            else:
                paddle.to_tensor(pickle.loads(pickle.dumps(array)))

    return handover


def _torch(shared_collate: bool) -> Callable[[list[dict]], None]:
    import torch
    from torch.multiprocessing.reductions import init_reductions

    init_reductions()
    from multiprocessing.reduction import ForkingPickler

    def handover(samples: list[dict]) -> None:
        for key in samples[0]:
            if shared_collate:  # default_collate in a worker: torch.stack into new shared memory
                parts = [torch.as_tensor(s[key]) for s in samples]
                out = (
                    parts[0]
                    .new(
                        parts[0]
                        ._typed_storage()
                        ._new_shared(len(parts) * parts[0].numel(), device=parts[0].device)
                    )
                    .resize_(len(parts), *parts[0].shape)
                )
                torch.stack(parts, out=out)
                tensor = out
            else:
                tensor = torch.from_numpy(np.stack([s[key] for s in samples]))
            pickle.loads(ForkingPickler.dumps(tensor))

    return handover


def measure(kind: str, batch, reps: int = 5) -> dict:
    """Median ms per batch of stacking ``batch``'s samples and handing them over as ``kind``."""
    samples = _samples(as_numpy(batch))
    if kind == "ring":
        handover = _ring()
    elif kind.startswith("paddle"):
        handover = _paddle(kind == "paddle_shm")
    else:
        handover = _torch(kind == "torch_shared_collate")
    times = []
    try:
        for _ in range(reps + 1):  # the first pass maps the ring's pages; not counted
            start = time.perf_counter()
            handover(samples)
            times.append(time.perf_counter() - start)
    finally:
        getattr(handover, "close", lambda: None)()
    return {
        "copies_per_batch": COPIES[kind],
        "handover_ms": round(1000 * statistics.median(times[1:]), 3),
    }


def share_of_worker_time(
    handover_ms: float, workers: int, batch_size: int, samples_per_s: float
) -> float:
    """The hand-over's part of a worker's time per batch at the measured throughput."""
    worker_ms_per_batch = 1000.0 * max(workers, 1) * batch_size / samples_per_s
    return round(handover_ms / worker_ms_per_batch, 4)
