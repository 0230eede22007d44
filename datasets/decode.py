"""Turn encoded image bytes into uint8 pixels, classifying every failure.

Decoders are forgiving in ways that hide corrupt data: libjpeg fills the missing rows of a
truncated JPEG with grey and only prints a warning, and cv2.imdecode returns None without a
reason. We check the container first (magic bytes, end markers) so each failure gets one of the
kinds in ``errors.BAD_SAMPLE_KINDS`` and a reason a person can act on.
"""

from __future__ import annotations

import io

import cv2
import numpy as np
from PIL import Image

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


def check_encoded(data: bytes) -> str:
    """Raise BadSampleError unless ``data`` looks like a complete image file; return its format."""
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
    return fmt


def decode_bgr(data: bytes) -> np.ndarray:
    """Decode to an HxWx3 uint8 BGR array with OpenCV (PaddleOCR's convention for OCR)."""
    check_encoded(data)
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
