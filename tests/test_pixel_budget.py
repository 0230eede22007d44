"""data.max_image_pixels: an image whose header promises more pixels (a 20000 x 20000 JPEG, a PNG
decompression bomb of a few hundred KB, a 1 kB RLE8 BMP of 13500 x 13500, a TIFF or a WebP) is a
bad sample of kind image_too_large, refused from its header on the OCR and the ResNet path: the
process reading it never holds its pixels. A header that gives no size is not decoded blind."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from datasets.decode import check_encoded, decode_bgr, decode_rgb, header_size
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


def bmp_rle8_claiming(width: int, height: int) -> bytes:
    """A 1 kB BMP by hand: BITMAPFILEHEADER, BITMAPINFOHEADER with biCompression 1 (RLE8), a
    256-colour palette and a few RLE bytes (5 pixels of colour 1, end of line, end of bitmap).
    OpenCV decodes it to a width x height x 3 array, the rest of the rows left at colour 0."""
    palette = b"".join(bytes((i, i, i, 0)) for i in range(256))
    rle = b"\x05\x01\x00\x00\x00\x01"
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(rle), 2835, 2835, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(rle), 0, 0, offset) + info + palette + rle


def tiff_claiming(width: int, height: int) -> bytes:
    """A little-endian grey TIFF by hand whose IFD says width x height, with one 16-byte strip."""
    entries = [  # (tag, type: 3 SHORT, 4 LONG, value)
        (256, 4, width),
        (257, 4, height),
        (258, 3, 8),  # bits per sample
        (259, 3, 1),  # no compression
        (262, 3, 1),  # black is zero
        (273, 4, 0),  # strip offset, set below
        (277, 3, 1),  # samples per pixel
        (278, 4, height),  # rows per strip
        (279, 4, 16),  # strip byte count
    ]
    strip_at = 8 + 2 + 12 * len(entries) + 4
    ifd = struct.pack("<H", len(entries))
    for tag, kind, value in entries:
        value = strip_at if tag == 273 else value
        packed = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, kind, 1) + packed
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\0\0\0\0" + bytes(range(16))


def webp_claiming(width: int, height: int) -> bytes:
    """A real lossless WebP (VP8L) of 8 x 8 whose frame header is patched to width x height
    (14 bits each: at most 16384)."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 90, np.uint8)).save(buffer, "WEBP", lossless=True)
    data = bytearray(buffer.getvalue())
    assert data[12:16] == b"VP8L" and data[20] == 0x2F
    bits = int.from_bytes(data[21:25], "little")
    bits = (bits >> 28 << 28) | (width - 1) | (height - 1) << 14
    data[21:25] = bits.to_bytes(4, "little")
    return bytes(data)


def test_bmp_tiff_and_webp_over_the_budget_are_refused_from_their_headers():
    # Pillow's open raises DecompressionBombError past 2 x 89 Mpixels instead of giving the
    # size; that once skipped the budget, and OpenCV decoded the 1 kB BMP to 546 MB.
    giants = {
        "bmp": bmp_rle8_claiming(13500, 13500),
        "tiff": tiff_claiming(20000, 20000),
        "webp": webp_claiming(16000, 16000),
    }
    assert len(giants["bmp"]) < 1100
    for fmt, data in giants.items():
        assert (
            header_size(data, fmt)
            == {
                "bmp": (13500, 13500),
                "tiff": (20000, 20000),
                "webp": (16000, 16000),
            }[fmt]
        )
        for decode in (decode_bgr, decode_rgb):  # the OCR path, the ResNet path
            tracemalloc.start()
            try:
                with pytest.raises(BadSampleError) as raised:
                    decode(data)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert raised.value.kind == "image_too_large", (fmt, raised.value)
            assert peak < 100 << 20, (fmt, peak)


def test_webp_sizes_are_read_from_the_first_chunk_as_pillow_reads_them():
    pixels = np.random.default_rng(0).integers(0, 255, (13, 21, 4), np.uint8)
    rgb, rgba = Image.fromarray(pixels[:, :, :3]), Image.fromarray(pixels)
    seen = set()
    for image, lossless in ((rgb, False), (rgb, True), (rgba, False)):  # VP8, VP8L, VP8X
        buffer = io.BytesIO()
        image.save(buffer, "WEBP", lossless=lossless)
        data = buffer.getvalue()
        seen.add(data[12:16])
        assert header_size(data, "webp") == (21, 13) == Image.open(io.BytesIO(data)).size
    assert seen == {b"VP8 ", b"VP8L", b"VP8X"}


def test_a_header_that_gives_no_size_is_not_decoded_blind():
    # A BMP whose info header is cut off, a PNG whose first chunk is not IHDR: with a budget
    # they are bad samples before any decoder sees them; without one, OpenCV decides.
    good_png = png_bomb(8)
    no_ihdr_first = good_png[:8] + _png_chunk(b"prVt", b"x") + good_png[8:]
    for data in (bmp_rle8_claiming(100, 100)[:30], no_ihdr_first):
        with pytest.raises(BadSampleError) as raised:
            check_encoded(data, max_pixels=40_000_000)
        assert raised.value.kind == "undecodable_image" and "gives no image size" in str(
            raised.value
        )
    assert check_encoded(no_ihdr_first) == "png"
    # A JPEG is the exception: libjpeg-turbo reads the same header first and fails on it.
    with pytest.raises(BadSampleError) as raised:
        decode_bgr(b"\xff\xd8\xff\xe0" + bytes(40) + b"\xff\xd9")
    assert raised.value.kind == "undecodable_image"


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
