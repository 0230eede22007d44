"""EpochSampler: seeded per epoch, sharded across ranks like DistributedSampler, resumable."""

from __future__ import annotations

import numpy as np

from datasets.sampler import EpochBatchSampler, EpochSampler


def test_epochs_are_seeded_permutations():
    sampler = EpochSampler(10, seed=3)
    first = [p for _, p in sampler]
    assert sorted(first) == list(range(10))
    sampler.set_epoch(1)
    second = list(sampler)
    assert all(epoch == 1 for epoch, _ in second) and [p for _, p in second] != first
    sampler.set_epoch(0)
    assert [p for _, p in sampler] == first


def test_ranks_cover_the_dataset_with_equal_counts():
    shards = [list(EpochSampler(10, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert {len(s) for s in shards} == {4}
    covered = {p for shard in shards for _, p in shard}
    assert covered == set(range(10))


def test_resume_starts_mid_epoch():
    sampler = EpochSampler(20, seed=1)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=7)
    assert list(sampler) == full[7:] and len(sampler) == 13
    batches = list(EpochBatchSampler(sampler, 5, drop_last=True))
    assert len(batches) == 2 == len(EpochBatchSampler(sampler, 5, drop_last=True))
    assert len(EpochBatchSampler(sampler, 5, drop_last=False)) == 3


def test_unshuffled_order():
    assert [p for _, p in EpochSampler(4, shuffle=False)] == list(np.arange(4))
