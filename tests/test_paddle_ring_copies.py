"""Paddle's loader through the batch ring hands batches over one ahead (train/backends/paddle/
data.py, PaddleLoader._from_ring): batch k+1 is copied out of its slot, the slot released, and
its copy to the device started before batch k is handed over, so on a GPU that copy
(PinnedCopies: pinned staging, side stream) overlaps the step on batch k. On the CPU the same
lookahead runs with a plain copy (HostCopies): these tests hold it to the order and contents
of Paddle's own hand-over, the epoch's last (partial) batch included, and check that an epoch
abandoned mid-way keeps no batch."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.paddle

SAMPLES, BATCH = 22, 4  # 5 full batches and a last one of 2


class NumberedSamples:
    """A framework-free dataset whose sample i is made of i: what arrives shows what was read.
    Items are the sampler's (epoch, position) pairs."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, item: tuple[int, int]) -> dict[str, np.ndarray]:
        _, index = item
        return {
            "image": np.full((8, 12, 3), index, dtype=np.uint8),
            "label": np.array([index, 2 * index], dtype=np.int64),
        }


def ring_loader(batch_ring: bool = True, places=None):
    import train.backends.paddle  # noqa: F401  (zlib before paddle)
    from datasets.sampler import EpochSampler
    from train.backends.common import LoaderKnobs
    from train.backends.paddle.data import make_loader

    knobs = LoaderKnobs(batch_size=BATCH, drop_last=False, num_workers=1, timeout_s=60)
    sampler = EpochSampler(SAMPLES, seed=5)
    return make_loader(NumberedSamples(), sampler, knobs, batch_ring=batch_ring, places=places)


def as_numpy(batch) -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in batch.items()}


def test_batches_come_one_ahead_in_order_with_the_last_one_equal_to_paddles_handover():
    from train.backends.paddle.data import HostCopies

    ours = ring_loader()
    assert isinstance(ours.copies, HostCopies)  # the CPU's staging: a plain copy
    released_when_handed_over, batches = [], []
    for batch in ours:
        released_when_handed_over.append(ours.ring.released)
        batches.append(as_numpy(batch))
    theirs = [as_numpy(batch) for batch in ring_loader(batch_ring=False)]

    count = -(-SAMPLES // BATCH)
    assert len(batches) == len(theirs) == count
    for mine, reference in zip(batches, theirs):
        assert mine.keys() == reference.keys() == {"image", "label"}
        for key in mine:
            np.testing.assert_array_equal(mine[key], reference[key])
    assert len(batches[-1]["label"]) == SAMPLES % BATCH  # the partial last batch arrived
    # Batch k is handed over once batch k+1 has left its slot: k + 2 slots released, the last
    # batch's own release being the last.
    assert released_when_handed_over == [min(k + 2, count) for k in range(count)]


def test_an_abandoned_epoch_keeps_no_batch_and_the_next_epoch_starts_clean():
    loader = ring_loader()
    loader.sampler.set_epoch(0)
    epoch = iter(loader)
    first, second = next(epoch), next(epoch)  # a third has left its slot, held back
    generation = loader.ring.generation
    epoch.close()  # the loop stopped here (max_steps)
    assert loader.ring.generation == generation + 1  # ended: waiting workers let go

    del first, second, epoch
    gc.collect()
    free = loader.copies.buffers._free
    # Every array handed out is back for reuse: the two batches dropped here and the one the
    # lookahead held (2 fields each).
    assert sum(len(arrays) for arrays in free.values()) == 3 * 2

    loader.sampler.set_epoch(1)
    labels = [batch["label"].numpy()[:, 0] for batch in loader]
    assert sorted(np.concatenate(labels).tolist()) == list(range(SAMPLES))


def gpu_count() -> int:
    import paddle

    return paddle.device.cuda.device_count() if paddle.device.is_compiled_with_cuda() else 0


@pytest.mark.skipif("gpu_count() == 0", reason="needs a CUDA build of Paddle and a GPU")
def test_on_a_gpu_batches_arrive_on_the_device_equal_to_the_cpus():
    """PinnedCopies: pinned staging and a side stream from the main thread (training); the
    compute stream from another thread (train/stops.py's evaluation helper)."""
    import paddle

    from train.backends.paddle.data import PinnedCopies

    paddle.set_device("gpu:0")
    expected = [as_numpy(batch) for batch in ring_loader()]
    loader = ring_loader(places=paddle.CUDAPlace(0))
    assert isinstance(loader.copies, PinnedCopies)

    def read(into: list) -> None:
        for batch in loader:
            assert all(value.place.is_gpu_place() for value in batch.values())
            into.append(as_numpy(batch))

    on_main, on_helper = [], []
    read(on_main)
    helper = threading.Thread(target=read, args=(on_helper,))
    helper.start()
    helper.join(timeout=120)
    for got in (on_main, on_helper):
        assert len(got) == len(expected)
        for mine, reference in zip(got, expected):
            for key in reference:
                np.testing.assert_array_equal(mine[key], reference[key])
