"""Benchmark datasets, generated once under bench/data/ and reused by later runs.

One ImageNet-like HDF5 file (500x375-ish JPEG q90, ~95 KB) plus the same JPEG bytes written to
an ImageFolder tree, so ours and torchvision's recipe decode byte-identical files; one OCR LMDB
with JPEG and PNG records (as real OCR LMDBs have) and, only if the PaddleOCR peer cannot read
PNG records (the zlib crash in the Paddle env, docs/paddle_png_zlib.md), a JPEG-only twin.
A ``done.json`` stamp records what was written: a folder without it is regenerated.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from datasets.hdf5_images import SCHEMA_VERSION as HDF5_SCHEMA_VERSION
from datasets.hdf5_images import Hdf5ImageWriter
from datasets.lmdb_ocr import LmdbOcrWriter
from datasets.synthetic import LATIN, find_font, imagenet_samples, ocr_samples, write_all

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "bench" / "data"
IMAGE_CLASSES = 10


def _fresh(folder: Path, spec: dict) -> bool:
    stamp = folder / "done.json"
    return stamp.is_file() and json.loads(stamp.read_text())["spec"] == spec


def _stamp(folder: Path, spec: dict, started: float) -> None:
    info = {"spec": spec, "seconds": round(time.perf_counter() - started, 2)}
    (folder / "done.json").write_text(json.dumps(info))


def image_data(num: int, seed: int = 0) -> dict[str, str]:
    """{"hdf5": path, "folder": ImageFolder root} holding the same ``num`` JPEGs."""
    folder = DATA_DIR / f"imagenet-{num}-s{seed}"
    spec = {"kind": "imagenet", "num": num, "seed": seed, "classes": IMAGE_CLASSES}
    spec["hdf5_schema"] = HDF5_SCHEMA_VERSION  # a file of an older layout is written again
    paths = {"hdf5": str(folder / "train.h5"), "folder": str(folder / "jpeg")}
    if _fresh(folder, spec):
        return paths
    started = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "jpeg").mkdir(parents=True)
    names = [f"class_{i:04d}" for i in range(IMAGE_CLASSES)]
    writer = Hdf5ImageWriter(folder / "train.h5", names)

    def samples():
        for i, (data, label) in enumerate(imagenet_samples(num, IMAGE_CLASSES, seed)):
            class_dir = folder / "jpeg" / names[label]
            class_dir.mkdir(exist_ok=True)
            (class_dir / f"{i:06d}.jpg").write_bytes(data)
            yield data, label, f"{names[label]}/{i:06d}.jpg"

    write_all(writer, samples())
    _stamp(folder, spec, started)
    return paths


def ocr_data(num: int, seed: int = 0) -> dict[str, str]:
    """{"mixed": LMDB with ~20% PNG records, "charset": dictionary file}."""
    folder = DATA_DIR / f"ocr-{num}-s{seed}"
    paths = {"mixed": str(folder / "mixed"), "charset": str(folder / "charset.txt")}
    _ocr_lmdb(folder, "mixed", num, seed, png_fraction=0.2)
    return paths


def ocr_jpeg_only(num: int, seed: int = 0) -> str:
    """The same text lines, all JPEG: for a peer that cannot read PNG records. Written only
    when needed, since it doubles the OCR generation time."""
    folder = DATA_DIR / f"ocr-{num}-s{seed}-jpeg"
    _ocr_lmdb(folder, "jpeg", num, seed, png_fraction=0.0)
    return str(folder / "jpeg")


def _ocr_lmdb(folder: Path, name: str, num: int, seed: int, png_fraction: float) -> None:
    spec = {"kind": "ocr", "num": num, "seed": seed, "png": png_fraction, "font": 1}
    if _fresh(folder, spec):
        return
    started = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "charset.txt").write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    # A TrueType font gives realistic 30-45 px lines; max_len 25 is the peer's max_text_length.
    samples = ocr_samples(num, LATIN, find_font(cjk=False), seed, png_fraction, 25)
    write_all(LmdbOcrWriter(folder / name), samples)
    _stamp(folder, spec, started)
