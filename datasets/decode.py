"""Turn encoded image bytes into uint8 pixels, classifying every failure.

Decoders are forgiving in ways that hide corrupt data: libjpeg fills the missing rows of a
truncated JPEG with grey and only prints a warning, and cv2.imdecode returns None without a
reason. We check the container first (magic bytes, end markers) so each failure gets one of the
kinds in ``errors.BAD_SAMPLE_KINDS`` and a reason a person can act on.
"""

from __future__ import annotations

import io
import struct

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from datasets import png_inflate
from datasets.errors import BadSampleError

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


# data.max_image_pixels' default: 40 Mpixels (120 MB as RGB, per worker) fits ImageNet's largest
# photos and text lines thousands of pixels long; a 20000 x 20000 scan or a PNG decompression
# bomb (a few KB that inflate to gigabytes) is refused from its header, before any pixel.
MAX_IMAGE_PIXELS = 40_000_000


def header_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) read from the header alone (JPEG, PNG; PIL's lazy open for the others),
    or None when the header does not say: the decoder then reports the image as it is."""
    if fmt == "png" and len(data) >= 24 and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if fmt == "jpeg":
        return _jpeg_header_size(data)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # PIL raises many types for bad headers
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
    if fmt == "png" and data.rfind(b"IEND", max(0, len(data) - 64)) < 0:
        raise BadSampleError("truncated_image", f"PNG of {len(data)} bytes has no IEND chunk")
    if max_pixels is not None:
        size = header_size(data, fmt)
        if size is not None and size[0] * size[1] > max_pixels:
            raise BadSampleError(
                "image_too_large",
                f"{fmt.upper()} of {size[0]} x {size[1]} = {size[0] * size[1] / 1e6:.0f} Mpixels "
                f"in {len(data)} bytes, over data.max_image_pixels {max_pixels / 1e6:g} M; not "
                "decoded",
            )
    return fmt


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
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if image is None or image.size == 0:
        raise BadSampleError("undecodable_image", f"OpenCV could not decode {len(data)} bytes")
    return image


def open_pil(data: bytes) -> Image.Image:
    """Open (header only) with PIL after the container checks; pixels are decoded later."""
    check_encoded(data)
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
        return np.asarray(load_pil_rgb(open_pil(data)))
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
