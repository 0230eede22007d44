#!/usr/bin/env python
r"""Convert existing datasets into the project's formats (atomic; never overwrites silently).

  python -m scripts.convert paddleocr-labels --labels train_list.txt --data-dir images/ \
      --out data/my_ocr/train
  python -m scripts.convert image-folder --root imagenet/train --out data/imagenet/train.h5
  python -m scripts.convert hdf5-upgrade --src old/train.h5 --out data/imagenet/train.h5

Image bytes are copied as they are, never re-encoded.
"""

from __future__ import annotations

import argparse

from scripts import _cli


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    labels = sub.add_parser("paddleocr-labels", help="PaddleOCR 'path<TAB>label' file -> OCR LMDB")
    labels.add_argument("--labels", required=True, help="label file, one 'path<TAB>label' per line")
    labels.add_argument(
        "--data-dir", required=True, help="folder the label file's paths are relative to"
    )
    labels.add_argument("--out", required=True, help="output LMDB directory")
    labels.add_argument(
        "--strict", action="store_true", help="abort on a missing image or empty label"
    )
    folder = sub.add_parser("image-folder", help="root/<class>/<image> -> ResNet-50 HDF5")
    folder.add_argument("--root", required=True)
    folder.add_argument("--out", required=True, help="output .h5 file")
    upgrade = sub.add_parser(
        "hdf5-upgrade", help="ResNet-50 HDF5 of an older schema -> the current one (faster reads)"
    )
    upgrade.add_argument("--src", required=True, help="the .h5 file to rewrite")
    upgrade.add_argument("--out", required=True, help="output .h5 file (not --src itself)")
    for p in (labels, folder, upgrade):
        p.add_argument("--overwrite", action="store_true", help="replace existing output")
    args = parser.parse_args()

    from tqdm import tqdm

    from datasets import convert

    if args.kind == "paddleocr-labels":
        rows = len(convert.read_paddleocr_labels(__import__("pathlib").Path(args.labels)))
        with tqdm(total=rows, desc="convert") as bar:
            path, count, problems = convert.paddleocr_labels_to_lmdb(
                args.labels, args.data_dir, args.out, args.overwrite, args.strict, bar.update
            )
        for problem in problems:
            print(f"skipped: {problem}")
        print(f"wrote {count} samples to {path}; skipped {len(problems)}")
    elif args.kind == "hdf5-upgrade":
        with tqdm(desc="upgrade") as bar:
            path, count = convert.upgrade_hdf5(args.src, args.out, args.overwrite, bar.update)
        print(f"wrote {count} images to {path}")
    else:
        with tqdm(desc="convert") as bar:
            path, count = convert.image_folder_to_hdf5(
                args.root, args.out, args.overwrite, bar.update
            )
        print(f"wrote {count} images to {path}")
    return 0


if __name__ == "__main__":
    _cli.run(main)
