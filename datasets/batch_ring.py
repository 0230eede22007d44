"""A ring of shared-memory batch slots owned by the trainer: one copy per batch from a loader
worker to the trainer, framework-free.

Paddle 2.6's own hand-over copies each collated batch twice in the worker, into a LoDTensor and
then into a new /dev/shm file as its queue pickles it, both into freshly mapped pages (page-fault
speed, 0.4-0.7 GB/s; docs/benchmarks.md); torch's moves each batch into a new /dev/shm file,
faulted in page by page. Here a worker stacks its samples straight into a slot file that stays
mapped for the loader's life, and sends the trainer only the slot's number; the trainer copies
the slot into its own tensor (that copy is the hand-over's one copy) and frees the slot. Both
backends use it (train/backends/paddle/data.py, train/backends/torch/data.py).

- The trainer creates the ring (:meth:`BatchRing.create`); workers attach by path (it pickles
  as paths only, like :class:`datasets.shared_block.SharedBlock`).
- Batch ``seq`` of an epoch goes to slot ``seq % slots``. A worker waits until the trainer has
  released batch ``seq - slots``; the batch the trainer waits for is therefore never blocked,
  so a ring of any size cannot deadlock, and ``slots`` = the batches in flight (the /dev/shm
  plan of train.preflight) means workers never wait.
- Each slot is a file grown to the largest batch written into it and then reused, so /dev/shm
  holds ``slots`` x the batch bytes, as the plan counts, and its pages are mapped once per
  process, not faulted in again for every batch.
- An epoch is a *generation*. The trainer starts a new one before each epoch and ends it after;
  a worker still holding a batch of an old generation (an epoch abandoned mid-way) drops it
  instead of waiting for a slot that will never be released.
- Files are named ``starved_ring_<trainer pid>_<token>...``: what a trainer killed with -9
  leaves is removed by train.preflight's sweep at the next start (the owner is gone).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets import owner_lock

RING_PREFIX = "starved_ring_"
_HEADER = 4096  # per slot: stamp (generation, seq, payload bytes) + the layout as JSON
_STAMP = np.dtype("<i8")
_ALIGN = 64
_POLL_S = 0.0005


@dataclass(frozen=True)
class RingTicket:
    """Sent with a batch's sample indices to a worker: which generation and batch it is."""

    generation: int
    seq: int


class StaleBatch(Exception):
    """The batch belongs to a generation the trainer has ended: it is dropped."""


class _Mapped:
    """One file mapped in this process, remapped when it grew or the process forked."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._pid = -1

    def get(self, size: int | None = None, grow: bool = False) -> mmap.mmap:
        """The mapping, at least ``size`` bytes (grown first when ``grow``)."""
        stale = self._map is None or self._pid != os.getpid()
        if not stale and (size is None or len(self._map) >= size):
            return self._map
        fd = os.open(self.path, os.O_RDWR)
        try:
            if grow and size is not None and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            length = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault in once, now
            self._map = mmap.mmap(fd, length, flags=flags)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        return self._map


class BatchRing:
    def __init__(self, base: str, slots: int) -> None:
        self.base = base
        self.slots = slots
        self._creator_pid: int | None = None
        self._owner_fds: list[int] = []  # the creator's, with the owner's mark
        self._control = _Mapped(base + "ctl")
        self._slot_maps = [_Mapped(f"{base}{i}") for i in range(slots)]
        self.generation = 0  # trainer side
        self.released = 0

    @classmethod
    def create(cls, slots: int, directory: str | Path = "/dev/shm") -> BatchRing:
        """Create the control file and ``slots`` empty slot files (they grow on first use)."""
        if slots < 1:
            raise ValueError(f"a batch ring needs at least 1 slot, got {slots}")
        base = os.path.join(str(directory), f"{RING_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_")
        ring = cls(base, slots)
        ring._creator_pid = os.getpid()
        for path in ring.paths():
            # Kept open with the owner's mark until unlink() or death (datasets/owner_lock.py):
            # the start-up sweep of another PID namespace sharing /dev/shm sees the ring alive.
            size = 2 * _STAMP.itemsize if path.endswith("ctl") else _HEADER
            ring._owner_fds.append(owner_lock.create_marked(path, size))
        return ring

    def paths(self) -> list[str]:
        return [self.base + "ctl", *(f"{self.base}{i}" for i in range(self.slots))]

    def bytes_on_disk(self) -> int:
        return sum(os.stat(p).st_size for p in self.paths() if os.path.exists(p))

    def _state(self) -> np.ndarray:
        """[generation, released]: written by the trainer only, read by workers."""
        return np.frombuffer(self._control.get(), dtype=_STAMP, count=2)

    # ------------------------------------------------------------------ trainer side
    def start_generation(self) -> int:
        """A new epoch: batches of older generations are dropped by the workers that hold
        them, and batch numbering starts again at 0."""
        self.generation += 1
        self.released = 0
        state = self._state()
        state[1] = 0
        state[0] = self.generation  # last: a worker that sees it also sees released = 0
        return self.generation

    def end_generation(self) -> None:
        """No batch of the current generation will be taken any more: release waiting workers."""
        self.generation += 1
        self._state()[0] = self.generation

    def take(self, generation: int, seq: int, slot: int) -> dict[str, np.ndarray]:
        """Views of the batch in ``slot`` (valid until :meth:`release`; copy, do not write)."""
        expected_slot = seq % self.slots
        if generation != self.generation or seq != self.released or slot != expected_slot:
            raise RuntimeError(
                f"batch ring out of step: got generation {generation} batch {seq} in slot "
                f"{slot}, expected generation {self.generation} batch {self.released} in slot "
                f"{self.released % self.slots}"
            )
        mapped = self._slot_maps[slot].get()
        stamp = np.frombuffer(mapped, dtype=_STAMP, count=3)
        if stamp[0] != generation or stamp[1] != seq:
            raise RuntimeError(f"batch ring slot {slot} holds {stamp[:2]}, not {generation, seq}")
        mapped = self._slot_maps[slot].get(_HEADER + int(stamp[2]))
        length = int(np.frombuffer(mapped, dtype=_STAMP, count=4)[3])
        layout = json.loads(bytes(mapped[4 * _STAMP.itemsize : 4 * _STAMP.itemsize + length]))
        views = {}
        for key, dtype, shape, offset in layout:
            count = int(np.prod(shape))
            array = np.frombuffer(mapped, dtype=dtype, count=count, offset=_HEADER + offset)
            views[key] = array.reshape(shape)
        return views

    def release(self) -> None:
        """The trainer has copied the batch it took: its slot may be written again."""
        self.released += 1
        self._state()[1] = self.released

    def shrink(self) -> None:
        """Give the slots' pages back to /dev/shm (between epochs of a loader whose workers
        stop: its ring then holds memory only while they run, as the /dev/shm plan counts)."""
        if self._creator_pid != os.getpid():
            return
        self._slot_maps = [_Mapped(f"{self.base}{i}") for i in range(self.slots)]
        for i in range(self.slots):
            with contextlib.suppress(FileNotFoundError):
                os.truncate(f"{self.base}{i}", _HEADER)

    def unlink(self) -> None:
        """Remove the files; only the creating process does (workers just drop their maps)."""
        if self._creator_pid != os.getpid():
            return
        for path in self.paths():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for fd in self._owner_fds:
            os.close(fd)
        self._owner_fds = []

    # ------------------------------------------------------------------ worker side
    def write(self, ticket: RingTicket, samples: list[dict[str, np.ndarray]]) -> int:
        """Stack ``samples`` field by field straight into the ticket's slot; return the slot.
        Raises StaleBatch when the trainer ended the ticket's generation meanwhile."""
        slot = ticket.seq % self.slots
        self._wait_for_slot(ticket)
        first = samples[0]
        layout, offset = [], 0
        for key, value in first.items():
            value = np.asarray(value)
            if value.dtype.hasobject:
                raise TypeError(
                    f"the batch ring carries arrays of numbers, but sample field {key!r} is "
                    f"{value.dtype} ({type(first[key]).__name__}): return numeric arrays from "
                    "the dataset, or set loader.batch_ring: false"
                )
            shape = [len(samples), *value.shape]
            layout.append((key, value.dtype.str, shape, offset))
            offset += -(-value.dtype.itemsize * int(np.prod(shape)) // _ALIGN) * _ALIGN
        encoded = json.dumps(layout).encode()
        if 4 * _STAMP.itemsize + len(encoded) > _HEADER:
            raise ValueError(f"batch layout too large for the ring's slot header: {layout}")
        mapped = self._slot_maps[slot].get(_HEADER + offset, grow=True)
        for key, dtype, shape, at in layout:
            out = np.frombuffer(mapped, dtype=dtype, count=int(np.prod(shape)), offset=_HEADER + at)
            np.stack([s[key] for s in samples], out=out.reshape(shape))  # the one copy
        stamp = np.frombuffer(mapped, dtype=_STAMP, count=4)
        mapped[4 * _STAMP.itemsize : 4 * _STAMP.itemsize + len(encoded)] = encoded
        stamp[2], stamp[3] = offset, len(encoded)
        stamp[0], stamp[1] = ticket.generation, ticket.seq  # last: the batch is complete
        return slot

    def _wait_for_slot(self, ticket: RingTicket) -> None:
        while True:
            generation, released = (int(x) for x in self._state())
            if generation != ticket.generation:
                raise StaleBatch(f"generation {ticket.generation} ended")
            if ticket.seq < released + self.slots:
                return
            time.sleep(_POLL_S)

    def __getstate__(self) -> dict:
        return {"base": self.base, "slots": self.slots}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["base"], state["slots"])


# ---------------------------------------------------------------------- loader glue
# What a framework's DataLoader needs to use the ring, framework-free: a batch sampler that puts
# a ticket in front of each batch's indices (the dataset wrapper passes it through), and a
# collate function that writes the batch into the ticket's slot and returns only the ticket.
RING_KEY = "batch_ring_ticket"


class RingBatches:
    """A batch sampler with a RingTicket (generation, batch number) in front of each batch's
    sample indices, so the worker knows which slot the batch goes to."""

    def __init__(self, batches, ring: BatchRing) -> None:
        self.batches = batches
        self.ring = ring

    @property
    def sampler(self):
        return self.batches.sampler

    def __iter__(self) -> Iterator[list]:
        generation = self.ring.generation  # read here: loaders start the sampler late
        for seq, indices in enumerate(self.batches):
            yield [RingTicket(generation, seq), *indices]

    def __len__(self) -> int:
        return len(self.batches)


class RingCollate:
    """In a worker: stack the samples into the ticket's slot (the hand-over's one copy) and
    return only [generation, batch number, slot] (slot -1: dropped, its epoch was ended)."""

    def __init__(self, ring: BatchRing) -> None:
        self.ring = ring

    def __call__(self, samples: list) -> dict[str, np.ndarray]:
        ticket, samples = samples[0], samples[1:]
        try:
            slot = self.ring.write(ticket, samples)
        except StaleBatch:
            slot = -1
        return {RING_KEY: np.array([ticket.generation, ticket.seq, slot], dtype=np.int64)}


def ticket_of(batch) -> tuple[int, int, int]:
    """(generation, batch number, slot) of what RingCollate returned, after the framework's
    queue turned its array into a tensor."""
    generation, seq, slot = (int(x) for x in np.asarray(batch[RING_KEY]).reshape(-1))
    return generation, seq, slot
