"""A dataset whose structure is broken fails when it opens, with one DatasetError naming the file,
the key and the fix: not a KeyError traceback, nor one bad sample per record. Files written by
the project's own writers, then damaged the way a foreign writer or a cut-short copy would."""

from __future__ import annotations

import subprocess

import h5py
import lmdb
import numpy as np
import pytest

from datasets.errors import DatasetError
from datasets.hdf5_images import Hdf5ImageSource, Hdf5ImageWriter
from datasets.lmdb_ocr import LmdbOcrSource, LmdbOcrWriter
from datasets.synthetic import LATIN, imagenet_samples, ocr_samples, write_all
from tests.test_train import ROOT, train_cmd


def small_h5(path):
    writer = Hdf5ImageWriter(path, ["a", "b"])
    write_all(writer, ((d, y, f"i{i}.jpg") for i, (d, y) in enumerate(imagenet_samples(4, 2, 0))))
    return path


def test_hdf5_without_class_names(tmp_path):
    path = small_h5(tmp_path / "x.h5")
    with h5py.File(path, "r+") as f:
        del f.attrs["class_names"]
    with pytest.raises(DatasetError) as raised:
        Hdf5ImageSource(path)
    message = str(raised.value)
    assert str(path) in message and "attribute 'class_names': missing" in message
    assert "HINT" in message and "scripts/make_synthetic.py" in message


def test_hdf5_images_and_labels_of_different_lengths(tmp_path):
    path = small_h5(tmp_path / "x.h5")
    with h5py.File(path, "r+") as f:
        del f["labels"]
        f.create_dataset("labels", data=np.zeros(3, dtype=np.int64))
    with pytest.raises(DatasetError, match=r"'offsets'/'labels': 4 images but 3 labels"):
        Hdf5ImageSource(path)


def test_hdf5_labels_that_are_not_integers(tmp_path):
    path = small_h5(tmp_path / "x.h5")
    with h5py.File(path, "r+") as f:
        del f["labels"]
        f.create_dataset("labels", data=np.zeros(4, dtype=np.float32))
    with pytest.raises(DatasetError, match=r"'labels': not a 1-D integer dataset"):
        Hdf5ImageSource(path)


def test_lmdb_cut_short_names_num_samples(tmp_path):
    path = tmp_path / "ocr"
    write_all(LmdbOcrWriter(path), ocr_samples(6, LATIN, None, seed=1))
    assert len(LmdbOcrSource(path)) == 6
    with lmdb.open(str(path), subdir=True) as env, env.begin(write=True) as txn:
        for kind in (b"image", b"label"):
            txn.delete(b"%s-%09d" % (kind, 6))  # the tail a cut-short write loses
    with pytest.raises(DatasetError) as raised:
        LmdbOcrSource(path)
    message = str(raised.value)
    assert f"malformed OCR LMDB {path}: key 'num-samples' says 6 records" in message
    assert "lacks image-000000006, label-000000006" in message and "HINT" in message


@pytest.mark.torch
def test_train_on_a_malformed_hdf5_is_one_data_error(tmp_path, ocr_lmdb):
    path = small_h5(tmp_path / "x.h5")
    with h5py.File(path, "r+") as f:
        del f.attrs["class_names"]
    cmd = train_cmd("resnet50", "torch", tmp_path / "run", [], ocr_lmdb, path)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "attribute 'class_names': missing" in errors[0]
    assert "Traceback" not in result.stderr
