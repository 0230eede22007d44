"""Which sample positions each rank reads in each epoch, framework-free.

Yields ``(epoch, position)`` pairs so the dataset can seed augmentation per sample without any
state shared with the main process. The order is a permutation seeded by (seed, epoch), split
across ranks like DistributedSampler (padded by wrapping so every rank gets the same count; the
padding is each rank's last position, and ``unpadded`` says how many come before it), and can
start part-way through an epoch: a resumed run continues exactly where it stopped, on the
same number of ranks or another.

Why a resume can change the number of ranks: rank r reads positions r, r + W, r + 2W, ... of the
epoch's order, so after each of the W ranks has read p samples the samples read are exactly the
first p * W of the order, whichever rank read them. A checkpoint records that global count; a
resume deals the rest of the order out to however many ranks it has.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class EpochSampler:
    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if num_samples < 1:
            raise ValueError("cannot sample from an empty dataset")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.consumed = 0  # samples of the epoch's order already read by all ranks (resume)

    @property
    def per_rank(self) -> int:
        """Positions each rank reads in the rest of the epoch (all of it unless resumed)."""
        remaining = max(0, self.num_samples - self.consumed)
        return -(-remaining // self.world_size)  # ceil

    @property
    def unpadded(self) -> int:
        """How many of this rank's ``per_rank`` positions are its own share of the epoch: the
        first ones. The rest (one at most: on ranks r >= ``remaining % world_size`` when that is
        not 0) wrap around to the order's start only so every rank reads as many samples, and
        are read twice in all. An evaluation counts only these: N = 5 on 2 ranks reads 6, and
        a metric that counted the sixth would weigh one sample double."""
        remaining = max(0, self.num_samples - self.consumed)
        return len(range(self.rank, remaining, self.world_size))

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Read epoch ``epoch`` from the start, or, resuming, without its first ``consumed``
        positions: the samples all ranks together read before the checkpoint."""
        if consumed < 0:
            raise ValueError(f"consumed {consumed} is negative")
        self.epoch, self.consumed = epoch, consumed

    def order(self) -> np.ndarray:
        """The epoch's order of all sample positions, which the ranks read in turn."""
        if self.shuffle:
            return np.random.default_rng((self.seed, self.epoch)).permutation(self.num_samples)
        return np.arange(self.num_samples)

    def consumed_positions(self) -> np.ndarray:
        """This rank's share of the positions read before a resume (the first ``consumed`` of
        the order, dealt out as the rest is): on the world size that read them, exactly the
        ones this rank read; on another, a share as large as any rank's."""
        return self.order()[: self.consumed][self.rank :: self.world_size]

    def positions(self) -> np.ndarray:
        order = self.order()
        rest = order[self.consumed :]
        total = self.per_rank * self.world_size
        if total > len(rest):  # pad by wrapping so every rank gets per_rank positions
            # From the order's start, whatever was consumed: on the world size that started the
            # epoch this pads exactly as an uninterrupted epoch does.
            rest = np.concatenate([rest, np.resize(order, total - len(rest))])
        return rest[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for position in self.positions():
            yield self.epoch, int(position)

    def __len__(self) -> int:
        return self.per_rank


class EpochBatchSampler:
    """Groups an EpochSampler into batches (PaddlePaddle's DataLoader takes a batch sampler)."""

    def __init__(self, sampler: EpochSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batch: list[tuple[int, int]] = []
        for item in self.sampler:
            batch.append(item)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class WholeBatch:
    """One loader item standing for a whole batch: ``dataset[WholeBatch(items)]`` returns the
    batch itself, one array per field (datasets.dataset.RecordDataset.get_batch)."""

    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items

    def __repr__(self) -> str:
        return f"WholeBatch({len(self.items)} items)"


class WholeBatches:
    """A batch sampler that hands each batch of ``batches`` to the dataset as a single
    WholeBatch item. A framework loader then makes one dataset call per batch, and its collate
    function receives ``[batch]``: the samples are written straight into the batch's arrays,
    with no per-sample arrays to stack afterwards."""

    def __init__(self, batches: EpochBatchSampler) -> None:
        self.batches = batches

    @property
    def sampler(self) -> EpochSampler:
        return self.batches.sampler

    def __iter__(self) -> Iterator[list[WholeBatch]]:
        for items in self.batches:
            yield [WholeBatch(items)]

    def __len__(self) -> int:
        return len(self.batches)
