"""Batch arrays used again once nothing refers to them, so a loader does not page-fault.

A fresh numpy array of a few MB comes from memory the kernel has not mapped yet (glibc maps
big blocks on their own and gives freed heap tops back), so the first write to each of its
4 KB pages is a page fault. On the benchmark host a fault costs 3.4 us (a fresh 2.9 MB OCR
batch of 64: 720 faults, 2.5 ms to touch; docs/benchmarks.md), as much as decoding 40 text
lines, and how many of a batch's pages fault moves from run to run with glibc's heuristics
(19 to 233 per batch of 64 through Paddle's 0-worker loader, 0 when the same batches were
made in a plain loop). Reusing the arrays takes the faults out of the loader altogether.

An array handed out is a view of a kept base array. When the last reference to the view goes
(the batch's tensors and every tensor view of them, since torch.from_numpy and Paddle's
zero-copy tensors hold the numpy array; numpy views of it, see ``_Owner``), a weakref finalizer
puts the base back on the free list, and the next ``empty`` of that shape and dtype returns it.
So nothing writes into a batch that is still referenced, whoever holds it and for however
long. At most ``keep`` free arrays of each shape and dtype are kept; a batch held beyond that
is freed when dropped. What is kept is what was in flight at once anyway (the loader's prefetch
and the batches the trainer holds).
"""

from __future__ import annotations

import weakref

import numpy as np


class _Owner(np.ndarray):
    """The type of the kept base arrays. numpy points a view of a view at the array that owns
    the memory, skipping the views between, unless that owner is of another type than the new
    view: so a numpy view of a handed-out (plain ndarray) array refers to the handed-out array,
    not to the base, and keeps it, and with it the batch, in use."""


class BatchBuffers:
    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._free: dict[tuple, list[np.ndarray]] = {}
        self.reused = 0  # arrays handed out again (for tests and the benchmark)

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised array like ``np.empty(shape, dtype)``, reused when one is free.
        Thread-safe: list pop and append are atomic, and finalizers run in whichever thread
        drops a batch (the trainer) while a loader thread takes the next one."""
        key = (tuple(shape), np.dtype(dtype).str)
        free = self._free.setdefault(key, [])
        try:
            base = free.pop()
            self.reused += 1
        except IndexError:
            base = np.ndarray.__new__(_Owner, shape, dtype)
        view = base.view(np.ndarray)
        finalizer = weakref.finalize(view, self._give_back, free, base)
        finalizer.atexit = False  # nothing to give back at exit
        return view

    def __getstate__(self) -> dict:
        """Pickled (a spawned loader worker's copy of a dataset) without the free arrays: the
        copy starts empty in its own process."""
        return {"keep": self.keep, "_free": {}, "reused": 0}

    def _give_back(self, free: list[np.ndarray], base: np.ndarray) -> None:
        if len(free) < self.keep:
            free.append(base)
