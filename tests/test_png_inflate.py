"""PNG records inflated by ISA-L decode to exactly cv2.imdecode's pixels, and everything the fast
path does not handle (interlacing, corruption, too much data, a decompression bomb) falls back
to OpenCV on the original bytes, with the same outcome as before."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from datasets import png_inflate
from datasets.decode import decode_bgr
from datasets.errors import BadSampleError
from datasets.png_inflate import SIGNATURE, with_stored_image_data


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, position = [], len(SIGNATURE)
    while position < len(data):
        (length,) = struct.unpack_from(">I", data, position)
        chunks.append(
            (data[position + 4 : position + 8], data[position + 8 : position + 8 + length])
        )
        position += 12 + length
    return chunks


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    """A PNG from (type, body) pairs, with correct CRCs."""
    out = [SIGNATURE]
    for kind, body in chunks:
        crc = zlib.crc32(body, zlib.crc32(kind))
        out.append(struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc))
    return b"".join(out)


def _cv2_png(image: np.ndarray) -> bytes:
    ok, encoded = cv2.imencode(".png", image)
    assert ok
    return encoded.tobytes()


def _pil_png(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **options)
    return buffer.getvalue()


def _variants() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    # Smooth ramps plus noise: every PNG row filter gets picked somewhere.
    ramp = np.add.outer(np.arange(37), np.arange(121)).astype(np.uint8)
    noisy = (ramp[:, :, None] + rng.integers(0, 40, (37, 121, 3))).astype(np.uint8)
    text = Image.fromarray(noisy[:, :, ::-1])
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "ancillary chunks before and after the image data")
    palette = text.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    big = rng.integers(0, 255, (160, 200, 3), dtype=np.uint8)  # libpng splits its IDAT
    return {
        "bgr8": _cv2_png(noisy),
        "bgr16": _cv2_png(noisy.astype(np.uint16) * 257),
        "bgra8": _cv2_png(np.dstack([noisy, ramp])),
        "grey8": _cv2_png(ramp),
        "grey16": _cv2_png(ramp.astype(np.uint16) * 300),
        "grey_alpha": _pil_png(Image.fromarray(ramp).convert("LA")),
        "palette": _pil_png(palette),
        "palette_transparency": _pil_png(palette, transparency=3),
        "one_bit": _pil_png(Image.fromarray(ramp > 60)),
        "text_chunks": _pil_png(text, pnginfo=info),
        "many_idat": _cv2_png(big),
        "one_pixel": _cv2_png(noisy[:1, :1]),
    }


VARIANTS = _variants()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_pixels_are_opencvs_for_every_kind_of_png(name):
    data = VARIANTS[name]
    inflated = with_stored_image_data(data)
    assert inflated is not None, "the fast path should take this PNG"
    expected = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert np.array_equal(
        cv2.imdecode(np.frombuffer(inflated, np.uint8), cv2.IMREAD_COLOR), expected
    )
    assert np.array_equal(decode_bgr(data), expected)
    # Only the image data changed: every other chunk is there, in its order, byte for byte.
    others = lambda png: [c for c in _chunks(png) if c[0] != b"IDAT"]  # noqa: E731
    assert others(inflated) == others(data)
    assert [kind for kind, _ in _chunks(inflated)].count(b"IDAT") == 1


def test_the_test_images_cover_split_image_data_and_ancillary_chunks():
    assert [k for k, _ in _chunks(VARIANTS["many_idat"])].count(b"IDAT") > 1
    kinds = [k for k, _ in _chunks(VARIANTS["text_chunks"])]
    assert b"tEXt" in kinds and kinds.index(b"tEXt") < kinds.index(b"IDAT")


def _with_ihdr(data: bytes, **fields) -> bytes:
    chunks = _chunks(data)
    names = ("width", "height", "depth", "color", "compression", "filter", "interlace")
    values = dict(zip(names, struct.unpack(">IIBBBBB", chunks[0][1])))
    values.update(fields)
    chunks[0] = (b"IHDR", struct.pack(">IIBBBBB", *values.values()))
    return _png(chunks)


def _with_idat(data: bytes, body: bytes) -> bytes:
    chunks = [c for c in _chunks(data) if c[0] != b"IDAT"]
    return _png([*chunks[:-1], (b"IDAT", body), chunks[-1]])


def _idat(data: bytes) -> bytes:
    return b"".join(body for kind, body in _chunks(data) if kind == b"IDAT")


def _flip_byte(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _idat_crc_at(data: bytes) -> int:
    start = data.index(b"IDAT") - 4
    (length,) = struct.unpack_from(">I", data, start)
    return start + 8 + length


def _left_to_opencv(data: bytes) -> None:
    """The fast path declines, and decode_bgr's outcome is OpenCV's on the original bytes."""
    assert with_stored_image_data(data) is None
    expected = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if expected is None:
        with pytest.raises(BadSampleError, match="undecodable_image"):
            decode_bgr(data)
    else:
        assert np.array_equal(decode_bgr(data), expected)


def test_what_the_fast_path_declines_is_decoded_by_opencv_as_before():
    good = VARIANTS["bgr8"]
    raw = zlib.decompress(_idat(good))
    cases = {
        # Adam7 images are left to libpng (the flag alone: libpng then finds too little data).
        "interlaced": _with_ihdr(good, interlace=1),
        "idat_crc_wrong": _flip_byte(good, _idat_crc_at(good)),  # the data itself is intact
        "idat_body_corrupt": _flip_byte(good, good.index(b"IDAT") + 24),
        "zlib_stream_corrupt": _with_idat(good, _idat(good)[:40] + b"\x00" * 9 + _idat(good)[49:]),
        "too_little_data": _with_idat(good, zlib.compress(raw[: len(raw) // 2])),
        "too_much_data": _with_idat(good, zlib.compress(raw + raw[:500])),
        "junk_after_stream": _with_idat(good, _idat(good) + b"junk"),
        "no_idat": _png([c for c in _chunks(good) if c[0] != b"IDAT"]),
        "chunk_length_past_the_end": good[:8] + b"\x7f\xff\xff\xff" + good[12:],
    }
    for name, data in cases.items():
        try:
            _left_to_opencv(data)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


def test_a_decompression_bomb_in_the_image_data_is_never_inflated_past_the_header(monkeypatch):
    # A 16 x 16 header over image data that inflates to 64 MB: only what the header allows
    # (plus one byte) is ever inflated.
    bomb = _with_idat(
        _with_ihdr(VARIANTS["bgr8"], width=16, height=16), zlib.compress(bytes(64 << 20), 9)
    )
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        assert with_stored_image_data(bomb) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20


def test_images_over_the_inflated_size_limit_go_to_opencv_whole(monkeypatch):
    data = VARIANTS["many_idat"]
    monkeypatch.setattr(png_inflate, "MAX_INFLATED_BYTES", 1000)
    _left_to_opencv(data)


def test_the_rewritten_image_data_is_stored_and_long_data_spans_blocks():
    stored = png_inflate._stored_zlib(bytes(range(256)) * 600)  # 153,600 bytes: 3 blocks
    assert stored[:2] == b"\x78\x01" and zlib.decompress(stored) == bytes(range(256)) * 600
    assert zlib.decompress(png_inflate._stored_zlib(b"")) == b""


def _filtered_png(rgb: np.ndarray, filters: list[int], extra: list[tuple[bytes, bytes]] = ()):
    """An 8-bit RGB (or grey, for a 2-d array) PNG whose row ``y`` uses PNG filter
    ``filters[y]`` (0 None, 1 Sub, 2 Up), with ``extra`` chunks before the image data."""
    image = rgb.astype(np.int16).reshape(rgb.shape[0], rgb.shape[1], -1)
    height, width, channels = image.shape
    rows = []
    for y, kind in enumerate(filters):
        row = image[y]
        if kind == 1:
            row = row - np.vstack([np.zeros((1, channels), np.int16), image[y, :-1]])
        elif kind == 2:
            row = row - (image[y - 1] if y else 0)
        rows.append(bytes([kind]) + (row % 256).astype(np.uint8).tobytes())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2 if channels == 3 else 0, 0, 0, 0)
    idat = zlib.compress(b"".join(rows))
    return _png([(b"IHDR", ihdr), *extra, (b"IDAT", idat), (b"IEND", b"")])


def _unfiltered_by_numpy(data: bytes) -> bool:
    parsed = png_inflate._split_chunks(data)
    rows = png_inflate._inflated_rows(parsed)
    return png_inflate._unfiltered_here(parsed, rows) is not None


def test_opencvs_sub_filtered_pngs_are_unfiltered_without_libpng():
    # OpenCV's encoder filters every row with Sub: its 8-bit grey and colour PNGs never reach
    # libpng; PIL's adaptive filters do, as does everything that is not 8-bit grey or RGB.
    for name in ("bgr8", "grey8", "many_idat", "one_pixel"):
        assert _unfiltered_by_numpy(VARIANTS[name]), name
    for name in ("bgr16", "bgra8", "grey16", "grey_alpha", "palette", "one_bit", "text_chunks"):
        assert not _unfiltered_by_numpy(VARIANTS[name]), name
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (9, 23, 3), dtype=np.uint8)
    grey = rng.integers(0, 256, (9, 23), dtype=np.uint8)
    passive = [(b"gAMA", struct.pack(">I", 45455)), (b"tEXt", b"Comment\x00hello")]
    cases = {
        "all Sub": (_filtered_png(rgb, [1] * 9), True),
        "all None": (_filtered_png(rgb, [0] * 9), True),
        "None and Sub mixed": (_filtered_png(rgb, [0, 1, 1, 0, 1, 0, 0, 1, 1]), True),
        "grey, mixed": (_filtered_png(grey, [1, 0] * 4 + [1]), True),
        "passive chunks": (_filtered_png(rgb, [1] * 9, passive), True),
        "one Up row": (_filtered_png(rgb, [1] * 4 + [2] + [1] * 4), False),
        "a tRNS chunk": (_filtered_png(rgb, [1] * 9, [(b"tRNS", bytes(6))]), False),
        "an unknown chunk": (_filtered_png(rgb, [1] * 9, [(b"prVt", b"x")]), False),
    }
    for name, (data, by_numpy) in cases.items():
        assert _unfiltered_by_numpy(data) == by_numpy, name
        expected = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert expected is not None, name
        assert np.array_equal(decode_bgr(data), expected), name


def test_a_wrong_crc_outside_the_image_data_leaves_the_file_to_libpng():
    # libpng stops at a critical chunk's wrong CRC (IHDR, IEND): the numpy path must not decode
    # such a file into pixels; OpenCV's outcome on the original bytes stands.
    good = VARIANTS["bgr8"]
    assert _unfiltered_by_numpy(good)
    ihdr_crc_at = len(SIGNATURE) + 8 + 13
    iend_crc_at = len(good) - 4
    # A tEXt chunk spliced in right after IHDR (which ends at byte 33), and its CRC.
    with_text = good[:33] + _png([(b"tEXt", b"Comment\x00x")])[8:] + good[33:]
    text_crc_at = 33 + 8 + len(b"Comment\x00x")
    for name, data in {
        "IHDR": _flip_byte(good, ihdr_crc_at),
        "IEND": _flip_byte(good, iend_crc_at),
        "tEXt": _flip_byte(with_text, text_crc_at),
    }.items():
        parsed = png_inflate._split_chunks(data)
        if parsed is not None:
            assert png_inflate._unfiltered_here(parsed, png_inflate._inflated_rows(parsed)) is None
        expected = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if expected is None:
            with pytest.raises(BadSampleError, match="undecodable_image"):
                decode_bgr(data)
        else:
            assert np.array_equal(decode_bgr(data), expected), name


@pytest.mark.parametrize("channels", [1, 3])
def test_running_sums_from_the_integral_image_wrap_as_the_filter_does(channels, monkeypatch):
    # The Sub filter's undo is a running sum per row and channel modulo 256. OpenCV's integral
    # image gives it from int32 sums (which here reach 255 * 300 * 700 * 3, far past 256): the
    # low byte must equal numpy's uint8 running sum, for views with a filter byte per row as
    # _unfiltered_here passes them, and an image too big for exact int32 sums takes numpy's way.
    rng = np.random.default_rng(channels)
    height, width = 300, 700
    table = rng.integers(0, 256, (height, 1 + width * channels), dtype=np.uint8)
    filtered = table[:, 1:].reshape(height, width, channels)
    expected = np.add.accumulate(filtered, axis=1, dtype=np.uint8)
    assert np.array_equal(png_inflate._running_sums_mod_256(filtered), expected)
    assert np.array_equal(png_inflate._running_sums_mod_256(filtered[:1, :1]), filtered[:1, :1])
    calls = []
    monkeypatch.setattr(png_inflate.cv2, "integral", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(png_inflate, "_INT32_LIMIT", 255 * height * width * channels)
    assert np.array_equal(png_inflate._running_sums_mod_256(filtered), expected)
    assert not calls  # numpy's way, not the integral image


def test_an_ihdr_shorter_than_13_bytes_is_a_bad_sample_not_a_crash():
    # IHDR's length field says 8 (width and height only); the 4 bytes read as its CRC then
    # read as depth 8, colour 2, compression 0, filter 0, and a valid IDAT follows. Unpacking
    # the 13-byte header from the 8-byte chunk raised struct.error, which ended the run.
    good = VARIANTS["bgr8"]
    width, height = struct.unpack_from(">II", good, 16)
    crafted = (
        SIGNATURE
        + struct.pack(">I", 8)
        + b"IHDR"
        + struct.pack(">II", width, height)
        + b"\x08\x02\x00\x00"
        + good[33:]
    )
    assert png_inflate.decode(crafted) is None
    _left_to_opencv(crafted)  # libpng: "IHDR: invalid"; a bad sample of kind undecodable_image


class _Bits:
    """Deflate's bit order (RFC 1951 3.1.1): fields least significant bit first, Huffman codes
    most significant bit first."""

    def __init__(self) -> None:
        self.value, self.count = 0, 0

    def put(self, value: int, count: int) -> None:
        self.value |= value << self.count
        self.count += count

    def put_code(self, code: int, length: int) -> None:
        self.put(int(format(code, f"0{length}b")[::-1], 2), length)


def _canonical(lengths: list[int]) -> dict[int, tuple[int, int]]:
    """symbol -> (code, length) of the canonical Huffman code of ``lengths`` (RFC 1951 3.2.2),
    whether or not they make a complete code."""
    codes, code = {}, 0
    for length in range(1, 16):
        for symbol, each in enumerate(lengths):
            if each == length:
                codes[symbol] = (code, length)
                code += 1
        code <<= 1
    return codes


_CODE_LENGTH_ORDER = (16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15)


def _dynamic_zlib(raw: bytes, literals: dict[int, int], distances: list[int], code_lengths=None):
    """A zlib stream of one dynamic-Huffman block holding ``raw`` as literals, with the given
    literal/length code lengths (symbol -> length), distance code lengths and code-length code
    lengths (default: 4 bits for 0..15, a complete code)."""
    code_lengths = code_lengths or [4] * 16 + [0, 0, 0]
    lit = [0] * 257
    for symbol, length in literals.items():
        lit[symbol] = length
    bits = _Bits()
    bits.put(1, 1)  # final block
    bits.put(2, 2)  # dynamic Huffman codes
    bits.put(len(lit) - 257, 5)
    bits.put(len(distances) - 1, 5)
    bits.put(19 - 4, 4)
    for symbol in _CODE_LENGTH_ORDER:
        bits.put(code_lengths[symbol], 3)
    length_code = _canonical(code_lengths)
    for length in (*lit, *distances):
        bits.put_code(*length_code[length])
    literal_code = _canonical(lit)
    for byte in (*raw, 256):
        bits.put_code(*literal_code[byte])
    body = bits.value.to_bytes((bits.count + 7) // 8, "little")
    return b"\x78\x01" + body + struct.pack(">I", zlib.adler32(raw))


def _with_cinfo(stream: bytes, cinfo: int) -> bytes:
    """The zlib stream with its window field set (and FCHECK fixed, so the header is valid)."""
    cmf, flg = cinfo << 4 | 8, stream[1] & 0xE0
    return bytes([cmf, flg | (31 - (cmf * 256 + flg) % 31) % 31]) + stream[2:]


def _grey_png(width: int, height: int, stream: bytes) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return _png([(b"IHDR", ihdr), (b"IDAT", stream), (b"IEND", b"")])


def test_zlib_streams_that_libpng_rejects_are_left_to_it():
    # ISA-L inflates every one of these; libpng's zlib rejects all but the last, whose copy
    # past its window stays inside one row (one inflate call): the fast path declines them all
    # and OpenCV's outcome on the original bytes stands.
    rng = np.random.default_rng(3)
    raw = bytes([0, 10, 20, 10, 0, 20, 20, 10])  # 2 rows of 3 grey pixels, filter None
    complete = {0: 2, 10: 2, 20: 2, 256: 2}
    row = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
    repeated_rows = (b"\x00" + row) * 4  # each row a copy of the one before: distance 301
    one_row = b"\x00" + row * 4  # copies at distance 300 inside the row
    cases = {
        "window field 8 (64 KB)": _grey_png(300, 4, _with_cinfo(zlib.compress(repeated_rows), 8)),
        "copy across rows past a 256-byte window": _grey_png(
            300, 4, _with_cinfo(zlib.compress(repeated_rows), 0)
        ),
        "incomplete literal/length code": _grey_png(
            3, 2, _dynamic_zlib(raw, {0: 2, 10: 2, 20: 3, 256: 2}, [1])
        ),
        "incomplete distance code": _grey_png(3, 2, _dynamic_zlib(raw, complete, [2, 2])),
        "incomplete code-length code": _grey_png(
            3, 2, _dynamic_zlib(raw, complete, [1], [4] * 15 + [0] * 4)
        ),
        "copy inside one row past a 256-byte window": _grey_png(
            1200, 1, _with_cinfo(zlib.compress(one_row), 0)
        ),
    }
    for name, data in cases.items():
        expected = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert (expected is None) == (name != "copy inside one row past a 256-byte window"), name
        try:
            _left_to_opencv(data)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
    # The same rows with complete codes, and a small window that holds all the rows (what
    # libpng's encoder writes for small images), still take the fast path.
    for data in (
        _grey_png(3, 2, _dynamic_zlib(raw, complete, [1])),
        _grey_png(3, 2, _dynamic_zlib(raw, complete, [1, 1])),
        _grey_png(3, 2, _dynamic_zlib(raw, complete, [0])),
        _grey_png(60, 4, _with_cinfo(zlib.compress((b"\x00" + row[:60]) * 4), 0)),
    ):
        assert with_stored_image_data(data) is not None
        expected = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert np.array_equal(decode_bgr(data), expected)
    assert VARIANTS["grey8"][_idat_at(VARIANTS["grey8"])] >> 4 < 7  # libpng's small window


def _idat_at(data: bytes) -> int:
    return data.index(b"IDAT") + 4


def test_bytes_after_iend_are_ignored_as_opencv_and_pillow_ignore_them():
    # The IEND check once looked only at the last 64 bytes: 61 or more bytes after IEND made a
    # valid PNG a truncated one.
    good = VARIANTS["bgr8"]
    expected = cv2.imdecode(np.frombuffer(good, np.uint8), cv2.IMREAD_COLOR)
    for extra in (b"\0" * 61, bytes(range(256)) * 4, b"IEND" + b"x" * 100):
        data = good + extra
        assert np.array_equal(cv2.imdecode(np.frombuffer(data, np.uint8), 1), expected)
        Image.open(io.BytesIO(data)).load()
        assert np.array_equal(decode_bgr(data), expected), len(extra)
    with pytest.raises(BadSampleError, match="truncated_image"):
        decode_bgr(good[:-12] + b"\0" * 100)  # no IEND at all is still truncated


def test_a_chunk_longer_than_the_file_is_refused_before_libpng_allocates_it(monkeypatch):
    # libpng allocates an ancillary chunk's claimed length before reading it: this 600-byte
    # file made cv2.imdecode touch 2 GB and take 8 s to return None. OpenCV never sees it now.
    good = VARIANTS["bgr8"]
    text = _png([(b"tEXt", b"Comment\x00x")])[8:]
    crafted = good[:33] + struct.pack(">I", 2**31 - 1) + text[4:] + good[33:]
    calls = []
    monkeypatch.setattr(cv2, "imdecode", lambda *args: calls.append(args))
    with pytest.raises(BadSampleError, match="undecodable_image.*past the end"):
        decode_bgr(crafted)
    assert not calls
