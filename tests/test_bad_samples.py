"""Every kind of corrupt record is classified, logged once, substituted, counted and written to
a bad-keys file; above the configured fraction the run aborts naming the keys."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from datasets.dataset import RecordDataset, build_image_dataset, build_ocr_dataset
from datasets.errors import BAD_SAMPLE_KINDS, TooManyBadSamplesError
from datasets.hdf5_images import Hdf5ImageWriter
from datasets.image_folder import ImageFolderSource
from datasets.ocr_transforms import CharDict
from datasets.synthetic import LATIN
from tests.corrupt import MAX_TEXT_LENGTH, write_corrupt_lmdb


@pytest.fixture
def corrupt_ocr(tmp_path):
    path, expected = write_corrupt_lmdb(tmp_path / "bad")
    return path, expected, CharDict(list(LATIN))


def _dataset(path, char_dict, tmp_path, **kw):
    return build_ocr_dataset(
        path,
        char_dict,
        train=False,
        max_text_length=MAX_TEXT_LENGTH,
        bad_keys_file=tmp_path / "bad_samples.tsv",
        state_dir=tmp_path,
        **kw,
    )


def test_every_kind_is_counted_exactly_and_substituted(corrupt_ocr, tmp_path, caplog):
    path, expected, char_dict = corrupt_ocr
    dataset = _dataset(path, char_dict, tmp_path, max_bad_fraction=1.0)
    dataset.start_epoch(0)
    with caplog.at_level(logging.WARNING, logger="datasets.bad_samples"):
        samples = [dataset[i] for i in range(len(dataset))]
    assert dataset.bad_log.epoch_counts() == expected
    # read_error and bad_label need another source; image_too_large: tests/test_pixel_budget.py
    others = {"read_error", "bad_label", "image_too_large"}
    assert sum(expected.values()) == 9 and set(expected) | others == set(BAD_SAMPLE_KINDS)
    # A bad record is replaced by the next good one: batch shape and content stay defined.
    labels = [char_dict.decode(s["label"][: s["length"]]) for s in samples]
    assert labels[:3] == ["abc123", "xyz789", "Q9"] and labels[-1] == "Q9"
    assert all(s["image"].shape == (48, 320, 3) for s in samples)
    # Logged once per key with its file and reason, even though substitutes met them again.
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 9 and all("key=image-0000000" in m and str(path) in m for m in messages)
    lines = (tmp_path / "bad_samples.tsv").read_text().splitlines()
    assert sorted(line.split("\t")[1] for line in lines) == sorted(
        k for k, n in expected.items() for _ in range(n)
    )
    # Second epoch: counts reset per epoch, totals accumulate, nothing logged twice.
    dataset.start_epoch(1)
    again = [dataset[i] for i in range(len(dataset))]
    assert dataset.bad_log.epoch_counts() == expected
    assert dataset.bad_log.total_counts() == {k: 2 * v for k, v in expected.items()}
    assert dataset.bad_log.distinct_bad() == 9
    assert len((tmp_path / "bad_samples.tsv").read_text().splitlines()) == 9
    assert all(np.array_equal(a["image"], b["image"]) for a, b in zip(samples, again))


def test_abort_above_fraction_names_the_keys(corrupt_ocr, tmp_path):
    path, _, char_dict = corrupt_ocr
    dataset = _dataset(path, char_dict, tmp_path, max_bad_fraction=0.25)  # 12 records -> limit 3
    dataset.start_epoch(0)
    with pytest.raises(TooManyBadSamplesError) as info:
        for i in range(len(dataset)):
            dataset[i]
    message = str(info.value)
    assert "too many bad samples: 4 in epoch 0 > data.max_bad_fraction 0.25" in message
    assert "image-000000003" in message and "bad_samples.tsv" in message and "HINT" in message


def test_skip_keys_file_from_an_earlier_run_removes_the_bad_records(corrupt_ocr, tmp_path):
    path, _, char_dict = corrupt_ocr
    first = _dataset(path, char_dict, tmp_path, max_bad_fraction=1.0)
    [first[i] for i in range(len(first))]
    second = build_ocr_dataset(
        path,
        char_dict,
        train=False,
        max_text_length=MAX_TEXT_LENGTH,
        skip_keys_file=tmp_path / "bad_samples.tsv",
        max_bad_fraction=0.0,
        state_dir=tmp_path,
    )
    assert len(second) == 2 + 0 + 1  # the three good records remain
    [second[i] for i in range(len(second))]
    assert second.bad_log.epoch_counts() == {}


def test_substitution_gives_up_after_a_long_run_of_bad_records(tmp_path):
    class AllBad:
        def __len__(self):
            return 50

        def read(self, index):
            return b"", "x"

        def key(self, index):
            if not 0 <= index < 50:  # as the real sources do
                raise IndexError(f"index {index} out of range")
            return f"k{index}"

        def index_of_key(self, key):
            return None

        def source_of(self, index):
            return "mem"

        def close(self):
            pass

    from datasets.dataset import OcrTransform

    dataset = RecordDataset(AllBad(), OcrTransform(CharDict(["x"])), max_substitutions=4)
    with pytest.raises(TooManyBadSamplesError, match="5 consecutive bad records"):
        dataset[0]
    # A position past the end wraps (samplers that repeat a small dataset): the message names
    # the record it wrapped to (it raised IndexError while building the message before).
    with pytest.raises(TooManyBadSamplesError, match=r"from position 103 \(k3\)"):
        dataset[103]
    with pytest.raises(TooManyBadSamplesError, match=r"from position 7 \(k7\)"):
        dataset.get_batch([(0, 7)])


def test_image_kinds_read_error_and_bad_label(tmp_path, rng):
    from datasets.synthetic import encode_image, imagenet_like

    root = tmp_path / "folder"
    (root / "a").mkdir(parents=True)
    (root / "a" / "0.jpg").write_bytes(encode_image(imagenet_like(0, rng), "jpeg"))
    (root / "a" / "1.jpg").mkdir()  # a directory where a file should be: the read fails
    source = ImageFolderSource(root)
    assert len(source) == 1  # directories are not listed ...
    source._paths = np.array([b"a/0.jpg", b"a/1.jpg"])  # ... unless the listing went stale
    source.labels = np.array([0, 0])
    from datasets.bad_samples import BadSampleLog
    from datasets.dataset import ImageClassTransform

    dataset = RecordDataset(
        source, ImageClassTransform(1, train=False), bad_log=BadSampleLog(2, max_bad_fraction=1.0)
    )
    [dataset[i] for i in range(2)]
    assert dataset.bad_log.epoch_counts() == {"read_error": 1}

    h5 = tmp_path / "labels.h5"
    writer = Hdf5ImageWriter(h5, ["a", "b"])
    for label in (0, 1, 1):
        writer.add(encode_image(imagenet_like(label, rng), "jpeg"), label)
    writer.finish()
    import h5py

    with h5py.File(h5, "a") as f:
        f["labels"][2] = 7  # a label outside the class list
    dataset = build_image_dataset(h5, train=True, max_bad_fraction=1.0, state_dir=tmp_path)
    [dataset[i] for i in range(3)]
    assert dataset.bad_log.epoch_counts() == {"bad_label": 1}
