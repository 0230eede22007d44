"""OCR LMDB reader and writer: PaddleOCR's layout, trees, schema, atomic writes, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from datasets.errors import DatasetError
from datasets.lmdb_ocr import LmdbOcrSource, LmdbOcrWriter
from datasets.synthetic import LATIN, ocr_samples, write_all


def write_public_style_lmdb(path: Path, samples: list[tuple[bytes, str]]) -> None:
    """The layout of PaddleOCR's and the CRNN benchmark's LMDBs: no schema-version key."""
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for n, (image, label) in enumerate(samples, 1):
            txn.put(b"image-%09d" % n, image)
            txn.put(b"label-%09d" % n, label.encode())
        txn.put(b"num-samples", str(len(samples)).encode())
    env.close()


def test_reads_public_layout_without_schema_key(tmp_path):
    samples = list(ocr_samples(5, LATIN, None, seed=3))
    write_public_style_lmdb(tmp_path / "pub", samples)
    source = LmdbOcrSource(tmp_path / "pub")
    assert len(source) == 5
    assert [source.read(i) for i in range(5)] == samples


def test_tree_of_lmdbs_in_sorted_order_with_stable_keys(tmp_path):
    a = list(ocr_samples(3, LATIN, None, seed=1))
    b = list(ocr_samples(4, LATIN, None, seed=2))
    write_all(LmdbOcrWriter(tmp_path / "root" / "b_set"), iter(b))
    write_all(LmdbOcrWriter(tmp_path / "root" / "a_set" / "nested"), iter(a))
    source = LmdbOcrSource(tmp_path / "root")
    assert len(source) == 7
    assert [source.read(i)[1] for i in range(7)] == [s[1] for s in a + b]
    assert source.key(0) == "a_set/nested/image-000000001"
    assert source.key(6) == "b_set/image-000000004"
    assert all(source.index_of_key(source.key(i)) == i for i in range(7))
    assert source.index_of_key("b_set/image-000000099") is None


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("x"), "is a file"),
        (lambda p: p.mkdir(), r"no LMDB \(no data.mdb\) found"),
    ],
)
def test_wrong_paths_name_the_problem(tmp_path, make, message):
    target = tmp_path / "data"
    make(target)
    with pytest.raises(DatasetError, match=message) as info:
        LmdbOcrSource(target)
    assert "HINT" in str(info.value)


def test_lmdb_without_num_samples_is_not_an_ocr_lmdb(tmp_path):
    env = lmdb.open(str(tmp_path / "x"))
    with env.begin(write=True) as txn:
        txn.put(b"something", b"else")
    env.close()
    with pytest.raises(DatasetError, match="not an OCR LMDB: key 'num-samples' missing"):
        LmdbOcrSource(tmp_path / "x")


def test_newer_schema_version_is_refused(tmp_path):
    write_all(LmdbOcrWriter(tmp_path / "x"), ocr_samples(2, LATIN, None, seed=0))
    env = lmdb.open(str(tmp_path / "x"))
    with env.begin(write=True) as txn:
        txn.put(b"schema-version", b"99")
    env.close()
    with pytest.raises(DatasetError, match="schema-version 99"):
        LmdbOcrSource(tmp_path / "x")


@pytest.mark.parametrize("version", [b"v2", b"", b"\xff\xfe", b"-1"])
def test_malformed_schema_version_is_a_dataset_error(tmp_path, version):
    write_all(LmdbOcrWriter(tmp_path / "x"), ocr_samples(2, LATIN, None, seed=0))
    env = lmdb.open(str(tmp_path / "x"))
    with env.begin(write=True) as txn:
        txn.put(b"schema-version", version)
    env.close()
    with pytest.raises(DatasetError, match="schema-version is .*, not a number"):
        LmdbOcrSource(tmp_path / "x")


def test_truncated_lmdb_gives_an_error_not_a_bus_error(tmp_path):
    write_all(LmdbOcrWriter(tmp_path / "x"), ocr_samples(300, LATIN, None, seed=0))
    data = tmp_path / "x" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)
    # In a child process: if the reader touched a page past the end, SIGBUS would kill it.
    code = (
        "from datasets.lmdb_ocr import LmdbOcrSource\n"
        "from datasets.errors import DatasetError\n"
        f"try:\n    LmdbOcrSource({str(tmp_path / 'x')!r})\n"
        "except DatasetError as e:\n    print(e)\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "truncated LMDB file" in result.stdout and "HINT" in result.stdout


def test_writer_refuses_overwrite_and_restarts_cleanly(tmp_path):
    out = tmp_path / "x"
    write_all(LmdbOcrWriter(out), ocr_samples(2, LATIN, None, seed=0))
    with pytest.raises(DatasetError, match="already exists.*--overwrite"):
        LmdbOcrWriter(out)

    # An interrupted run leaves only a .partial folder, never a half dataset under the name.
    def failing():
        yield from ocr_samples(3, LATIN, None, seed=0)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_all(LmdbOcrWriter(tmp_path / "y"), failing())
    assert not (tmp_path / "y").exists() and not (tmp_path / "y.partial").exists()
    (tmp_path / "z.partial").mkdir()  # leftover of a killed run
    write_all(LmdbOcrWriter(tmp_path / "z"), ocr_samples(2, LATIN, None, seed=0))
    assert len(LmdbOcrSource(tmp_path / "z")) == 2 and not (tmp_path / "z.partial").exists()


def test_writer_grows_the_map_for_large_datasets(tmp_path):
    big = b"\xff\xd8\xff" + os.urandom(3 << 20) + b"\xff\xd9"
    writer = LmdbOcrWriter(tmp_path / "big", commit_every=5)
    for _ in range(30):  # 90 MB > the initial 64 MB map
        writer.add(big, "x")
    writer.finish()
    assert len(LmdbOcrSource(tmp_path / "big")) == 30
