"""ResNet-50 image transforms on encoded bytes, uint8 HxWx3 RGB out.

Train: RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)) + horizontal flip, with the
crop drawn exactly as torchvision draws it. Eval: resize the shorter side to 256, center crop 224.

Speed comes from doing less work, not from changing the augmentation: the crop is chosen from
the JPEG header alone, then the JPEG is decoded at the largest DCT reduction (1/2, 1/4, 1/8) that
still leaves the crop at least ``size`` pixels on its short side (PIL's ``draft``), and crop and
resize are one resampling pass (``resize(box=...)``). No float work on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from datasets.decode import load_pil_rgb, open_pil

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


def _decode_box_resized(
    data: bytes, box_for_size, out_size: int, rng: np.random.Generator | None
) -> np.ndarray:
    """Decode only as much resolution as the crop needs, then crop+resize in one pass."""
    image = open_pil(data)
    width, height = image.size
    left, top, crop_w, crop_h = box_for_size(width, height)
    # Largest reduction s with crop_w/s >= out_size and crop_h/s >= out_size.
    reduction = max(1.0, min(crop_w, crop_h) / out_size)
    if reduction >= 2.0 and image.format == "JPEG":
        image.draft("RGB", (math.ceil(width / reduction), math.ceil(height / reduction)))
    image = load_pil_rgb(image)
    sx, sy = image.size[0] / width, image.size[1] / height
    box = (left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy)
    out = image.resize((out_size, out_size), Image.BILINEAR, box=box)
    if rng is not None and rng.random() < 0.5:
        # Flip in PIL: about 4x cheaper than copying a negative-stride numpy view, same pixels.
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out, dtype=np.uint8)  # a fresh C-contiguous array


def train_transform(data: bytes, rng: np.random.Generator, size: int = 224) -> np.ndarray:
    """RandomResizedCrop(size) + horizontal flip(p=0.5) from encoded bytes."""
    return _decode_box_resized(data, lambda w, h: random_resized_crop_box(w, h, rng), size, rng)


def center_crop_box(width: int, height: int, resize: int, size: int) -> tuple[int, int, int, int]:
    """Box in original pixels equal to Resize(resize) then CenterCrop(size)."""
    side = size * min(width, height) / resize
    crop = min(int(round(side)), width, height)
    return (width - crop) // 2, (height - crop) // 2, crop, crop


def eval_transform(data: bytes, size: int = 224, resize: int = 256) -> np.ndarray:
    """Resize(resize) + CenterCrop(size) from encoded bytes, deterministic."""
    return _decode_box_resized(data, lambda w, h: center_crop_box(w, h, resize, size), size, None)
