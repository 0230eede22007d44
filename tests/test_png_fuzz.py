"""A differential fuzz of the PNG decode path against the library reference, cv2.imdecode.

Valid PNGs written by cv2.imencode and Pillow (grey, grey + alpha, RGB, RGBA, palette, 1 and 16
bits, OpenCV's five zlib strategies, Pillow's adaptive filters, every ancillary chunk the numpy
unfilter reads past, image data split over several IDAT chunks) are mutated at the byte level:
bit flips and byte writes anywhere, in the image data, in the zlib header; chunk lengths and
CRCs; IHDR fields (the IHDR length too); truncation; bytes inserted, deleted, or appended after
IEND. Half the cases then get every chunk's CRC recomputed, or nearly every mutation would stop
at libpng's CRC check and the inflate and the rows behind it would go untested.

For each case the rule is: ``decode_bgr`` (what every OCR sample goes through) raises
BadSampleError or returns exactly cv2.imdecode's pixels (a bad sample wherever OpenCV returns
None), and the ISA-L fast path (``png_inflate.decode``) returns cv2.imdecode's pixels or None;
neither raises anything else.

PNG_FUZZ_CASES sets the number of cases (default 30000, sized to stay well under 30 s on one
core) and PNG_FUZZ_SEED the seed (default 0); a failure names both, and the case's index, which
together rebuild the file. docs/reliability.md gives the longer run.
"""

from __future__ import annotations

import io
import os
import struct
import time
import zlib

import cv2
import numpy as np
from PIL import Image, PngImagePlugin

from datasets import png_inflate
from datasets.decode import decode_bgr
from datasets.errors import BadSampleError
from datasets.png_inflate import SIGNATURE

CASES = int(os.environ.get("PNG_FUZZ_CASES", "30000"))
SEED = int(os.environ.get("PNG_FUZZ_SEED", "0"))


def _cv2(image: np.ndarray, *params: int) -> bytes:
    ok, encoded = cv2.imencode(".png", image, list(params))
    assert ok
    return encoded.tobytes()


def _pil(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **options)
    return buffer.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(kind))
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def _split_idat(data: bytes, pieces: int) -> bytes:
    """The same PNG with its image data over ``pieces`` IDAT chunks."""
    at = data.index(b"IDAT") - 4
    (length,) = struct.unpack_from(">I", data, at)
    stream = data[at + 8 : at + 8 + length]
    step = -(-len(stream) // pieces)
    idats = b"".join(_chunk(b"IDAT", stream[i : i + step]) for i in range(0, len(stream), step))
    return data[:at] + idats + data[at + 12 + length :]


def _with_passive_chunks(data: bytes) -> bytes:
    """OpenCV's PNG with every chunk the numpy unfilter reads past (gAMA, cHRM, sRGB, pHYs,
    tIME, zTXt, iTXt before the image data, tEXt after it), so their mutations reach it."""
    before = b"".join(
        _chunk(kind, body)
        for kind, body in (
            (b"gAMA", struct.pack(">I", 45455)),
            (b"cHRM", struct.pack(">8I", 31270, 32900, 64000, 33000, 30000, 60000, 15000, 6000)),
            (b"sRGB", b"\x00"),
            (b"pHYs", struct.pack(">IIB", 2835, 2835, 1)),
            (b"tIME", struct.pack(">HBBBBB", 2024, 5, 6, 7, 8, 9)),
            (b"zTXt", b"Comment\x00\x00" + zlib.compress(b"compressed text")),
            (b"iTXt", b"Title\x00\x00\x00en\x00Title\x00text"),
        )
    )
    at = data.index(b"IDAT") - 4
    iend = data.rindex(b"IEND") - 4
    return data[:at] + before + data[at:iend] + _chunk(b"tEXt", b"After\x00idat") + data[iend:]


def _seeds() -> list[bytes]:
    rng = np.random.default_rng(12345)
    ramp = np.add.outer(np.arange(11) * 7, np.arange(17) * 3).astype(np.uint8)
    noisy = (ramp[:, :, None] + rng.integers(0, 60, (11, 17, 3))).astype(np.uint8)
    flat = np.full((6, 9, 3), 200, np.uint8)
    strategy = cv2.IMWRITE_PNG_STRATEGY
    seeds = [
        _cv2(noisy),
        _cv2(ramp),
        _cv2(flat),
        _cv2(noisy[:1, :1]),
        _cv2(np.dstack([noisy, ramp])),
        _cv2(noisy.astype(np.uint16) * 257),
        _cv2(noisy, cv2.IMWRITE_PNG_COMPRESSION, 0),  # stored blocks
        _cv2(noisy, cv2.IMWRITE_PNG_COMPRESSION, 9),
        _cv2(ramp, strategy, cv2.IMWRITE_PNG_STRATEGY_FILTERED),
        _cv2(noisy, strategy, cv2.IMWRITE_PNG_STRATEGY_HUFFMAN_ONLY),
        _cv2(noisy, strategy, cv2.IMWRITE_PNG_STRATEGY_RLE),
        _cv2(noisy, strategy, cv2.IMWRITE_PNG_STRATEGY_FIXED),
        _split_idat(_cv2(noisy), 3),
        _with_passive_chunks(_cv2(noisy)),
        _with_passive_chunks(_cv2(ramp)),
    ]
    rgb = Image.fromarray(noisy[:, :, ::-1])
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "x")
    seeds += [
        _pil(rgb),  # adaptive filters: Up, Average, Paeth rows
        _pil(rgb, optimize=True),
        _pil(Image.fromarray(ramp)),
        _pil(Image.fromarray(ramp).convert("LA")),
        _pil(rgb.convert("RGBA")),
        _pil(rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)),
        _pil(rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=8), transparency=2),
        _pil(Image.fromarray(ramp > 60)),
        _pil(rgb, pnginfo=info),
        _split_idat(_pil(Image.fromarray(ramp), compress_level=1), 2),
    ]
    return seeds


SEEDS = _seeds()


def _chunk_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each whole chunk, following the lengths from the signature."""
    spans, position = [], len(SIGNATURE)
    while position + 12 <= len(data):
        (length,) = struct.unpack_from(">I", data, position)
        end = position + 12 + length
        if end > len(data):
            break
        spans.append((position, end))
        position = end
    return spans


def _with_crcs(data: bytes) -> bytes:
    out = bytearray(data)
    for start, end in _chunk_spans(data):
        out[end - 4 : end] = struct.pack(">I", zlib.crc32(data[start + 4 : end - 4]))
    return bytes(out)


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    spans = _chunk_spans(data)
    idats = [s for s in spans if data[s[0] + 4 : s[0] + 8] == b"IDAT"]
    kind = int(rng.integers(11))
    if kind == 0:  # bit flips anywhere
        for at in rng.integers(0, len(out), int(rng.integers(1, 4))):
            out[at] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # bit flips in the image data (the inflate and the rows behind it)
        start, end = idats[int(rng.integers(len(idats)))]
        for _ in range(int(rng.integers(1, 3))):
            at = int(rng.integers(start + 8, max(start + 9, end - 4)))
            out[at] ^= 1 << int(rng.integers(8))
    elif kind == 2:  # the zlib header (CMF: window and method; FLG: check bits, dictionary)
        at = idats[0][0] + 8 + int(rng.integers(2))
        flip = 16 << int(rng.integers(4))  # one bit of CINFO
        out[at] = int(rng.integers(256)) if rng.random() < 0.5 else out[at] ^ flip
    elif kind == 3:  # an IHDR field
        field, value = [
            (16, struct.pack(">I", int(rng.choice([0, 1, 2, 255, 1 << 20, 2**31, 2**32 - 1])))),
            (20, struct.pack(">I", int(rng.choice([0, 1, 3, 1000, 1_000_001, 2**31])))),
            (24, bytes([int(rng.choice([0, 1, 2, 3, 4, 7, 8, 16, 255]))])),  # bit depth
            (25, bytes([int(rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 255]))])),  # colour type
            (26, bytes([int(rng.integers(3))])),  # compression
            (27, bytes([int(rng.integers(3))])),  # filter method
            (28, bytes([int(rng.integers(3))])),  # interlace
        ][int(rng.integers(7))]
        out[field : field + len(value)] = value
    elif kind == 4:  # a chunk's length field
        start, _ = spans[int(rng.integers(len(spans)))]
        (length,) = struct.unpack_from(">I", out, start)
        new = int(rng.choice([0, length - 1, length + 1, length + 4, 2**31 - 1, 2**32 - 1]))
        out[start : start + 4] = struct.pack(">I", new % 2**32)
    elif kind == 5:  # the IHDR cut short (its length field and body together), then the rest
        length = int(rng.integers(13))
        out = bytearray(data[:8] + struct.pack(">I", length) + b"IHDR" + data[16 : 16 + length])
        out += data[29 : 33 if rng.random() < 0.5 else 29] + data[33:]
    elif kind == 6:  # a chunk's CRC
        _, end = spans[int(rng.integers(len(spans)))]
        out[end - 4 : end] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
    elif kind == 7:  # truncated
        del out[int(rng.integers(8, len(out))) :]
    elif kind == 8:  # bytes after IEND: a few, or more than the 64 the IEND search once covered
        out += rng.integers(0, 256, int(rng.choice([1, 12, 61, 100, 300])), np.uint8).tobytes()
    elif kind == 9:  # bytes inserted or deleted
        at = int(rng.integers(8, len(out)))
        if rng.random() < 0.5:
            out[at:at] = rng.integers(0, 256, int(rng.integers(1, 5)), np.uint8).tobytes()
        else:
            del out[at : at + int(rng.integers(1, 5))]
    else:  # random byte values
        for at in rng.integers(8, len(out), int(rng.integers(1, 4))):
            out[at] = int(rng.integers(256))
    mutated = bytes(out)
    # After kinds 3 and 5 the CRCs are usually recomputed: a wrong IHDR CRC stops libpng first.
    if rng.random() < (0.8 if kind in (3, 5) else 0.5) and kind != 6:
        mutated = _with_crcs(mutated)
    return mutated


def _opencv(data: bytes) -> np.ndarray | None:
    try:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    except cv2.error:
        return None
    return image if image is not None and image.size else None


def _check(data: bytes, where: str, counts: dict[str, int]) -> None:
    fast = png_inflate.decode(data)  # never raises: any exception fails the test here
    try:
        pixels = decode_bgr(data)
    except BadSampleError as error:
        if "past the end" in error.reason:
            # A chunk longer than the file: libpng would allocate its claimed length (up to
            # 4 GB) before failing, so OpenCV is not asked. Nothing decoded it here either.
            assert fast is None, f"{where}: the fast path decoded a chunk past the end"
            counts["bad sample"] += 1
            return
        pixels = None
    expected = _opencv(data)
    if fast is not None:
        assert expected is not None, f"{where}: the fast path decoded what OpenCV refuses"
        assert np.array_equal(fast, expected), f"{where}: the fast path's pixels differ"
        counts["fast path"] += 1
    if pixels is None:
        counts["bad sample, OpenCV decodes" if expected is not None else "bad sample"] += 1
        return
    assert expected is not None, f"{where}: decode_bgr decoded what OpenCV refuses"
    assert np.array_equal(pixels, expected), f"{where}: decode_bgr's pixels differ from OpenCV's"
    counts["pixels"] += 1


def test_the_seeds_decode_to_opencvs_pixels():
    for n, data in enumerate(SEEDS):
        expected = _opencv(data)
        assert expected is not None, n
        assert np.array_equal(decode_bgr(data), expected), n


def test_mutated_pngs_are_bad_samples_or_opencvs_pixels():
    counts = dict.fromkeys(("pixels", "fast path", "bad sample", "bad sample, OpenCV decodes"), 0)
    started = time.perf_counter()
    for case in range(CASES):
        rng = np.random.default_rng([SEED, case])
        seed = SEEDS[int(rng.integers(len(SEEDS)))]
        data = _mutate(seed, rng)
        _check(data, f"PNG_FUZZ_SEED={SEED} case {case} ({len(data)} bytes)", counts)
    elapsed = time.perf_counter() - started
    print(f"{CASES} cases in {elapsed:.1f} s: {counts}")
    # Not vacuous: mutated files reach pixels, the fast path, and bad samples.
    assert counts["pixels"] > CASES // 20 and counts["fast path"] > CASES // 50, counts
    assert counts["bad sample"] > CASES // 10, counts
