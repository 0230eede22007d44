"""datasets/batch_buffers.py: a batch array is reused only once nothing refers to it, through
numpy views and through both frameworks' tensors, and the 0-worker loaders (which fill their
batches through RecordDataset.get_batch) reuse them without a batch that is still held ever
changing under its holder."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

from datasets.batch_buffers import BatchBuffers
from datasets.dataset import build_ocr_dataset
from datasets.ocr_transforms import CharDict
from datasets.sampler import EpochSampler


def test_an_array_is_reused_only_after_its_last_reference_goes():
    buffers = BatchBuffers()
    first = buffers.empty((4, 3), np.uint8)
    first[...] = 7
    column = first[:, 1]  # a view keeps the batch in use
    del first
    gc.collect()
    second = buffers.empty((4, 3), np.uint8)
    assert not np.shares_memory(second, column) and buffers.reused == 0
    address = column.__array_interface__["data"][0] - 1  # the base starts one byte earlier
    del column
    gc.collect()
    third = buffers.empty((4, 3), np.uint8)
    assert buffers.reused == 1 and third.__array_interface__["data"][0] == address
    assert buffers.empty((4, 3), np.int32).dtype == np.int32  # another dtype: another array
    assert buffers.reused == 1


def test_at_most_keep_free_arrays_are_kept_and_a_pickled_copy_starts_empty():
    buffers = BatchBuffers(keep=2)
    held = [buffers.empty((8,), np.float32) for _ in range(5)]
    del held
    gc.collect()
    assert [len(free) for free in buffers._free.values()] == [2]
    copy = pickle.loads(pickle.dumps(buffers))
    assert copy.keep == 2 and copy._free == {} and copy.reused == 0


def _to_numpy(framework: str):
    if framework == "paddle":
        return lambda tensor: tensor.numpy()
    return lambda tensor: tensor.numpy().copy()


@pytest.mark.parametrize("framework", ["paddle", "torch"])
def test_held_batches_never_change_and_dropped_ones_are_reused(framework, ocr_lmdb, tmp_path):
    """Hold every batch of an epoch (and a tensor view of one field): none is written again,
    each equals a fresh computation of it; drop them, and the next epoch fills the same
    arrays instead of new ones."""
    pytest.importorskip(framework)
    from train.backends.common import LoaderKnobs, stack_samples

    if framework == "paddle":
        from train.backends.paddle.data import make_loader
    else:
        from train.backends.torch.data import make_loader
    to_numpy = _to_numpy(framework)
    charset = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    dataset = build_ocr_dataset(ocr_lmdb, charset, train=True, state_dir=tmp_path)
    sampler = EpochSampler(len(dataset), seed=3)
    loader = make_loader(dataset, sampler, LoaderKnobs(batch_size=16, drop_last=True))

    held = list(loader)
    views = [batch["image"][1:3] for batch in held]  # tensor views of the batches' images
    assert dataset.batch_buffers.reused == 0  # all held: nothing could be reused
    expected = [stack_samples([dataset[i] for i in batch]) for batch in _index_lists(loader)]
    for batch, view, want in zip(held, views, expected):
        for key in want:
            np.testing.assert_array_equal(to_numpy(batch[key]), want[key], err_msg=key)
        np.testing.assert_array_equal(to_numpy(view), want["image"][1:3])
    del held, views, batch, view
    gc.collect()
    sampler.set_epoch(1)
    for _ in loader:
        pass
    assert dataset.batch_buffers.reused >= len(expected)


def _index_lists(loader) -> list[list]:
    """The items of the loader's batches this epoch, in order (its WholeBatches' batches)."""
    batches = loader.batch_sampler  # Paddle's loader gives the EpochBatchSampler itself
    return list(getattr(batches, "batches", batches))
