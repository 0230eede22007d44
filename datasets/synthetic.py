"""Synthetic datasets a model can learn from, written with the project's own writers.

OCR: rendered text lines (digits, Latin letters, and common Chinese characters when a CJK font is
installed; the images carry one) into train/ and val/ LMDBs plus a charset.txt dictionary.
ImageNet-like: class-dependent patterns at about 500x375, JPEG quality 90, about 100 KB each,
into one HDF5 file, optionally with each image's tags (IMAGENET_TAG_NAMES). Class appearance
depends only on the class id, so train and val files written with different seeds share classes.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageDraw, ImageFont

DIGITS = "0123456789"
LATIN = DIGITS + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Frequent characters of ppocr_keys_v1.txt's vocabulary: enough to exercise multi-byte labels.
CJK = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着"
    "去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主"
    "行方又如前所本见经头面公同三已老从动两长"
)

_CJK_FONT_GLOBS = (
    "/usr/share/fonts/**/NotoSansCJK*.tt[cf]",
    "/usr/share/fonts/**/NotoSerifCJK*.tt[cf]",
    "/usr/share/fonts/**/wqy-*.tt[cf]",
    "/usr/share/fonts/**/*DroidSansFallback*.tt[cf]",
)
# DejaVu Sans first: the font `make train-ocr`'s data and the images' (fonts-dejavu-core) use, so
# the same command writes the same lines on the host and in a container. Then any font: PIL's
# built-in one ignores the size and renders lines too small to learn from in a few hundred steps.
_LATIN_FONT_GLOBS = (
    "/usr/share/fonts/**/DejaVuSans.ttf",
    "/usr/share/fonts/**/*.ttf",
    "/usr/share/fonts/**/*.otf",
    "/usr/share/fonts/**/*.ttc",
)


def find_font(cjk: bool) -> str | None:
    """Path of a CJK (or, with cjk=False, any Latin) TrueType font, or None."""
    if cjk and shutil.which("fc-list"):
        out = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True)
        files = sorted(line.split(":")[0].strip() for line in out.stdout.splitlines() if line)
        if files:
            return files[0]
    for pattern in _CJK_FONT_GLOBS if cjk else _LATIN_FONT_GLOBS:
        hits = sorted(glob.glob(pattern, recursive=True))
        if hits:
            return hits[0]
    return None


def ocr_charset(kind: str, font: str | None = None) -> tuple[str, str | None]:
    """(characters, font path) for ``kind`` in digits | latin | full (latin + CJK if a font);
    ``font``: use this one (a CJK font, e.g. scripts/fetch_ppocrv4.py's, for full)."""
    if kind not in ("digits", "latin", "full"):
        raise ValueError(f"charset must be digits, latin or full, got {kind!r}")
    if font is not None:
        return (LATIN + CJK if kind == "full" else DIGITS if kind == "digits" else LATIN), font
    if kind == "full":
        cjk_font = find_font(cjk=True)
        if cjk_font:
            return LATIN + CJK, cjk_font
    return (DIGITS if kind == "digits" else LATIN), find_font(cjk=False)


def render_text_line(text: str, font_path: str | None, rng: np.random.Generator) -> np.ndarray:
    """BGR uint8 image of one text line with random size, colours, offset and noise."""
    size = int(rng.integers(22, 34))
    font = ImageFont.truetype(font_path, size) if font_path else ImageFont.load_default()
    left, top, right, bottom = font.getbbox(text)
    pad_x, pad_y = int(rng.integers(2, 12)), int(rng.integers(2, 8))
    width, height = right - left + 2 * pad_x, bottom - top + 2 * pad_y
    background = rng.integers(0, 256, 3)
    # Text colour far from the background, so every line stays legible.
    ink = np.where(background > 127, rng.integers(0, 70, 3), rng.integers(185, 256, 3))
    canvas = Image.new("RGB", (width, height), tuple(int(c) for c in background))
    ImageDraw.Draw(canvas).text(
        (pad_x - left, pad_y - top), text, font=font, fill=tuple(int(c) for c in ink)
    )
    image = np.asarray(canvas)[:, :, ::-1].astype(np.int16)
    image += rng.normal(0, rng.uniform(0, 8), image.shape).astype(np.int16)
    return np.clip(image, 0, 255).astype(np.uint8)


def dot_matrix(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The line as a dot-matrix printer or LED sign would show it: the ink only on round dots
    of a regular grid (pitch 4 to 6 pixels, at twice the rendered size), the paper between them.
    A hard domain for recognizers trained on solid strokes (PP-OCRv4 reads about 60% of such
    lines exactly, against about 80% of clean ones), and one fine-tuning can learn."""
    big = cv2.resize(image, (image.shape[1] * 2, image.shape[0] * 2), interpolation=cv2.INTER_CUBIC)
    paper = np.median(big.reshape(-1, 3), axis=0)
    ink = np.abs(big.astype(np.int16) - paper).sum(axis=2) > 90
    ink = cv2.dilate(ink.astype(np.uint8), np.ones((3, 3), np.uint8)) > 0  # strokes meet dots
    pitch = int(rng.integers(4, 7))
    yy, xx = np.mgrid[0 : big.shape[0], 0 : big.shape[1]]
    centre = (pitch - 1) / 2
    dots = ((yy % pitch - centre) ** 2 + (xx % pitch - centre) ** 2) <= (pitch * 0.38) ** 2
    ink_colour = big[ink].reshape(-1, 3).mean(axis=0) if ink.any() else 255 - paper
    out = np.where((ink & dots)[:, :, None], ink_colour, paper).astype(np.float32)
    out = cv2.GaussianBlur(out, (3, 3), 0) + rng.normal(0, 4, out.shape)
    return np.clip(out, 0, 255).astype(np.uint8)


DOMAINS = {"clean": None, "dot_matrix": dot_matrix}  # --domain of make_synthetic.py ocr


def random_text(charset: str, rng: np.random.Generator, min_len: int = 3, max_len: int = 10) -> str:
    length = int(rng.integers(min_len, max_len + 1))
    return "".join(charset[i] for i in rng.integers(0, len(charset), length))


def encode_image(image: np.ndarray, fmt: str, quality: int = 90) -> bytes:
    if fmt == "jpeg":
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    else:
        ok, buf = cv2.imencode(".png", image)
    if not ok:
        raise RuntimeError(f"OpenCV failed to encode a {fmt} image")
    return buf.tobytes()


def ocr_samples(
    num: int,
    charset: str,
    font_path: str | None,
    seed: int,
    png_fraction: float = 0.2,
    max_len: int = 10,
    domain: str = "clean",
):
    """Yield (encoded image, label): mostly JPEG, some PNG (both occur in real OCR LMDBs);
    ``domain`` (DOMAINS) changes how the rendered line looks."""
    rng = np.random.default_rng(seed)
    look = DOMAINS[domain]
    for _ in range(num):
        text = random_text(charset, rng, max_len=max_len)
        image = render_text_line(text, font_path, rng)
        if look is not None:
            image = look(image, rng)
        fmt = "png" if rng.random() < png_fraction else "jpeg"
        yield encode_image(image, fmt), text


NOISE_SIGMA = 21.0
_PATTERNS = ("stripes", "rings", "checks", "blobs")


def imagenet_like(label: int, rng: np.random.Generator) -> np.ndarray:
    """A BGR image whose pattern, orientation, frequency and palette depend on the class."""
    klass = np.random.default_rng(10_000 + label)  # class identity: same for every seed
    pattern = _PATTERNS[label % len(_PATTERNS)]
    palette = klass.integers(30, 226, (2, 3)).astype(np.float32)
    freq, angle = klass.uniform(0.02, 0.09), klass.uniform(0, np.pi)
    width, height = int(rng.integers(440, 520)), int(rng.integers(330, 400))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x += rng.uniform(-60, 60)
    y += rng.uniform(-60, 60)
    f = freq * rng.uniform(0.85, 1.15)
    if pattern == "stripes":
        field = np.sin(f * (x * np.cos(angle) + y * np.sin(angle)))
    elif pattern == "rings":
        field = np.sin(f * np.hypot(x - width / 2, y - height / 2))
    elif pattern == "checks":
        field = np.sign(np.sin(f * x)) * np.sign(np.sin(f * y))
    else:
        field = np.sin(f * x + 2 * np.sin(f * 0.7 * y)) * np.cos(f * 1.3 * y)
    mix = (field[:, :, None] + 1) / 2
    image = palette[0] * mix + palette[1] * (1 - mix)
    # Texture noise: sets the JPEG size near ImageNet's ~100 KB at quality 90.
    image += rng.standard_normal(image.shape, dtype=np.float32) * np.float32(NOISE_SIGMA)
    return np.clip(image, 0, 255).astype(np.uint8)


# The tags of the ImageNet-like images, what each shows (imagenet_tags): its pattern, whether
# its palette is bright, whether it is warm (more red than blue). A class always has the same.
IMAGENET_TAG_NAMES = (*_PATTERNS, "bright", "warm")


def imagenet_tags(label: int) -> tuple[int, ...]:
    """The ids (in IMAGENET_TAG_NAMES) of the tags every image of class ``label`` shows."""
    klass = np.random.default_rng(10_000 + label)  # as imagenet_like draws the palette
    palette = klass.integers(30, 226, (2, 3)).astype(np.float32)  # BGR
    tags = [label % len(_PATTERNS)]
    if palette.mean() > 128:
        tags.append(len(_PATTERNS))
    if palette[:, 2].mean() > palette[:, 0].mean():
        tags.append(len(_PATTERNS) + 1)
    return tuple(tags)


def imagenet_samples(
    num: int, num_classes: int, seed: int, with_tags: bool = False
) -> Iterable[tuple]:
    """(encoded JPEG, class) per image; ``with_tags``: (encoded JPEG, class, key, tag ids), what
    Hdf5ImageWriter.add takes for a file written with IMAGENET_TAG_NAMES."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        label = i % num_classes  # balanced classes
        image = encode_image(imagenet_like(label, rng), "jpeg", 90)
        yield (image, label, f"img{i}.jpg", imagenet_tags(label)) if with_tags else (image, label)


def write_all(writer, samples, progress: Callable | None = None) -> Path:
    """Feed samples into a writer; on any error (or Ctrl-C) remove the partial output."""
    try:
        for sample in samples:
            writer.add(*sample)
            if progress:
                progress()
    except BaseException:
        writer.abort()
        raise
    return writer.finish()
