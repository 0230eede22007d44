#!/usr/bin/env python
"""Scan an OCR LMDB (or a tree of them), a ResNet-50 HDF5 file or an image folder; report bad
records.

  python -m scripts.validate_data data/synth_ocr/train --char-dict data/synth_ocr/charset.txt
  python -m scripts.validate_data data/synth_imagenet/train.h5

Prints one line per bad record (key, kind, file, reason: the bad-keys file format, usable as
data.skip_keys_file), then "N bad of M records in PATH". Exit 0 when clean, 1 when any record is
bad, 2 when the dataset itself cannot be read.
"""

from __future__ import annotations

import argparse

from scripts import _cli


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", help="OCR LMDB directory (or tree), HDF5 file or image folder")
    parser.add_argument("--char-dict", help="OCR: also check labels against this dictionary")
    parser.add_argument("--use-space-char", action="store_true")
    parser.add_argument("--max-text-length", type=int, default=25)
    parser.add_argument("--bad-keys-out", help="also write the bad lines to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()

    from tqdm import tqdm

    from datasets.ocr_transforms import CharDict
    from datasets.safe_files import write_atomic
    from datasets.validate import detect_kind, scan

    detect_kind(args.path)  # a wrong path fails here, before the progress bar starts
    char_dict = CharDict.from_file(args.char_dict, args.use_space_char) if args.char_dict else None
    with tqdm(desc="scan", disable=args.quiet) as bar:
        report = scan(args.path, char_dict, args.max_text_length, bar.update)
    lines = list(report.lines())
    print("\n".join(lines))
    if args.bad_keys_out:
        write_atomic(args.bad_keys_out, "".join(line + "\n" for line in lines[:-1]))
    return 1 if report.bad else 0


if __name__ == "__main__":
    _cli.run(main)
