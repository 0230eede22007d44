#!/usr/bin/env python
r"""Generate synthetic datasets that a model can learn from.

  python -m scripts.make_synthetic ocr --out data/synth_ocr --num 6000 --seed 0
  python -m scripts.make_synthetic imagenet --out data/synth_imagenet/train.h5 --num 2000 \
      --classes 10 --seed 0

ocr writes OUT/train and OUT/val (OCR LMDBs in PaddleOCR's layout) and OUT/charset.txt (one
character per line). imagenet writes one HDF5 file; write val with another --seed and the same
--classes (class appearance depends on the class only). The file also holds each image's tags
(pattern, bright, warm), which multi-label tasks read.
"""

from __future__ import annotations

import argparse
import os
import time

from datasets.synthetic import DOMAINS
from scripts import _cli


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def make_ocr(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from datasets.errors import DatasetError
    from datasets.lmdb_ocr import LmdbOcrWriter, check_replaceable, written_here
    from datasets.safe_files import write_atomic
    from datasets.synthetic import ocr_charset, ocr_samples, write_all

    out = os.path.abspath(args.out)
    if args.font and not os.path.isfile(args.font):
        raise DatasetError(f"--font {args.font}: no such file", "pass a .ttf/.otf/.ttc font file")
    charset, font = ocr_charset(args.charset, args.font)
    num_val = max(1, int(round(args.num * args.val_fraction)))
    num_train = args.num - num_val
    if num_train < 1:
        raise DatasetError(f"--num {args.num} leaves no training samples", "raise --num")
    splits = (("train", num_train, args.seed), ("val", num_val, args.seed + 1_000_003))
    # Refuse before writing anything: each split replaces only an LMDB of ours (--overwrite),
    # and charset.txt only beside one, or one with the same characters (a rerun after an
    # interruption): a charset.txt in a folder of other things is not ours.
    for split, _, _ in splits:
        check_replaceable(os.path.join(out, split), args.overwrite)
    charset_path = os.path.join(out, "charset.txt")
    text = "".join(c + "\n" for c in charset)
    if os.path.lexists(charset_path) and not (
        (args.overwrite and any(written_here(os.path.join(out, s)) for s, _, _ in splits))
        or (os.path.isfile(charset_path) and _read(charset_path) == text)
    ):
        raise DatasetError(
            f"{charset_path} already exists and {out} holds no dataset of this script to replace "
            "with it",
            "pick an empty or new --out",
        )
    os.makedirs(out, exist_ok=True)
    write_atomic(charset_path, text)
    start = time.perf_counter()
    for split, count, seed in splits:
        with tqdm(total=count, desc=f"ocr {split}", disable=args.quiet) as bar:
            samples = ocr_samples(
                count, charset, font, seed, max_len=args.max_len, domain=args.domain
            )
            write_all(LmdbOcrWriter(os.path.join(out, split), args.overwrite), samples, bar.update)
    elapsed = time.perf_counter() - start
    print(
        f"wrote {args.num} text lines ({args.domain}, {len(charset)} characters, "
        f"font {font or 'PIL default'}) "
        f"to {out} in {elapsed:.1f}s ({args.num / elapsed:.0f} samples/s)"
    )
    return 0


def make_imagenet(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from datasets.hdf5_images import Hdf5ImageWriter
    from datasets.synthetic import IMAGENET_TAG_NAMES, imagenet_samples, write_all

    names = [f"class_{i:04d}" for i in range(args.classes)]
    # Each image's tags too: a multi-label task trains on the same files.
    writer = Hdf5ImageWriter(
        args.out, names, overwrite=args.overwrite, tag_names=list(IMAGENET_TAG_NAMES)
    )
    start = time.perf_counter()
    samples = imagenet_samples(args.num, args.classes, args.seed, with_tags=True)
    with tqdm(total=args.num, desc="imagenet", disable=args.quiet) as bar:
        write_all(writer, samples, bar.update)
    elapsed = time.perf_counter() - start
    size = os.path.getsize(args.out)
    print(
        f"wrote {args.num} images in {args.classes} classes to {args.out} "
        f"({size / args.num / 1e3:.0f} KB/image) in {elapsed:.1f}s "
        f"({args.num / elapsed:.0f} samples/s)"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    ocr = sub.add_parser("ocr", help="rendered text lines into train/val OCR LMDBs")
    ocr.add_argument("--out", required=True, help="output folder (train/, val/, charset.txt)")
    ocr.add_argument("--num", type=int, default=6000, help="total lines, train + val")
    ocr.add_argument("--val-fraction", type=float, default=0.1)
    ocr.add_argument(
        "--charset",
        choices=("digits", "latin", "full"),
        default="latin",
        help="full adds common Chinese characters when a CJK font is installed",
    )
    ocr.add_argument("--max-len", type=int, default=10, help="longest generated line")
    ocr.add_argument("--font", help="render with this font (default: one found on the host)")
    ocr.add_argument(
        "--domain",
        choices=tuple(DOMAINS),
        default="clean",
        help="dot_matrix: ink only on a grid of dots, hard for PP-OCRv4 (docs/ppocrv4.md)",
    )
    imagenet = sub.add_parser("imagenet", help="ImageNet-like JPEGs into one HDF5 file")
    imagenet.add_argument("--out", required=True, help="output .h5 file")
    imagenet.add_argument("--num", type=int, default=2000)
    imagenet.add_argument("--classes", type=int, default=10)
    for p in (ocr, imagenet):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--overwrite", action="store_true", help="replace existing output")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if args.num < 1:
        parser.error("--num must be at least 1")
    return make_ocr(args) if args.kind == "ocr" else make_imagenet(args)


if __name__ == "__main__":
    _cli.run(main)
