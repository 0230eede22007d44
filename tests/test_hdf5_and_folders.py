"""HDF5 image reader/writer, image-folder reader, and the converters."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from datasets.convert import image_folder_to_hdf5, paddleocr_labels_to_lmdb
from datasets.errors import DatasetError
from datasets.hdf5_images import CHUNK_ROWS, Hdf5ImageSource, Hdf5ImageWriter
from datasets.image_folder import ImageFolderSource
from datasets.lmdb_ocr import LmdbOcrSource
from datasets.synthetic import LATIN, encode_image, imagenet_like, ocr_samples


def test_hdf5_layout_and_round_trip(image_h5):
    with h5py.File(image_h5, "r", locking=False) as f:  # as the readers open it
        assert f.attrs["format"] == "resnet50-hdf5" and f.attrs["schema_version"] == 1
        assert json.loads(f.attrs["class_names"]) == ["c0", "c1", "c2", "c3"]
        assert f["images"].chunks == (CHUNK_ROWS,) and f["images"].compression is None
        assert f["labels"].dtype == np.int64
        first = f["images"][0].tobytes()
    source = Hdf5ImageSource(image_h5)
    assert len(source) == 24 and source.class_names == ["c0", "c1", "c2", "c3"]
    data, label = source.read(0)
    assert data == first and data[:3] == b"\xff\xd8\xff" and label == 0
    assert 60_000 < len(data) < 150_000  # ImageNet-like JPEG size
    assert source.index_of_key(source.key(5)) == 5


def test_hdf5_errors_name_problem_and_fix(tmp_path, image_h5):
    with pytest.raises(DatasetError, match="not found"):
        Hdf5ImageSource(tmp_path / "missing.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(DatasetError, match="cannot open .* as HDF5"):
        Hdf5ImageSource(tmp_path / "text.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1, 2]
    with pytest.raises(DatasetError, match="not a ResNet-50 HDF5 dataset.*HINT: write one"):
        Hdf5ImageSource(tmp_path / "other.h5")
    copy = tmp_path / "v9.h5"
    copy.write_bytes(image_h5.read_bytes())
    with h5py.File(copy, "a") as f:
        f.attrs["schema_version"] = 9
    with pytest.raises(DatasetError, match="schema_version 9"):
        Hdf5ImageSource(copy)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(image_h5.read_bytes()[: os.path.getsize(image_h5) // 2])
    with pytest.raises(DatasetError, match="truncated HDF5 file.*HINT"):
        Hdf5ImageSource(cut)


def test_hdf5_writer_is_atomic(tmp_path):
    writer = Hdf5ImageWriter(tmp_path / "x.h5", ["a"])
    writer.add(b"\xff\xd8\xff\xd9", 0)
    assert not (tmp_path / "x.h5").exists()  # only the .partial exists until finish
    writer.abort()
    assert not list(tmp_path.iterdir())
    with pytest.raises(DatasetError, match="label 3 outside"):
        Hdf5ImageWriter(tmp_path / "y.h5", ["a"]).add(b"x", 3)


def _image_folder(root, rng):
    for label, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(3):
            (root / name / f"{i}.jpg").write_bytes(encode_image(imagenet_like(label, rng), "jpeg"))
    (root / "dog" / "notes.txt").write_text("not an image")


def test_image_folder_to_hdf5_copies_bytes_unchanged(tmp_path, rng):
    _image_folder(tmp_path / "folder", rng)
    folder = ImageFolderSource(tmp_path / "folder")
    assert folder.class_names == ["cat", "dog"] and len(folder) == 6
    assert folder.key(3) == "dog/0.jpg"
    path, count = image_folder_to_hdf5(tmp_path / "folder", tmp_path / "out.h5")
    h5 = Hdf5ImageSource(path)
    assert count == 6 and h5.class_names == ["cat", "dog"]
    assert all(h5.read(i) == folder.read(i) for i in range(6))
    with pytest.raises(DatasetError, match="already exists"):
        image_folder_to_hdf5(tmp_path / "folder", tmp_path / "out.h5")


def test_paddleocr_label_file_to_lmdb(tmp_path):
    images = tmp_path / "imgs"
    images.mkdir()
    lines = []
    for i, (data, label) in enumerate(ocr_samples(4, LATIN, None, seed=0)):
        (images / f"{i}.jpg").write_bytes(data)
        lines.append(f"{i}.jpg\t{label}")
    lines.append("missing.jpg\tabc")
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    path, count, problems = paddleocr_labels_to_lmdb(
        tmp_path / "train.txt", images, tmp_path / "lm"
    )
    assert count == 4 and len(problems) == 1 and "image not found" in problems[0]
    source = LmdbOcrSource(path)
    assert source.read(0) == ((images / "0.jpg").read_bytes(), lines[0].split("\t")[1])
    with pytest.raises(DatasetError, match="image not found"):
        paddleocr_labels_to_lmdb(tmp_path / "train.txt", images, tmp_path / "lm2", strict=True)
    assert not (tmp_path / "lm2").exists()
    (tmp_path / "bad.txt").write_text("no tab here\n")
    with pytest.raises(DatasetError, match="no TAB"):
        paddleocr_labels_to_lmdb(tmp_path / "bad.txt", images, tmp_path / "lm3")
