"""PNG image data inflated by ISA-L, handed to libpng already inflated.

A text-line PNG spends three quarters of ``cv2.imdecode`` in zlib's inflate (0.30 of 0.41 ms on
the benchmark's records); ISA-L's inflate does the same work in 0.11 ms. OpenCV has no way to
take inflated PNG rows, so ``with_stored_image_data`` rewrites the file: the IDAT chunks become
one IDAT whose zlib stream holds the same bytes in *stored* (uncompressed) deflate blocks, which
libpng "inflates" by copying. Everything else (unfiltering, palettes, transparency, 16-bit and
grey conversion, ancillary chunks) is still libpng's, so the pixels are exactly
``cv2.imdecode``'s on the original bytes; tests/test_png_inflate.py checks that per PNG variant.

Whatever this module does not handle returns None and the caller decodes the original bytes:
interlaced images, images whose inflated data is over ``MAX_INFLATED_BYTES`` (the rewrite holds
up to three copies of it at once: the rows, the new chunk, the new file), and every malformed
file (bad chunk layout or IDAT CRC, a zlib error, too much or too little data), so OpenCV
classifies those exactly as before.
"""

from __future__ import annotations

import struct

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


def with_stored_image_data(data: bytes) -> bytes | None:
    """``data`` (a PNG) with its image data inflated and re-stored uncompressed, or None when
    the original should be decoded as it is (see the module docstring)."""
    chunks = _split_chunks(data)
    if chunks is None:
        return None
    before, idat_bodies, after, expected = chunks
    inflater = isal_zlib.decompressobj()
    try:
        # max_length bounds the output: trailing junk cannot inflate past what the header says.
        rows = inflater.decompress(b"".join(idat_bodies), expected + 1)
    except isal_zlib.error:
        return None
    if len(rows) != expected or not inflater.eof or inflater.unused_data:
        return None
    return b"".join((SIGNATURE, *before, _chunk(b"IDAT", _stored_zlib(rows)), *after))


def _split_chunks(data: bytes):
    """(chunks before the first IDAT, IDAT bodies, chunks after the last, inflated size) of a
    well-formed non-interlaced PNG whose IDAT CRCs hold, else None. The other chunks are kept
    whole, with their CRCs, for libpng to check."""
    view = memoryview(data)
    if not data.startswith(SIGNATURE) or data[12:16] != b"IHDR" or len(data) < 33:
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
