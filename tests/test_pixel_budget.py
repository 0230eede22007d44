"""data.max_image_pixels: an image whose header promises more pixels (a 20000 x 20000 JPEG, a PNG
decompression bomb of a few hundred KB) is a bad sample of kind image_too_large, refused from
its header: the process reading it never holds its pixels."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import simplejpeg

from datasets.decode import check_encoded, header_size
from datasets.errors import BadSampleError
from datasets.lmdb_ocr import LmdbOcrWriter
from datasets.synthetic import LATIN, ocr_samples, write_all
from tests.test_train import ROOT, train_cmd


def jpeg_claiming(width: int, height: int) -> bytes:
    """A small valid JPEG whose frame header (SOF0) is patched to say width x height."""
    data = bytearray(simplejpeg.encode_jpeg(np.full((16, 16, 3), 128, np.uint8), 90))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def png_bomb(side: int = 10000) -> bytes:
    """A real greyscale PNG of side x side zero pixels: ~100 KB that inflate to side^2 bytes
    (300 MB as the BGR array OpenCV would make of it)."""
    chunk = lambda kind, body: (  # noqa: E731
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    )
    packer, row = zlib.compressobj(9), b"\x00" * (side + 1)  # filter byte + the row
    rows = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    )


def test_sizes_come_from_the_headers():
    assert header_size(jpeg_claiming(20000, 20000), "jpeg") == (20000, 20000)
    assert header_size(png_bomb(2000), "png") == (2000, 2000)
    with pytest.raises(BadSampleError) as raised:
        check_encoded(jpeg_claiming(20000, 20000), max_pixels=40_000_000)
    assert raised.value.kind == "image_too_large" and "20000 x 20000 = 400 Mpixels" in str(
        raised.value
    )
    check_encoded(jpeg_claiming(4000, 3000), max_pixels=40_000_000)  # 12 M: fine


@pytest.fixture(scope="module")
def lmdb_with_giants(tmp_path_factory):
    root = tmp_path_factory.mktemp("giants")
    write_all(LmdbOcrWriter(root / "train"), ocr_samples(30, LATIN, None, seed=3))
    giants = [(jpeg_claiming(20000, 20000), "abc"), (png_bomb(), "abc")]
    write_all(LmdbOcrWriter(root / "giants"), giants)
    (root / "charset.txt").write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    return root


READ_ALL = """
import json, resource, sys
from datasets.dataset import build_ocr_dataset
from datasets.ocr_transforms import CharDict
chars = CharDict.from_file(sys.argv[2], False)
dataset = build_ocr_dataset(sys.argv[1], chars, train=False, max_bad_fraction=1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
dataset.start_epoch(0)
for i in range(len(dataset)):
    dataset[i]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_mb": (after - before) / 1024, "bad": dataset.bad_log.epoch_counts()}))
"""


def test_giants_are_bad_samples_without_their_pixels_in_memory(lmdb_with_giants):
    """The records are read the way a loader worker reads them (RecordDataset[i]), in a fresh
    process whose peak RSS is compared before and after: decoding the bomb alone would add
    300 MB, the JPEG 1.2 GB."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            READ_ALL,
            str(lmdb_with_giants),  # the good records and the giants
            str(lmdb_with_giants / "charset.txt"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["bad"] == {"image_too_large": 2}, report
    assert report["grew_mb"] < 50, report


@pytest.mark.torch
def test_training_counts_giants_as_bad_samples(tmp_path, lmdb_with_giants):
    root = lmdb_with_giants  # data.train: the tree of both LMDBs; data.val: the good one
    sets = [f"data.train={root}", "train.max_steps=4", "data.max_bad_fraction=0.2"]
    cmd = train_cmd("ocr", "torch", tmp_path / "run", sets, root / "train", None)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert epochs and epochs[0].get("bad.image_too_large") == 2, epochs
    bad = (tmp_path / "run/bad_samples.train.tsv").read_text()
    assert bad.count("image_too_large") == 2
