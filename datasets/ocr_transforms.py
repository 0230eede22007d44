"""OCR text-line transforms: character dictionary, CTC label encoding, resize-and-pad, augment.

Conventions follow PaddleOCR's recognition pipeline so users can bring their dictionaries and
LMDBs unchanged: a dictionary file holds one character per line (``ppocr_keys_v1.txt`` works),
CTC class 0 is the blank, images are BGR, and a line is resized to the target height keeping its
aspect ratio (capped at the target width), then padded on the right, as RecResizeImg does.
We output uint8 H x W x C, the layout OpenCV produces: the device transposes the batch to
N x C x H x W as it normalizes to [-1, 1] (as for ResNet-50), so no worker spends time on a
strided CHW copy or float math.
"""

from __future__ import annotations

import math
from pathlib import Path

import cv2
import numpy as np

from datasets.errors import BadSampleError, DatasetError, read_utf8

# uint8 value that becomes ~0.0 after the device-side (x / 255 - 0.5) / 0.5 normalization, so
# the padded region matches PaddleOCR's zero padding of the normalized image.
PAD_VALUE = 128


class CharDict:
    """Character dictionary; CTC class of character ``c`` is ``index(c) + 1`` (0 = blank)."""

    def __init__(self, characters: list[str], use_space_char: bool = False) -> None:
        chars = list(characters)
        if use_space_char and " " not in chars:
            chars.append(" ")
        if not chars:
            raise DatasetError("character dictionary is empty", "put one character per line")
        self.characters = chars
        self._class_of = {c: i + 1 for i, c in enumerate(chars)}
        if len(self._class_of) != len(chars):
            dupes = sorted({c for c in chars if chars.count(c) > 1})
            raise DatasetError(
                f"character dictionary repeats {dupes[:10]}", "keep each character on one line once"
            )

    @classmethod
    def from_file(cls, path: str | Path, use_space_char: bool = False) -> CharDict:
        path = Path(path)
        if not path.is_file():
            raise DatasetError(
                f"character dictionary not found: {path}",
                "set data.char_dict to a file with one character per line "
                "(scripts/make_synthetic.py ocr writes charset.txt next to the LMDBs)",
            )
        fix = "save it as UTF-8 (PaddleOCR's dictionaries are), e.g. iconv -f GBK -t UTF-8"
        text = read_utf8(path, "character dictionary", fix)
        chars = [line.rstrip("\r") for line in text.split("\n")]
        chars = [c for c in chars if c != ""]
        bad = [c for c in chars if len(c) != 1]
        if bad:
            raise DatasetError(
                f"{path}: lines must hold exactly one character, found {bad[:5]}",
                "use PaddleOCR's format: one character per line",
            )
        return cls(chars, use_space_char)

    @property
    def num_classes(self) -> int:
        """Characters plus the CTC blank."""
        return len(self.characters) + 1

    def encode(self, label: str, max_length: int) -> tuple[np.ndarray, int]:
        """Label -> (int32 array padded with blanks to ``max_length``, true length)."""
        return np.array(self._padded_classes(label, max_length), dtype=np.int32), len(label)

    def encode_into(self, label: str, max_length: int, out: np.ndarray) -> int:
        """``encode`` written into ``out`` (an int32 array of ``max_length``, e.g. a batch row):
        one conversion of the class list, where encode's array and a copy into the row are two.
        Returns the true length."""
        out[...] = self._padded_classes(label, max_length)
        return len(label)

    def _padded_classes(self, label: str, max_length: int) -> list[int]:
        if not label.strip():
            raise BadSampleError("empty_label", "label is empty")
        # The length first: a label of megabytes costs nothing here, where the lookups below
        # (and an error message quoting the label) would cost its size in time and memory.
        if len(label) > max_length:
            raise BadSampleError(
                "label_too_long", f"label of {len(label)} characters > max_text_length {max_length}"
            )
        # One pass of dictionary lookups; the characters that are missing are only collected
        # (a second pass) for the error message.
        try:
            classes = list(map(self._class_of.__getitem__, label))
        except KeyError:
            missing = sorted({c for c in label if c not in self._class_of})
            raise BadSampleError(
                "label_out_of_dict",
                f"label {label!r} has characters not in the dictionary: " f"{''.join(missing)!r}",
            ) from None
        return classes + [0] * (max_length - len(classes))  # padded with blanks

    def decode(self, classes: np.ndarray) -> str:
        """Class ids (no blanks, no repeats collapsed) -> text."""
        return "".join(self.characters[c - 1] for c in classes if c > 0)


def resize_and_pad(
    image: np.ndarray, shape: tuple[int, int, int], out: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """BGR HxWx3 -> uint8 HxWxC for ``shape`` = (C, H, W); returns (image, valid width ratio).
    With ``out`` (an H x W x C uint8 array, e.g. a row of a batch) the result is written there
    and ``out`` returned."""
    channels, height, width = shape
    h, w = image.shape[:2]
    resized_w = min(width, int(math.ceil(height * w / max(h, 1))))
    resized_w = max(resized_w, 1)
    ratio = min(1.0, resized_w / width)
    if channels == 1:
        resized = cv2.cvtColor(
            cv2.resize(image, (resized_w, height), interpolation=cv2.INTER_LINEAR),
            cv2.COLOR_BGR2GRAY,
        )
        padded = cv2.copyMakeBorder(
            resized, 0, 0, 0, width - resized_w, cv2.BORDER_CONSTANT, value=(PAD_VALUE,) * 3
        )[:, :, None]
        if out is None:
            return padded, ratio
        out[...] = padded
        return out, ratio
    if out is None:
        if resized_w == width:  # a long line fills the width: resize's own output, no padding
            return cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR), ratio
        out = np.full((height, width, *image.shape[2:]), PAD_VALUE, dtype=image.dtype)
    elif resized_w < width:
        out[:, resized_w:] = PAD_VALUE
    # Resize straight into the left part of the output (OpenCV writes into the strided view,
    # same pixels): no intermediate image, no second copy. OpenCV returns a new array instead
    # when the view does not fit (shape or type): that would lose the pixels, so it is checked.
    view = out[:, :resized_w]
    if cv2.resize(image, (resized_w, height), dst=view, interpolation=cv2.INTER_LINEAR) is not view:
        raise ValueError(
            f"cannot resize a {image.shape} {image.dtype} image into a {out.shape} {out.dtype} "
            "output: shape or type differ"
        )
    return out, ratio


def augment_text_line(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Cheap text-line augmentations on uint8 BGR: each applied with its own probability.

    Kept mild on purpose: a line must stay readable, and each op is a single cv2 call so the
    augmentation costs less than the decode.
    """
    h, w = image.shape[:2]
    if rng.random() < 0.4 and h > 4 and w > 4:  # small rotation + shear + scale
        angle = rng.uniform(-3.0, 3.0)
        matrix = cv2.getRotationMatrix2D((w / 2, h / 2), angle, rng.uniform(0.9, 1.05))
        matrix[0, 1] += rng.uniform(-0.15, 0.15)
        image = cv2.warpAffine(image, matrix, (w, h), borderMode=cv2.BORDER_REPLICATE)
    if rng.random() < 0.3 and h > 8:  # crop a few rows off the top and bottom
        top = int(rng.integers(0, max(1, h // 10)))
        bottom = int(rng.integers(0, max(1, h // 10)))
        image = image[top : h - bottom]
    if rng.random() < 0.3:
        ksize = int(rng.choice([3, 5]))
        image = cv2.GaussianBlur(image, (ksize, ksize), 0)
    if rng.random() < 0.4:  # contrast and brightness
        alpha, beta = rng.uniform(0.6, 1.3), rng.uniform(-40, 40)
        image = cv2.convertScaleAbs(image, alpha=alpha, beta=beta)
    if rng.random() < 0.3:
        noise = rng.normal(0, rng.uniform(3, 12), image.shape)
        image = np.clip(image.astype(np.int16) + noise.astype(np.int16), 0, 255).astype(np.uint8)
    if rng.random() < 0.1:
        image = 255 - image
    return np.ascontiguousarray(image)
