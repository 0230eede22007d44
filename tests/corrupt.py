"""Builders of datasets with known corrupt records, one per bad-sample kind.

Everything is written with the project's writers, then damaged the way real data gets damaged
(a deleted key, a cut-off file, bytes of the wrong kind).
"""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np

from datasets.lmdb_ocr import LmdbOcrWriter
from datasets.synthetic import LATIN, encode_image, render_text_line

MAX_TEXT_LENGTH = 25


def _good(text: str, fmt: str, seed: int) -> bytes:
    return encode_image(render_text_line(text, None, np.random.default_rng(seed)), fmt)


def corrupt_records() -> list[tuple[str, bytes, str]]:
    """(expected kind or "ok", image bytes, label) in record order."""
    jpeg, png = _good("abc123", "jpeg", 0), _good("xyz789", "png", 1)
    return [
        ("ok", jpeg, "abc123"),
        ("ok", png, "xyz789"),
        ("empty_image", b"", "abc"),
        ("garbage_image", b"this is not an image at all" * 4, "abc"),
        ("truncated_image", jpeg[: len(jpeg) // 2], "abc"),
        ("truncated_image", png[: len(png) // 2], "abc"),
        ("undecodable_image", b"\xff\xd8\xff\xe0" + bytes(range(256)) * 3 + b"\xff\xd9", "abc"),
        ("empty_label", jpeg, "   "),
        ("label_too_long", jpeg, "a" * (MAX_TEXT_LENGTH + 5)),
        ("label_out_of_dict", jpeg, "h\u00e9llo"),
        ("missing_key", jpeg, "abc"),  # its image key is deleted below
        ("ok", _good("Q9", "jpeg", 2), "Q9"),
    ]


def write_corrupt_lmdb(out_dir: Path, good_padding: int = 0) -> tuple[Path, dict[str, int]]:
    """An OCR LMDB with one record of each bad kind (two truncated) plus ``good_padding`` extra
    good records; returns (path, expected count per kind)."""
    records = corrupt_records()
    writer = LmdbOcrWriter(out_dir)
    for _, image, label in records:
        writer.add(image, label)
    for i in range(good_padding):
        writer.add(_good(f"pad{i}", "jpeg", 100 + i), f"pad{i}")
    writer.finish()
    missing = [n for n, (kind, _, _) in enumerate(records, 1) if kind == "missing_key"]
    env = lmdb.open(str(out_dir), subdir=True)
    with env.begin(write=True) as txn:
        for number in missing:
            txn.delete(b"image-%09d" % number)
    env.close()
    expected: dict[str, int] = {}
    for kind, _, _ in records:
        if kind != "ok":
            expected[kind] = expected.get(kind, 0) + 1
    return out_dir, expected


def write_charset(path: Path) -> Path:
    path.write_text("".join(c + "\n" for c in LATIN), encoding="utf-8")
    return path
