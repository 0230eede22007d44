"""ResNet-50 image transforms on encoded bytes, uint8 HxWx3 RGB out.

Train: RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)) + horizontal flip, with the
crop drawn exactly as torchvision draws it. Eval: resize the shorter side to 256, center crop 224.

Where the time goes for a 500x375 quality-90 JPEG on one core of these hosts (profiled; figures in
docs/benchmarks.md): libjpeg-turbo needs about 1.1 ms, most of it Huffman-decoding the whole scan,
which no reduced-scale or crop-only decode avoids. torchvision's recipe spends about 3 ms more:
PIL's decoder overhead, a PIL resample, float conversion and normalisation, four times the IPC
bytes. So here everything but the decode is made cheap:
- the crop is drawn from the JPEG header, before decoding;
- the JPEG is decoded straight into numpy (simplejpeg), at 1/2, 1/4 or 1/8 DCT scale when the
  crop still has at least ``size`` pixels on its short side (large images, Resize(256) in eval);
- crop is a view, then ``resize`` below: a whole-factor box shrink and one bilinear pass;
- flip is ``cv2.flip``; the output stays uint8 (normalisation happens on the device).
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from datasets.decode import MAX_IMAGE_PIXELS, check_encoded, decode_rgb, jpeg_size

SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)


def random_resized_crop_box(
    width: int, height: int, rng: np.random.Generator, scale=SCALE, ratio=RATIO
) -> tuple[int, int, int, int]:
    """(left, top, crop_width, crop_height) with torchvision's RandomResizedCrop distribution:
    area uniform in ``scale`` x image area, log aspect ratio uniform in log(``ratio``), ten
    tries, then a center crop clamped to ``ratio``."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(rng.integers(0, height - crop_h + 1))
            left = int(rng.integers(0, width - crop_w + 1))
            return left, top, crop_w, crop_h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        crop_w, crop_h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        crop_h, crop_w = height, int(round(height * ratio[1]))
    else:
        crop_w, crop_h = width, height
    return (width - crop_w) // 2, (height - crop_h) // 2, crop_w, crop_h


def _image_size(data: bytes, max_pixels: int | None) -> tuple[int, int, np.ndarray | None]:
    """(width, height, pixels or None): JPEGs from their header alone, anything else decoded.
    Either way an image over ``max_pixels`` is refused from its header first."""
    check_encoded(data, max_pixels)
    size = jpeg_size(data)
    if size is not None:
        return size[0], size[1], None
    pixels = decode_rgb(data, max_pixels=None)  # PNG and friends: decoded once, here
    return pixels.shape[1], pixels.shape[0], pixels


def _decode_box_resized(
    data: bytes,
    box_for_size,
    out_size: int,
    rng: np.random.Generator | None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode only as much resolution as the crop needs, then crop (a view) and resize once
    (into ``out`` when given, a size x size x 3 uint8 array such as a batch row)."""
    width, height, pixels = _image_size(data, max_pixels)
    left, top, crop_w, crop_h = box_for_size(width, height)
    if pixels is None:
        # Largest reduction r with crop_w/r >= out_size and crop_h/r >= out_size.
        reduction = min(crop_w, crop_h) / out_size
        scaled = reduction >= 2.0
        pixels = decode_rgb(
            data,
            min_width=math.ceil(width / reduction) if scaled else 0,
            min_height=math.ceil(height / reduction) if scaled else 0,
            max_pixels=None,  # checked above
        )
    sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
    x0, y0 = round(left * sx), round(top * sy)
    x1 = max(x0 + 1, min(pixels.shape[1], round((left + crop_w) * sx)))
    y1 = max(y0 + 1, min(pixels.shape[0], round((top + crop_h) * sy)))
    out = resize(pixels[y0:y1, x0:x1], out_size, out)
    if rng is not None and rng.random() < 0.5:
        # In place (OpenCV swaps the two ends of each row): still C-contiguous, unlike a
        # negative-stride view, and no second image.
        out = cv2.flip(out, 1, dst=out)
    return out


def resize(crop: np.ndarray, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Resize an HxWx3 uint8 array to size x size: first shrink by the largest whole factor that
    keeps both sides >= ``size`` (box filter: OpenCV's INTER_AREA fast path for whole factors,
    and the antialiasing), then bilinear for the remaining factor below 2. Pillow's
    ``reducing_gap`` works the same way. About 5x cheaper than PIL's or INTER_AREA's general
    antialiased resample (0.6-0.9 ms here, over half the decode); what it gives up is the
    antialiasing of that last factor below 2, which albumentations' and mmpretrain's
    RandomResizedCrop (plain cv2 bilinear) give up entirely. With ``out`` (size x size x 3
    uint8) the result is written there and ``out`` returned."""
    height, width = crop.shape[:2]
    factor = min(height, width) // size
    if factor >= 2:
        height, width = height // factor, width // factor
        crop = cv2.resize(
            crop[: height * factor, : width * factor], (width, height), interpolation=cv2.INTER_AREA
        )
    if out is None:
        return cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)
    # OpenCV returns a new array instead when ``out`` does not fit (shape, type, layout): the
    # pixels would be lost, so that is an error.
    if cv2.resize(crop, (size, size), dst=out, interpolation=cv2.INTER_LINEAR) is not out:
        raise ValueError(
            f"cannot resize a {crop.shape} {crop.dtype} crop into a {out.shape} {out.dtype} "
            "output: shape, type or layout differ"
        )
    return out


def train_transform(
    data: bytes,
    rng: np.random.Generator,
    size: int = 224,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """RandomResizedCrop(size) + horizontal flip(p=0.5) from encoded bytes (into ``out``)."""
    box = lambda w, h: random_resized_crop_box(w, h, rng)  # noqa: E731
    return _decode_box_resized(data, box, size, rng, max_pixels, out)


def center_crop_box(width: int, height: int, resize: int, size: int) -> tuple[int, int, int, int]:
    """Box in original pixels equal to Resize(resize) then CenterCrop(size)."""
    side = size * min(width, height) / resize
    crop = min(int(round(side)), width, height)
    return (width - crop) // 2, (height - crop) // 2, crop, crop


def eval_transform(
    data: bytes,
    size: int = 224,
    resize: int = 256,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Resize(resize) + CenterCrop(size) from encoded bytes, deterministic (into ``out``)."""
    box = lambda w, h: center_crop_box(w, h, resize, size)  # noqa: E731
    return _decode_box_resized(data, box, size, None, max_pixels, out)
