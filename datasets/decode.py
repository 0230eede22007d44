"""Turn encoded image bytes into uint8 pixels, classifying every failure.

Decoders are forgiving in ways that hide corrupt data: libjpeg fills the missing rows of a
truncated JPEG with grey and only prints a warning, and cv2.imdecode returns None without a
reason. We check the container first (magic bytes, end markers) so each failure gets one of the
kinds in ``errors.BAD_SAMPLE_KINDS`` and a reason a person can act on.

One rule for malformed input: a BadSampleError with a kind, or the answer of the library
reference (cv2.imdecode's pixels), never another exception (tests/test_png_fuzz.py checks it
for PNGs against cv2.imdecode). The pixel budget (``max_pixels``) is checked from the header of
every format before any decoder runs, and a header that gives no size is not decoded.
"""

from __future__ import annotations

import io
import struct

import cv2
import numpy as np
import simplejpeg
from PIL import BmpImagePlugin, GifImagePlugin, Image, TiffImagePlugin

from datasets import png_inflate
from datasets.errors import BadSampleError
from datasets.limits import MAX_IMAGE_PIXELS  # noqa: F401  (re-exported: every decode's default)

# One decode thread per process: a DataLoader already runs one process per core, and OpenCV's
# own thread pool inside each worker only oversubscribes the CPU.
cv2.setNumThreads(1)

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"BM", "bmp"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)


def sniff_format(data: bytes) -> str | None:
    """Image format from magic bytes, or None."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def header_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) read from the header alone, or None when the header does not say.

    PNG: the IHDR chunk, which libpng requires first. JPEG: libjpeg-turbo's header parser.
    WebP: the VP8X canvas or the VP8/VP8L frame header, read here (Pillow's open of a WebP
    builds libwebp's animation decoder, which allocates two canvases of the claimed size).
    BMP, TIFF, GIF: Pillow's lazy open, which reads the header only; its plugin is called
    directly, without ``Image.open``'s decompression-bomb check (at twice
    ``Image.MAX_IMAGE_PIXELS`` it raises instead of giving the size, which hid a 13500 x 13500
    RLE8 BMP of 1 kB from the budget)."""
    if fmt == "png":
        if len(data) >= 24 and data[12:16] == b"IHDR":
            return struct.unpack_from(">II", data, 16)
        return None
    if fmt == "jpeg":
        return _jpeg_header_size(data)
    if fmt == "webp":
        return _webp_header_size(data)
    plugin = _PIL_PLUGINS.get(fmt)
    if plugin is None:
        return None
    try:
        with plugin(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # PIL raises many types for bad headers
        return None


_PIL_PLUGINS = {
    "bmp": BmpImagePlugin.BmpImageFile,
    "gif": GifImagePlugin.GifImageFile,
    "tiff": TiffImagePlugin.TiffImageFile,
}


def _webp_header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a WebP from its first chunk: what libwebp's WebPGetFeatures, and so
    OpenCV, allocates for (the VP8X canvas, else the lossy or lossless frame's size)."""
    if len(data) < 30:
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":  # 24-bit width - 1 and height - 1, little-endian
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8L" and data[20] == 0x2F:  # signature, then 14-bit width - 1, height - 1
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # after the 3-byte frame tag
        return int.from_bytes(data[26:28], "little") & 0x3FFF, (
            int.from_bytes(data[28:30], "little") & 0x3FFF
        )
    return None


def check_encoded(data: bytes, max_pixels: int | None = None) -> str:
    """Raise BadSampleError unless ``data`` looks like a complete image file of at most
    ``max_pixels`` pixels (None: any size); return its format."""
    if len(data) == 0:
        raise BadSampleError("empty_image", "record holds 0 bytes")
    fmt = sniff_format(data)
    if fmt is None:
        raise BadSampleError(
            "garbage_image",
            f"{len(data)} bytes starting {data[:8].hex()} are no known image format",
        )
    if fmt == "jpeg" and data.rfind(b"\xff\xd9", max(0, len(data) - 64)) < 0:
        raise BadSampleError(
            "truncated_image", f"JPEG of {len(data)} bytes has no end-of-image marker"
        )
    if fmt == "png" and not _has_iend(data):
        raise BadSampleError("truncated_image", f"PNG of {len(data)} bytes has no IEND chunk")
    if max_pixels is not None:
        size = header_size(data, fmt)
        if size is None and fmt != "jpeg":
            # No size, no decode: the budget holds for every format. JPEG is the exception:
            # its decoder (libjpeg-turbo, simplejpeg) reads the same header first and fails.
            raise BadSampleError(
                "undecodable_image",
                f"{fmt.upper()} of {len(data)} bytes whose header gives no image size, so "
                f"data.max_image_pixels cannot be checked; not decoded",
            )
        if size is not None and size[0] * size[1] > max_pixels:
            raise BadSampleError(
                "image_too_large",
                f"{fmt.upper()} of {size[0]} x {size[1]} = {size[0] * size[1] / 1e6:.0f} Mpixels "
                f"in {len(data)} bytes, over data.max_image_pixels {max_pixels / 1e6:g} M; not "
                "decoded",
            )
    return fmt


def _has_iend(data: bytes) -> bool:
    """Whether a PNG has an IEND chunk: in its last 64 bytes (the common case, one search), or
    anywhere along its chain of chunks (libpng and Pillow ignore bytes after IEND)."""
    if data.rfind(b"IEND", max(0, len(data) - 64)) >= 0:
        return True
    position = len(png_inflate.SIGNATURE)
    while position + 8 <= len(data):
        if data[position + 4 : position + 8] == b"IEND":
            return True
        (length,) = struct.unpack_from(">I", data, position)
        position += 12 + length
    return False


def _check_png_chunk_lengths(data: bytes) -> None:
    """Raise BadSampleError if a chunk before IEND claims more bytes than the file holds.

    libpng allocates an ancillary chunk's claimed length before reading it: a 600-byte PNG
    whose tEXt chunk says 2**31 - 1 bytes cost cv2.imdecode 2 GB of memory and 8 s before it
    returned None. Only files the fast path declined come here (it walks the same chain)."""
    position = len(png_inflate.SIGNATURE)
    while position + 12 <= len(data):
        (length,) = struct.unpack_from(">I", data, position)
        kind = data[position + 4 : position + 8]
        if position + 12 + length > len(data):
            raise BadSampleError(
                "undecodable_image",
                f"PNG chunk {kind!r} at byte {position} claims {length} bytes, past the end of "
                f"the {len(data)}-byte file; not decoded",
            )
        if kind == b"IEND":
            return
        position += 12 + length


def decode_bgr(data: bytes, max_pixels: int | None = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decode to an HxWx3 uint8 BGR array (PaddleOCR's convention for OCR): JPEGs with
    libjpeg-turbo straight into numpy (simplejpeg, a fifth cheaper than cv2.imdecode on text
    lines, and strict about corrupt data), everything else with OpenCV. PNGs are inflated by
    ISA-L and then unfiltered by running sums from OpenCV's integral image (OpenCV's own
    Sub-filtered PNGs) or by libpng through OpenCV (png_inflate.py: about two thirds of
    cv2.imdecode's time on a text line), unless they are of a kind that module leaves to
    OpenCV whole."""
    fmt = check_encoded(data, max_pixels)
    if fmt == "jpeg":
        return _decode_jpeg(data, "BGR")
    if fmt == "png":
        image = png_inflate.decode(data)
        if image is not None:
            return image
        _check_png_chunk_lengths(data)
    try:
        image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    except cv2.error as exc:  # a header over OpenCV's own limits (2**30 pixels, 2**20 wide)
        raise BadSampleError(
            "undecodable_image", f"OpenCV refused {len(data)} bytes: {exc}"
        ) from exc
    if image is None or image.size == 0:
        raise BadSampleError("undecodable_image", f"OpenCV could not decode {len(data)} bytes")
    return image


def open_pil(data: bytes, max_pixels: int | None = MAX_IMAGE_PIXELS) -> Image.Image:
    """Open (header only) with PIL after the container checks and the pixel budget (from the
    header); pixels are decoded later, by load_pil_rgb."""
    check_encoded(data, max_pixels)
    try:
        image = Image.open(io.BytesIO(data))
        image.size  # noqa: B018  (touch the header so errors surface here)
    except Exception as exc:  # PIL raises many types for bad headers
        raise BadSampleError("undecodable_image", f"PIL rejected the header: {exc}") from exc
    return image


def load_pil_rgb(image: Image.Image) -> Image.Image:
    """Decode the pixels of an opened PIL image to RGB, classifying decoder failures."""
    try:
        image.load()
    except OSError as exc:
        kind = "truncated_image" if "truncated" in str(exc) else "undecodable_image"
        raise BadSampleError(kind, f"PIL failed to decode: {exc}") from exc
    except Exception as exc:
        raise BadSampleError("undecodable_image", f"PIL failed to decode: {exc}") from exc
    return image if image.mode == "RGB" else image.convert("RGB")


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG header without decoding, or None if it is not a JPEG that
    libjpeg-turbo can read (the caller then decodes it another way, or reports it)."""
    if sniff_format(data) != "jpeg":
        return None
    return _jpeg_header_size(data)


def _jpeg_header_size(data: bytes) -> tuple[int, int] | None:
    """jpeg_size for bytes already known to start like a JPEG (no second sniff)."""
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return width, height


def decode_rgb(
    data: bytes,
    min_width: int = 0,
    min_height: int = 0,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> np.ndarray:
    """Decode to an HxWx3 uint8 RGB array.

    JPEGs go straight from libjpeg-turbo into numpy (simplejpeg): about 0.3 ms less per ImageNet
    image than PIL, which feeds its decoder in chunks and converts afterwards. With ``min_width``
    and ``min_height`` a JPEG is decoded at 1/2, 1/4 or 1/8 scale (reduced IDCT) when that still
    leaves at least that many pixels; other reductions use libjpeg-turbo's slow generic IDCTs, so
    they are never chosen. Grey and CMYK JPEGs come out as RGB too. Other formats go through PIL.
    """
    if check_encoded(data, max_pixels) != "jpeg":
        return np.asarray(load_pil_rgb(open_pil(data, max_pixels=None)))  # checked just above
    return _decode_jpeg(data, "RGB", min_width, min_height)


def _decode_jpeg(data: bytes, colorspace: str, min_width: int = 0, min_height: int = 0):
    """simplejpeg, strict: libjpeg's "corrupt data" warnings (a scan that ends early, bad
    Huffman codes) raise instead of decoding grey rows, except the harmless "extraneous bytes
    before marker" that some cameras write (a few ImageNet files have it), which PIL and OpenCV
    accept too."""
    options = {
        "min_height": min_height,
        "min_width": min_width,
        "min_factor": 2 if (min_width > 0 or min_height > 0) else 1,
    }
    try:
        return simplejpeg.decode_jpeg(data, colorspace, strict=True, **options)
    except ValueError as exc:
        text = str(exc)
        if "extraneous bytes" in text:
            return simplejpeg.decode_jpeg(data, colorspace, strict=False, **options)
        kind = "truncated_image" if "premature end" in text.lower() else "undecodable_image"
        raise BadSampleError(kind, f"libjpeg-turbo failed to decode: {text}") from exc
