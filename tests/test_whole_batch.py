"""RecordDataset.get_batch (a whole batch in one call, samples written into their rows) gives
exactly the stacked samples, bad-record substitution and counts included, and says so when a
sample does not fit its batch. Both backends' loaders use it at 0 workers; the contract test
test_persistent_workers_give_the_batches_of_the_main_process (tests/test_backend_contract.py)
compares those batches with the workers' batches."""

from __future__ import annotations

import numpy as np
import pytest

from datasets import image_transforms
from datasets.dataset import RecordDataset, build_image_dataset, build_ocr_dataset
from datasets.ocr_transforms import CharDict
from datasets.sampler import EpochBatchSampler, EpochSampler, WholeBatch, WholeBatches
from datasets.synthetic import LATIN
from tests.corrupt import MAX_TEXT_LENGTH, write_corrupt_lmdb
from train.backends.common import stack_samples


def _assert_same(batch: dict, expected: dict) -> None:
    assert batch.keys() == expected.keys()
    for key in expected:
        assert batch[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)


@pytest.mark.parametrize("image_shape", [(3, 48, 320), (1, 32, 100)])
def test_a_whole_ocr_batch_is_its_stacked_samples_with_bad_records_substituted(
    tmp_path, image_shape
):
    path, _ = write_corrupt_lmdb(tmp_path / "bad")
    datasets = [
        build_ocr_dataset(
            path,
            CharDict(list(LATIN)),
            train=True,  # augmentation on: the same per-sample seeds either way
            image_shape=image_shape,
            max_text_length=MAX_TEXT_LENGTH,
            max_bad_fraction=1.0,
            state_dir=tmp_path / name,
        )
        for name in ("samples", "batch")
    ]
    per_sample, whole = datasets
    items = [(2, i) for i in [*range(len(per_sample)), 5, 0, 3]]  # bad ones, repeats
    for dataset in datasets:
        dataset.start_epoch(2)
    expected = stack_samples([per_sample[item] for item in items])
    _assert_same(whole[WholeBatch(items)], expected)
    assert whole.bad_log.epoch_counts() == per_sample.bad_log.epoch_counts()
    assert sum(whole.bad_log.epoch_counts().values()) > 0


@pytest.mark.parametrize("train", [True, False])
def test_a_whole_image_batch_is_its_stacked_samples(image_h5, tmp_path, train, monkeypatch):
    """ResNet-50 crops are resized (and, half the time, flipped in place) straight into their
    batch rows: the same pixels as each sample on its own, stacked."""
    dataset = build_image_dataset(image_h5, train=train, state_dir=tmp_path)
    assert dataset.transform.fills_rows
    items = [(3, i) for i in (4, 1, 7, 1, *range(8, 20))]
    expected = stack_samples([dataset[i] for i in items])
    flips = []
    real_flip = image_transforms.cv2.flip
    monkeypatch.setattr(
        image_transforms.cv2, "flip", lambda *a, **k: flips.append(1) or real_flip(*a, **k)
    )
    _assert_same(dataset.get_batch(items), expected)
    # Train flips some rows in place and not others (both ways checked above); eval never.
    assert 0 < len(flips) < len(items) if train else not flips


class _WithoutRows:
    """A transform that only returns new samples (no ``fills_rows``), as users may write."""

    def __init__(self, transform) -> None:
        self.transform = transform

    def __call__(self, data, label, rng):
        return self.transform(data, label, rng)


def test_a_transform_without_rows_is_copied_into_the_batch(image_h5, tmp_path):
    rows = build_image_dataset(image_h5, train=True, state_dir=tmp_path / "rows")
    dataset = RecordDataset(rows.source, _WithoutRows(rows.transform))
    assert not getattr(dataset.transform, "fills_rows", False)
    items = [(0, i) for i in (4, 1, 7, 1)]
    _assert_same(dataset.get_batch(items), stack_samples([dataset[i] for i in items]))


class _Source:
    def __len__(self):
        return 4

    def read(self, index):
        return b"", index

    def key(self, index):
        return f"k{index}"

    def index_of_key(self, key):
        return None

    def source_of(self, index):
        return "memory"

    def close(self):
        pass


def test_a_sample_that_does_not_fit_its_batch_is_named():
    def ragged(data, label, rng):  # sample 2 is one pixel wider
        return {"image": np.zeros((2, 3 + (label == 2)), np.uint8), "label": np.int64(label)}

    dataset = RecordDataset(_Source(), ragged)
    with pytest.raises(ValueError, match=r"field 'image' has shape \(2, 4\).*\(2, 3\)"):
        dataset.get_batch([(0, 0), (0, 1), (0, 2)])

    def extra_field(data, label, rng):
        sample = {"label": np.int64(label)}
        return {**sample, "extra": np.int64(0)} if label == 1 else sample

    dataset = RecordDataset(_Source(), extra_field)
    with pytest.raises(ValueError, match="sample fields"):
        dataset.get_batch([(0, 0), (0, 1)])


def test_whole_batches_keep_the_order_and_count_of_their_batch_sampler():
    sampler = EpochSampler(10, seed=1)
    batches = EpochBatchSampler(sampler, 4, drop_last=False)
    whole = WholeBatches(batches)
    assert whole.sampler is sampler and len(whole) == len(batches) == 3
    assert [b[0].items for b in whole] == list(batches)
    assert all(len(b) == 1 and isinstance(b[0], WholeBatch) for b in whole)


def _loader_parts(framework: str):
    """(make_loader, the framework DataLoader inside what it returns, tensor -> numpy)."""
    pytest.importorskip(framework)
    if framework == "paddle":
        from train.backends.paddle.data import make_loader

        return make_loader, lambda loader: loader.loader, lambda tensor: tensor.numpy()
    from train.backends.torch.data import make_loader

    # With workers make_loader gives a RingLoader (the batch ring, on by default), whose .loader
    # is the DataLoader; at 0 workers the DataLoader itself.
    return make_loader, lambda loader: getattr(loader, "loader", loader), lambda t: t.numpy()


@pytest.mark.parametrize("framework", ["paddle", "torch"])
def test_loaders_fetch_whole_batches_at_0_workers_only(framework, ocr_lmdb, tmp_path):
    from train.backends.common import LoaderKnobs

    make_loader, inner, to_numpy = _loader_parts(framework)
    charset = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    dataset = build_ocr_dataset(ocr_lmdb, charset, train=True, state_dir=tmp_path)
    sampler = EpochSampler(len(dataset), seed=2)
    loader = make_loader(dataset, sampler, LoaderKnobs(batch_size=16, drop_last=False))
    whole = inner(loader).batch_sampler
    assert isinstance(whole, WholeBatches) and whole.sampler is sampler
    got = list(loader)
    expected = [stack_samples([dataset[i] for i in batch]) for batch in whole.batches]
    assert len(got) == len(loader) == len(expected) == -(-96 // 16)
    for batch, want in zip(got, expected):
        _assert_same({key: to_numpy(value) for key, value in batch.items()}, want)
    with_workers = make_loader(dataset, sampler, LoaderKnobs(batch_size=16, num_workers=1))
    assert not isinstance(inner(with_workers).batch_sampler, WholeBatches)
