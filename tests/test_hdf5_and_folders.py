"""HDF5 image reader/writer, image-folder reader, and the converters."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from datasets.convert import image_folder_to_hdf5, paddleocr_labels_to_lmdb, upgrade_hdf5
from datasets.errors import BadSampleError, DatasetError
from datasets.hdf5_images import Hdf5ImageSource, Hdf5ImageWriter
from datasets.image_folder import ImageFolderSource
from datasets.lmdb_ocr import LmdbOcrSource
from datasets.synthetic import LATIN, encode_image, imagenet_like, ocr_samples


def test_hdf5_layout_and_round_trip(image_h5):
    with h5py.File(image_h5, "r", locking=False) as f:  # as the readers open it
        assert f.attrs["format"] == "resnet50-hdf5" and f.attrs["schema_version"] == 2
        assert json.loads(f.attrs["class_names"]) == ["c0", "c1", "c2", "c3"]
        image_bytes, offsets = f["image_bytes"], f["offsets"][:]
        # Contiguous and unfiltered: one place in the file, which the reader preads from.
        assert image_bytes.chunks is None and image_bytes.compression is None
        assert image_bytes.id.get_offset() is not None
        assert offsets[0] == 0 and offsets[-1] == len(image_bytes) and len(offsets) == 25
        assert f["labels"].dtype == np.int64 and len(f["keys"]) == 24
        first = image_bytes[offsets[0] : offsets[1]].tobytes()
        last = image_bytes[offsets[23] : offsets[24]].tobytes()
    source = Hdf5ImageSource(image_h5)
    assert len(source) == 24 and source.class_names == ["c0", "c1", "c2", "c3"]
    assert source.version == 2 and source._file_offset is not None  # the pread path
    data, label = source.read(0)
    assert data == first and data[:3] == b"\xff\xd8\xff" and label == 0
    assert source.read(23)[0] == last and last.endswith(b"\xff\xd9")
    assert 60_000 < len(data) < 150_000  # ImageNet-like JPEG size
    assert source.index_of_key(source.key(5)) == 5


def _records(n, rng):
    return [(encode_image(imagenet_like(i % 2, rng), "jpeg"), i % 2, f"i{i}.jpg") for i in range(n)]


def test_hdf5_schema_1_files_still_read(tmp_path, rng, caplog):
    """The layout before schema 2 (one variable-length row per image) reads as it did."""
    records = _records(5, rng)
    path = tmp_path / "v1.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="resnet50-hdf5", schema_version=1, class_names='["a", "b"]')
        vlen = h5py.vlen_dtype(np.uint8)  # as the schema-1 writer made it:
        images = f.create_dataset("images", (5,), vlen, maxshape=(None,), chunks=(256,))
        for i, (data, _, _) in enumerate(records):
            images[i] = np.frombuffer(data, np.uint8)
        f["labels"] = np.array([r[1] for r in records], np.int64)
        f["keys"] = [r[2] for r in records]
    source = Hdf5ImageSource(path)
    assert source.version == 1 and len(source) == 5
    assert "is schema 1" in caplog.text and "hdf5-upgrade" in caplog.text  # the way to speed
    assert [source.read(i) for i in range(5)] == [(d, y) for d, y, _ in records]
    # scripts/convert.py hdf5-upgrade: the same records, labels and keys in schema 2.
    with pytest.raises(DatasetError, match="--src and --out are the same file"):
        upgrade_hdf5(path, path)
    new, count = upgrade_hdf5(path, tmp_path / "v2.h5")
    upgraded = Hdf5ImageSource(new)
    assert count == 5 and upgraded.version == 2 and upgraded.class_names == ["a", "b"]
    assert [upgraded.read(i) for i in range(5)] == [(d, y) for d, y, _ in records]
    with h5py.File(new, "r") as f:
        assert [k.decode() for k in f["keys"][:]] == [r[2] for r in records]


def test_hdf5_image_bytes_that_are_not_contiguous_read_through_h5py(tmp_path, rng):
    """A schema-2 file from another writer may chunk or compress image_bytes: no place in the
    file to pread from, so records are sliced through h5py, with the same bytes."""
    records = _records(4, rng)
    path = Hdf5ImageWriter(tmp_path / "x.h5", ["a", "b"])
    for record in records:
        path.add(*record)
    path = path.finish()
    with h5py.File(path, "a") as f:
        flat = f["image_bytes"][:]
        del f["image_bytes"]
        f.create_dataset("image_bytes", data=flat, chunks=(4096,), compression="gzip")
    source = Hdf5ImageSource(path)
    assert source._file_offset is None
    assert [source.read(i) for i in range(4)] == [(d, y) for d, y, _ in records]


def test_hdf5_offsets_that_do_not_fit_image_bytes(tmp_path, rng):
    writer = Hdf5ImageWriter(tmp_path / "x.h5", ["a", "b"])
    for record in _records(3, rng):
        writer.add(*record)
    path = writer.finish()
    for bad, message in (
        ([0, 5, 3, None], "decrease at record 1"),
        ([0, 5, 9, 12], "must run from 0 to the"),
        ([1, 5, 9, None], r"found 1 \.\."),
    ):
        with h5py.File(path, "a") as f:
            good = f["offsets"][:]
            f["offsets"][:] = [good[-1] if v is None else v for v in bad]
        with pytest.raises(DatasetError, match=f"'offsets': .*{message}.*HINT"):
            Hdf5ImageSource(path)
        with h5py.File(path, "a") as f:
            f["offsets"][:] = good


def test_hdf5_file_cut_short_after_opening_is_a_bad_sample(tmp_path, rng):
    """The index was read whole; the file loses its tail later (a copy still running, a
    remote mount): the records past the end are read errors that name the file and the fix,
    the records before it read as before."""
    writer = Hdf5ImageWriter(tmp_path / "x.h5", ["a", "b"])
    records = _records(3, rng)
    for record in records:
        writer.add(*record)
    path = writer.finish()
    source = Hdf5ImageSource(path)
    with h5py.File(path, "r") as f:
        last_start = source._file_offset + int(f["offsets"][2])
    os.truncate(path, last_start + 10)
    assert source.read(0) == records[0][:2]
    with pytest.raises(BadSampleError, match="ends .* bytes into record 2 .* cut short") as bad:
        source.read(2)
    assert bad.value.kind == "read_error"


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
    # Only the .partial file and its spool of image bytes exist until finish.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.h5.partial", "x.h5.partial-bytes"]
    writer.abort()
    assert not list(tmp_path.iterdir())
    writer = Hdf5ImageWriter(tmp_path / "x.h5", ["a"])
    writer.add(b"\xff\xd8\xff\xd9", 0)
    assert writer.finish() == tmp_path / "x.h5"
    assert [p.name for p in tmp_path.iterdir()] == ["x.h5"]  # the spool is gone
    assert Hdf5ImageSource(tmp_path / "x.h5").read(0) == (b"\xff\xd8\xff\xd9", 0)
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


def test_label_file_paths_outside_the_data_dir_are_problems_never_copied(tmp_path):
    images = tmp_path / "imgs"
    images.mkdir()
    (images / "sub").mkdir()
    (data, label), *_ = ocr_samples(1, LATIN, None, seed=0)
    (images / "sub" / "ok.jpg").write_bytes(data)
    (tmp_path / "secret.txt").write_text("not an image")
    escapes = ["../secret.txt", "/etc/hostname", "sub/../../secret.txt", str(tmp_path / "x.jpg")]
    lines = ["sub/ok.jpg\tfine", "sub/./../sub/ok.jpg\tinside"] + [f"{p}\tleak" for p in escapes]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    path, count, problems = paddleocr_labels_to_lmdb(
        tmp_path / "train.txt", images, tmp_path / "lm"
    )
    assert count == 2
    assert len(problems) == len(escapes)
    for number, (problem, escape) in enumerate(zip(problems, escapes), start=3):
        assert problem.startswith(f"{tmp_path / 'train.txt'}:{number}: {escape!r} leads outside")
    source = LmdbOcrSource(path)
    assert [source.read(i)[1] for i in range(len(source))] == ["fine", "inside"]
    with pytest.raises(DatasetError, match="leads outside --data-dir"):
        paddleocr_labels_to_lmdb(tmp_path / "train.txt", images, tmp_path / "lm2", strict=True)


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
