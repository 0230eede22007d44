"""PNG image data inflated by ISA-L, then unfiltered by numpy or handed to libpng inflated.

A text-line PNG spends three quarters of ``cv2.imdecode`` in zlib's inflate (0.30 of 0.41 ms on
the benchmark's records); ISA-L's inflate does the same work in 0.11 ms. OpenCV has no way to
take inflated PNG rows, so ``with_stored_image_data`` rewrites the file: the IDAT chunks become
one IDAT whose zlib stream holds the same bytes in *stored* (uncompressed) deflate blocks, which
libpng "inflates" by copying. Everything else (unfiltering, palettes, transparency, 16-bit and
grey conversion, ancillary chunks) is still libpng's, so the pixels are exactly
``cv2.imdecode``'s on the original bytes; tests/test_png_inflate.py checks that per PNG variant.

The commonest text-line PNG needs no libpng at all: OpenCV's encoder filters every row with
``Sub`` (each byte stored as the difference from the same channel of the pixel to its left), and
for an 8-bit grey or RGB image whose rows are all ``None`` or ``Sub``, ``decode`` undoes that
with running sums per row (from OpenCV's integral image) and converts to BGR itself. It takes
that way only for well-formed files (every chunk's CRC right, only ancillary chunks that change
nothing in what ``cv2.imdecode`` returns, sizes within libpng's limits), so its pixels are
libpng's; the other filters (Up, Average, Paeth, which PIL and most other encoders mix per row)
go through the rewrite.

Whatever this module does not handle returns None and the caller decodes the original bytes:
interlaced images, images whose inflated data is over ``MAX_INFLATED_BYTES`` (the rewrite holds
up to three copies of it at once: the rows, the new chunk, the new file), and every malformed
file (bad chunk layout or IDAT CRC, an IHDR that is not 13 bytes, a zlib error, too much or
too little data), so OpenCV classifies those exactly as before.

ISA-L is more lenient than zlib, which libpng inflates with, so the zlib stream is checked
against what zlib rejects before ISA-L's rows are used: a window field (CINFO) above 7 (32 KB);
a window smaller than 32 KB and than the inflated rows (libpng's zlib rejects a copy reaching
further back than the window across an inflate call, and it calls once per row; libpng's own
encoder picks the smallest window that holds all the rows, so its files pass); and the first
block's Huffman codes, which zlib inflates on the stream's first ``_HEADER_BYTES`` bytes
(ISA-L accepts incomplete codes, zlib rejects all but a single one-bit code). An incomplete code
in a later block of a multi-block stream is not looked for: finding that block's header means
decoding the stream before it, the zlib inflate this module saves. No encoder writes one, and a
corruption that makes one changes the rows, which the stream's Adler-32 then rejects, so only a
crafted stream decodes here where libpng would refuse it, to the pixels its codes give.
"""

from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np
from isal import isal_zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Samples per pixel of each PNG colour type (grey, RGB, palette, grey + alpha, RGBA).
_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# 16 MB of filtered rows: a 2300 x 2300 RGB image; text lines are 10-100 KB.
MAX_INFLATED_BYTES = 16 << 20
_STORED_BLOCK = 0xFFFF  # the largest stored deflate block
_ZLIB_HEADER = (
    b"\x78\x01"  # deflate, 32 KB window, no preset dictionary (CMF * 256 + FLG % 31 == 0)
)
# Chunks that may sit beside the image data of a PNG decoded without libpng: libpng only reads
# them (cv2.imdecode asks for no gamma or colour-management transform), so the pixels do not
# depend on them. tRNS, PLTE, sBIT, bKGD, iCCP and unknown chunks send the file to libpng.
_PASSIVE_CHUNKS = frozenset(
    {b"IEND", b"gAMA", b"cHRM", b"sRGB", b"pHYs", b"tEXt", b"zTXt", b"iTXt", b"tIME"}
)
_LIBPNG_MAX_SIDE = 1_000_000  # libpng's default PNG_USER_WIDTH_MAX and PNG_USER_HEIGHT_MAX
_NONE, _SUB = 0, 1  # PNG row filter types
_INT32_LIMIT = 2**31
_IHDR_LENGTH = b"\0\0\0\x0d"  # libpng rejects an IHDR chunk of any other length
_MAX_CINFO = 7  # a 32 KB window, zlib's largest
# The longest dynamic block header (3 + 14 + 19 * 3 + 316 * 7 bits: 286 bytes) after the
# 2-byte zlib header, with room for the first symbols.
_HEADER_BYTES = 320


def decode(data: bytes) -> np.ndarray | None:
    """``cv2.imdecode(data, IMREAD_COLOR)``'s pixels of a PNG, decoded with ISA-L's inflate (and
    numpy's running sum where the rows allow it), or None when the original bytes should be
    given to OpenCV as they are (see the module docstring)."""
    parsed = _split_chunks(data)
    if parsed is None:
        return None
    rows = _inflated_rows(parsed)
    if rows is None:
        return None
    pixels = _unfiltered_here(parsed, rows)
    if pixels is not None:
        return pixels
    stored = _with_stored_rows(parsed, rows)
    try:
        image = cv2.imdecode(np.frombuffer(stored, dtype=np.uint8), cv2.IMREAD_COLOR)
    except cv2.error:  # the caller's decode of the original bytes classifies it
        return None
    return image if image is not None and image.size else None


def with_stored_image_data(data: bytes) -> bytes | None:
    """``data`` (a PNG) with its image data inflated and re-stored uncompressed, or None when
    the original should be decoded as it is (see the module docstring)."""
    parsed = _split_chunks(data)
    if parsed is None:
        return None
    rows = _inflated_rows(parsed)
    return None if rows is None else _with_stored_rows(parsed, rows)


def _with_stored_rows(parsed, rows: bytes) -> bytes:
    """The PNG again, its IDAT chunks replaced by one holding ``rows`` in stored blocks."""
    before, _, after, _ = parsed
    return b"".join((SIGNATURE, *before, _chunk(b"IDAT", _stored_zlib(rows)), *after))


def _inflated_rows(parsed) -> bytes | None:
    """The filtered rows the IDAT chunks inflate to, or None unless they inflate to exactly the
    size the header gives, ending the zlib stream."""
    _, idat_bodies, _, expected = parsed
    stream = b"".join(idat_bodies)
    if not _zlib_would_inflate(stream, expected):
        return None
    inflater = isal_zlib.decompressobj()
    try:
        # max_length bounds the output: trailing junk cannot inflate past what the header says.
        rows = inflater.decompress(stream, expected + 1)
    except isal_zlib.error:
        return None
    if len(rows) != expected or not inflater.eof or inflater.unused_data:
        return None
    return rows


def _zlib_would_inflate(stream: bytes, expected: int) -> bool:
    """False where libpng's zlib would reject a stream that ISA-L inflates (module docstring):
    a window field over 7, a window under 32 KB smaller than the ``expected`` rows, a bad zlib
    header or a bad first block header (zlib inflates at most one byte past it)."""
    if len(stream) < 2:
        return False
    cinfo = stream[0] >> 4
    if cinfo > _MAX_CINFO or (cinfo < _MAX_CINFO and expected > 1 << (cinfo + 8)):
        return False
    try:
        zlib.decompressobj().decompress(stream[: 2 + _HEADER_BYTES], 1)
    except zlib.error:
        return False
    return True


def _unfiltered_here(parsed, rows: bytes) -> np.ndarray | None:
    """BGR pixels of an 8-bit grey or RGB PNG whose rows are all filtered None or Sub, unfiltered
    with numpy, or None when libpng should do it (another filter, another kind of image, or
    anything libpng might reject or act on: a chunk outside _PASSIVE_CHUNKS, a wrong CRC)."""
    before, _, after, _ = parsed
    ihdr = before[0]
    if len(ihdr) != 25 or not after or bytes(after[-1][:8]) != b"\0\0\0\0IEND":
        return None
    width, height, depth, color, compression, filter_method, _ = struct.unpack_from(
        ">IIBBBBB", ihdr, 8
    )
    if depth != 8 or color not in (0, 2) or compression != 0 or filter_method != 0:
        return None
    if not 1 <= width <= _LIBPNG_MAX_SIDE or not 1 <= height <= _LIBPNG_MAX_SIDE:
        return None
    for chunk in (*before, *after):
        kind = bytes(chunk[4:8])
        if chunk is not ihdr and kind not in _PASSIVE_CHUNKS:
            return None
        (crc,) = struct.unpack_from(">I", chunk, len(chunk) - 4)
        if isal_zlib.crc32(chunk[4:-4]) != crc:
            return None
    channels = _SAMPLES[color]
    # Each row's first byte is its filter type; a bytes slice reads them all at C speed (two
    # numpy reductions over them cost more than the CRCs above).
    filters = rows[:: 1 + width * channels]
    if max(filters) > _SUB:
        return None
    table = np.frombuffer(rows, dtype=np.uint8).reshape(height, 1 + width * channels)
    filtered = table[:, 1:].reshape(height, width, channels)
    pixels = _running_sums_mod_256(filtered)
    if _NONE in filters:
        unfiltered_rows = table[:, 0] == _NONE
        pixels[unfiltered_rows] = filtered[unfiltered_rows]
    if channels == 1:
        return cv2.cvtColor(pixels[:, :, 0], cv2.COLOR_GRAY2BGR)
    return cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR)


def _running_sums_mod_256(filtered: np.ndarray) -> np.ndarray:
    """Each row's running sum per channel, modulo 256: the pixels of Sub-filtered rows (each
    byte is stored minus the same channel's byte one pixel to the left, modulo 256).

    OpenCV's integral image gives the running sums of a whole image in one SIMD pass; a row's
    running sum is the difference of two consecutive rows of it. That is 0.05 ms a benchmark
    text line, where numpy's running sum along the row (``np.add.accumulate(axis=1)``, which
    steps through the channels one element at a time) takes 0.08. The int32 sums stay exact
    while the whole image sums to less than 2**31, so bigger images take numpy's way."""
    height, width = filtered.shape[:2]
    if height * width * filtered.shape[2] * 255 >= _INT32_LIMIT:
        return np.add.accumulate(filtered, axis=1, dtype=np.uint8)
    sums = cv2.integral(filtered, sdepth=cv2.CV_32S)  # (height + 1) x (width + 1) x channels
    rows = sums[1:, 1:] - sums[:-1, 1:]
    # uint8 of an int32 keeps its low byte: the sum modulo 256, as the filter wraps.
    return rows.astype(np.uint8).reshape(filtered.shape)


def _split_chunks(data: bytes):
    """(chunks before the first IDAT, IDAT bodies, chunks after the last, inflated size) of a
    well-formed non-interlaced PNG whose IDAT CRCs hold, else None. The other chunks are kept
    whole, with their CRCs, for libpng to check."""
    view = memoryview(data)
    if not data.startswith(SIGNATURE) or data[8:16] != _IHDR_LENGTH + b"IHDR" or len(data) < 33:
        return None
    width, height, depth, color, _, _, interlace = struct.unpack_from(">IIBBBBB", data, 16)
    if interlace != 0 or color not in _SAMPLES:
        return None
    expected = height * (1 + (width * _SAMPLES[color] * depth + 7) // 8)
    if expected > MAX_INFLATED_BYTES:
        return None
    before, idat, after = [], [], []
    position = len(SIGNATURE)
    while position + 12 <= len(data):
        (length,) = struct.unpack_from(">I", data, position)
        end = position + 12 + length
        if end > len(data):
            return None
        kind = data[position + 4 : position + 8]
        if kind == b"IDAT":
            if after:  # IDAT chunks must be consecutive; libpng rejects this file
                return None
            body = view[position + 8 : end - 4]
            (crc,) = struct.unpack_from(">I", data, end - 4)
            if isal_zlib.crc32(body, isal_zlib.crc32(kind)) != crc:
                return None
            idat.append(body)
        else:
            (after if idat else before).append(view[position:end])
        position = end
        if kind == b"IEND":
            break
    if not idat:
        return None
    return before, idat, after, expected


def _stored_zlib(raw: bytes) -> bytes:
    """A zlib stream holding ``raw`` in stored deflate blocks (RFC 1950/1951)."""
    parts = [_ZLIB_HEADER]
    view = memoryview(raw)
    start = 0
    while True:
        block = view[start : start + _STORED_BLOCK]
        start += len(block)
        final = start >= len(raw)
        parts.append(struct.pack("<BHH", final, len(block), len(block) ^ 0xFFFF))
        parts.append(block)
        if final:
            break
    parts.append(struct.pack(">I", isal_zlib.adler32(raw)))
    return b"".join(parts)


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = isal_zlib.crc32(body, isal_zlib.crc32(kind))
    return b"".join((struct.pack(">I", len(body)), kind, body, struct.pack(">I", crc)))
