"""datasets/sources.py: the one decision of what a dataset path is, and every reader that uses it
(the task datasets, scripts/validate_data.py, train.predict's inputs). Framework-free.

Each fixture is written with the project's writers; each detection is asserted by its exact
format name, and each reader by the source class it opened, so a path taken for another format
fails here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from datasets import image_folder, sources
from datasets.dataset import build_image_dataset, build_ocr_dataset, build_tagged_image_dataset
from datasets.errors import DatasetError
from datasets.hdf5_images import Hdf5ImageSource, Hdf5TagSource
from datasets.image_folder import ImageFolderSource
from datasets.lmdb_ocr import LmdbOcrSource, LmdbOcrWriter
from datasets.ocr_transforms import CharDict
from datasets.synthetic import LATIN, encode_image, ocr_samples, write_all
from datasets.validate import scan
from train import inference

ROOT = Path(__file__).resolve().parent.parent
LMDB_FOUND = "an OCR LMDB (a directory holding data.mdb, or a tree of them)"


def _image(value: int, fmt: str = "png") -> bytes:
    return encode_image(np.full((8, 8, 3), value, dtype=np.uint8), fmt)


@pytest.fixture
def folder(tmp_path) -> Path:
    """root/<class>/<image>: two classes, three images, and a file that is no image."""
    root = tmp_path / "folder"
    for label, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        (root / name / "0.png").write_bytes(_image(40 * label))
    (root / "dog" / "1.JPG").write_bytes(_image(200, "jpeg"))
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture
def lmdb_tree(tmp_path) -> Path:
    """A folder holding no data.mdb itself, with an LMDB one level and one two levels below."""
    root = tmp_path / "tree"
    write_all(LmdbOcrWriter(root / "b_set"), ocr_samples(2, LATIN, None, seed=1))
    write_all(LmdbOcrWriter(root / "a_set" / "nested"), ocr_samples(3, LATIN, None, seed=2))
    return root


@pytest.fixture
def h5_named_otherwise(tmp_path, image_h5) -> Path:
    """The tagged HDF5 fixture under a name with no HDF5 suffix."""
    path = tmp_path / "train.data"
    shutil.copyfile(image_h5, path)
    return path


# ---------------------------------------------------------------- detection
def test_each_format_is_detected(ocr_lmdb, lmdb_tree, image_h5, folder):
    assert sources.detect_format(ocr_lmdb) == "ocr-lmdb"
    assert sources.detect_format(str(ocr_lmdb)) == "ocr-lmdb"  # a str as a Path
    assert sources.detect_format(lmdb_tree) == "ocr-lmdb"
    assert sources.detect_format(image_h5) == "hdf5"
    assert sources.detect_format(folder) == "image-folder"
    assert sources.detect_format(folder / "cat" / "0.png") == "image-file"
    assert sources.detect_format(folder / "dog" / "notes.txt") == "image-file"  # any other file
    assert set(sources.FORMATS) == {"ocr-lmdb", "hdf5", "image-folder", "image-file"}


def test_a_directory_is_an_lmdb_only_with_a_data_mdb_at_or_below_it(folder, tmp_path):
    (tmp_path / "empty").mkdir()
    assert sources.detect_format(tmp_path / "empty") == "image-folder"
    assert sources.detect_format(folder) == "image-folder"
    # The same folder with an LMDB deep below one class: now the LMDB rule decides, as
    # LmdbOcrSource reads the tree.
    write_all(LmdbOcrWriter(folder / "dog" / "deep" / "lines"), ocr_samples(2, LATIN, None, 3))
    assert sources.detect_format(folder) == "ocr-lmdb"
    assert LmdbOcrSource(folder).paths == [folder / "dog" / "deep" / "lines"]


def test_an_lmdb_tree_opens_every_lmdb_in_it(lmdb_tree):
    source = sources.open_source(lmdb_tree, reader="a test")
    assert isinstance(source, LmdbOcrSource) and len(source) == 5
    assert source.key(0) == "a_set/nested/image-000000001"


def test_hdf5_is_decided_by_content_not_suffix(h5_named_otherwise, folder):
    assert sources.detect_format(h5_named_otherwise) == "hdf5"
    source = sources.open_source(h5_named_otherwise, reader="a test")
    assert isinstance(source, Hdf5ImageSource) and len(source) == 24
    # An image under an .h5 name holds no HDF5: refused, not read as an image or as HDF5.
    fake = folder / "images.h5"
    shutil.copyfile(folder / "cat" / "0.png", fake)
    with pytest.raises(DatasetError, match="named as an HDF5 file but holds no HDF5") as raised:
        sources.detect_format(fake)
    assert str(fake) in str(raised.value) and "HINT: " in str(raised.value)


def test_a_missing_path_names_the_problem_and_the_fix(tmp_path, monkeypatch):
    with pytest.raises(DatasetError) as raised:
        sources.detect_format(tmp_path / "nope")
    assert raised.value.problem == f"dataset path does not exist: {tmp_path / 'nope'}"
    assert "check the path" in raised.value.hint and "volume" in raised.value.hint
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=f"read from {tmp_path}"):
        sources.detect_format("relative/nope")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(DatasetError, match=f"link to {tmp_path / 'gone'}, which does not exist"):
        sources.detect_format(tmp_path / "link")


def test_neither_file_nor_directory_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")  # h5py would block reading it
    with pytest.raises(DatasetError, match="neither a file nor a directory"):
        sources.detect_format(tmp_path / "pipe")


@pytest.mark.parametrize("target", ["dir", "file"])
def test_an_unreadable_path_is_a_dataset_error(tmp_path, monkeypatch, target, folder):
    """Denied by the system as a user without the permission would be (the tests may run as
    root, whom chmod does not stop)."""
    path = folder if target == "dir" else folder / "cat" / "0.png"

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    if target == "dir":
        monkeypatch.setattr(sources.os, "scandir", denied)
    else:
        monkeypatch.setattr(sources, "open", denied, raising=False)
    with pytest.raises(DatasetError) as raised:
        sources.detect_format(path)
    assert raised.value.problem == f"cannot read dataset path {path}: Permission denied"
    assert "readable" in raised.value.hint


def test_image_suffixes_are_defined_once():
    assert sources.IMAGE_SUFFIXES is image_folder.IMAGE_SUFFIXES
    assert inference.IMAGE_SUFFIXES is sources.IMAGE_SUFFIXES


def test_accept_names_only_known_formats(image_h5):
    with pytest.raises(ValueError, match="accept"):
        sources.check_format(image_h5, ("h5",), reader="a test")
    with pytest.raises(ValueError, match="record source"):
        sources.open_source(image_h5, ("hdf5", "image-file"), reader="a test")


# ---------------------------------------------------------------- the tasks' datasets
def test_each_task_opens_its_formats(ocr_lmdb, lmdb_tree, image_h5, h5_named_otherwise, folder):
    chars = CharDict.from_file(ocr_lmdb.parent / "charset.txt")
    for path in (ocr_lmdb, lmdb_tree):
        assert isinstance(build_ocr_dataset(path, chars, train=False).source, LmdbOcrSource)
    for path, kind in ((image_h5, Hdf5ImageSource), (h5_named_otherwise, Hdf5ImageSource)):
        assert type(build_image_dataset(path, train=False).source) is kind
    images = build_image_dataset(folder, train=False).source
    assert isinstance(images, ImageFolderSource) and images.class_names == ["cat", "dog"]
    tagged = build_tagged_image_dataset(h5_named_otherwise, train=False).source
    assert isinstance(tagged, Hdf5TagSource)


def _wrong(task: str, path: Path, charset: Path) -> DatasetError:
    """The error of ``task``'s open_dataset (as training, the doctor and train.evaluate open
    data) for ``path``."""
    from train import tasks

    spec = tasks.get(task)
    own = {"char_dict": str(charset)} if task == "ocr" else {}
    data = spec.data(train=str(path), **own)
    with pytest.raises(DatasetError) as raised:
        spec.open_dataset(data, str(path), train=False)
    return raised.value


def test_a_path_of_another_format_names_what_it_is_and_what_the_task_reads(
    ocr_lmdb, image_h5, folder
):
    charset = ocr_lmdb.parent / "charset.txt"
    png = folder / "cat" / "0.png"

    error = _wrong("classification", ocr_lmdb, charset)
    assert error.problem == (
        f"{ocr_lmdb} is {LMDB_FOUND}; the classification task reads an HDF5 file or an image "
        "folder (root/<class>/<image>)"
    )
    assert "scripts/make_synthetic.py imagenet" in error.hint and "root/<class name>" in error.hint
    error = _wrong("classification", png, charset)
    assert error.problem.startswith(f"{png} is a file that is not HDF5, so an image file; the ")

    ocr_reads = f"; the ocr task reads {LMDB_FOUND}"
    assert _wrong("ocr", image_h5, charset).problem == f"{image_h5} is an HDF5 file{ocr_reads}"
    error = _wrong("ocr", folder, charset)
    assert error.problem == (
        f"{folder} is a directory with no data.mdb at or below it, so an image folder{ocr_reads}"
    )
    assert "scripts/make_synthetic.py ocr" in error.hint

    tagging_reads = "; the tagging task reads an HDF5 file"
    error = _wrong("tagging", ocr_lmdb, charset)
    assert error.problem == f"{ocr_lmdb} is {LMDB_FOUND}{tagging_reads}"
    error = _wrong("tagging", folder, charset)
    assert error.problem.endswith(f"so an image folder{tagging_reads}")


def test_the_builders_name_themselves_without_a_task(image_h5):
    with pytest.raises(DatasetError, match="is an HDF5 file; build_ocr_dataset reads an OCR"):
        build_ocr_dataset(image_h5, CharDict(list("ab")), train=False)


def test_the_tagging_task_reads_tags_through_the_factory(ocr_lmdb, h5_named_otherwise):
    from train import tasks

    tagging = tasks.get("tagging")
    source = tagging.label_source(h5_named_otherwise)
    assert isinstance(source, Hdf5TagSource)
    with pytest.raises(DatasetError, match="the tagging task reads an HDF5 file"):
        tagging.label_source(ocr_lmdb)


# ---------------------------------------------------------------- validation
def test_validate_scans_an_image_folder(folder):
    (folder / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    report = scan(folder)
    assert report.kind == "image-folder" and report.total == 4
    bad = [(key, kind) for key, kind, _, _ in report.bad]
    assert bad == [("cat/broken.png", "truncated_image")]


def test_validate_reads_lmdb_and_hdf5_by_content(ocr_lmdb, h5_named_otherwise):
    assert scan(ocr_lmdb).kind == "ocr-lmdb"
    report = scan(h5_named_otherwise)
    assert report.kind == "hdf5" and report.total == 24 and report.bad == []


def test_validate_refuses_an_image_file_and_a_folder_of_neither(folder):
    with pytest.raises(DatasetError) as raised:
        scan(folder / "cat" / "0.png")
    assert raised.value.problem.endswith(
        "so an image file; scripts/validate_data.py reads an OCR LMDB (a directory holding "
        "data.mdb, or a tree of them), an HDF5 file or an image folder (root/<class>/<image>)"
    )
    (folder.parent / "empty").mkdir()
    with pytest.raises(DatasetError, match="neither an OCR LMDB .* nor an image folder"):
        scan(folder.parent / "empty")


def test_validate_data_cli_on_a_folder_and_an_image(folder):
    def run(path):
        command = [sys.executable, "-m", "scripts.validate_data", str(path), "--quiet"]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)

    scanned = run(folder)
    assert scanned.returncode == 0 and f"0 bad of 3 records in {folder}" in scanned.stdout
    refused = run(folder / "cat" / "0.png")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith(f"error: {folder / 'cat' / '0.png'} is a file that is not")


# ---------------------------------------------------------------- train.predict's inputs
def test_predict_reads_a_folder_recursively_without_classes(tmp_path):
    root = tmp_path / "inputs"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "x.png").write_bytes(_image(1))
    (root / "y.JPEG").write_bytes(_image(2, "jpeg"))
    (root / "notes.txt").write_text("skipped")
    read = list(inference.read_inputs([str(root)]))
    assert [(name, label) for name, _, label in read] == [
        (str(root / "a" / "b" / "x.png"), None),
        (str(root / "y.JPEG"), None),
    ]
    assert read[0][1] == (root / "a" / "b" / "x.png").read_bytes()


def test_predict_reads_each_format_as_detected(ocr_lmdb, lmdb_tree, h5_named_otherwise, folder):
    png = folder / "cat" / "0.png"
    assert list(inference.read_inputs([str(png)])) == [(str(png), png.read_bytes(), None)]
    lines = list(inference.read_inputs([str(lmdb_tree)]))
    assert len(lines) == 5 and lines[0][0] == "a_set/nested/image-000000001"
    assert isinstance(lines[0][2], str)  # the LMDB's text label, not a folder's None
    classes = list(inference.read_inputs([str(h5_named_otherwise)]))
    expected = Hdf5ImageSource(h5_named_otherwise)
    assert [(name, label) for name, _, label in classes] == [
        (expected.key(i), int(expected.labels[i])) for i in range(len(expected))
    ]
    tags = [label for _, _, label in inference.read_inputs([str(h5_named_otherwise)], "tagging")]
    assert tags == Hdf5TagSource(h5_named_otherwise).tag_masks


def test_predict_refuses_a_missing_input(tmp_path):
    with pytest.raises(DatasetError, match="dataset path does not exist"):
        list(inference.read_inputs([str(tmp_path / "nope.png")]))
