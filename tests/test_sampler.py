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
    sampler.set_epoch(2, consumed=7)
    assert list(sampler) == full[7:] and len(sampler) == 13
    batches = list(EpochBatchSampler(sampler, 5, drop_last=True))
    assert len(batches) == 2 == len(EpochBatchSampler(sampler, 5, drop_last=True))
    assert len(EpochBatchSampler(sampler, 5, drop_last=False)) == 3


def test_unshuffled_order():
    assert [p for _, p in EpochSampler(4, shuffle=False)] == list(np.arange(4))


def test_resume_on_another_world_size_reads_the_rest_of_the_epoch_once():
    """2 ranks read 3 samples each (6 of the epoch's order); 3 ranks then read the other 14 of
    20, dealt out evenly, and an uninterrupted epoch on the same world size is unchanged."""
    before = [EpochSampler(20, seed=5, rank=r, world_size=2) for r in range(2)]
    for sampler in before:
        sampler.set_epoch(4)
    read = [p for sampler in before for _, p in list(sampler)[:3]]
    after = [EpochSampler(20, seed=5, rank=r, world_size=3) for r in range(3)]
    for sampler in after:
        sampler.set_epoch(4, consumed=6)
    rest = [[p for _, p in sampler] for sampler in after]
    assert {len(shard) for shard in rest} == {5}  # 14 samples, padded to 15 by wrapping
    epoch = read + [p for shard in rest for p in shard]
    assert sorted(set(epoch)) == list(range(20))  # every sample read
    padding = [p for p in set(epoch) if epoch.count(p) > 1]
    assert len(epoch) == 21 and padding == [before[0].positions()[0]]  # the order's first
    same = EpochSampler(20, seed=5, rank=1, world_size=2)
    same.set_epoch(4, consumed=6)
    assert [p for _, p in same] == [p for _, p in before[1]][3:]


def test_consumed_positions_are_what_each_rank_read_before_the_resume():
    ranks = [EpochSampler(20, seed=2, rank=r, world_size=2) for r in range(2)]
    read = [[p for _, p in sampler][:4] for sampler in ranks]  # 4 each: 8 of the order
    for rank, sampler in enumerate(ranks):
        sampler.set_epoch(0, consumed=8)
        assert sampler.consumed_positions().tolist() == read[rank]
