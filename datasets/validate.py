"""Scan every record of an OCR LMDB (tree), a ResNet-50 HDF5 file or an image folder and classify
the bad ones.

Uses the same checks as training (decode.check_encoded, a full decode, the label rules), so a
dataset that validates clean has no bad samples in training, and the report's lines have the
format of the bad-keys file (key, kind, file, reason) so it can be passed as data.skip_keys_file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from datasets import decode, sources
from datasets.errors import BadSampleError
from datasets.ocr_transforms import CharDict

# What scan reads: every format with a record source (an image folder is a classification
# task's training data as an HDF5 file is); datasets/sources.py decides which a path is.
SCANNED = sources.RECORD_FORMATS
READER = "scripts/validate_data.py"


@dataclass
class ScanReport:
    path: str
    kind: str
    total: int = 0
    bad: list[tuple[str, str, str, str]] = field(default_factory=list)  # key, kind, file, reason

    def lines(self) -> Iterator[str]:
        for key, kind, source, reason in self.bad:
            yield f"{key}\t{kind}\t{source}\t{reason}"
        yield f"{len(self.bad)} bad of {self.total} records in {self.path}"


def detect_kind(path: str | Path) -> str:
    """The format of ``path`` (datasets/sources.py's name), or a DatasetError when scan cannot
    read it: a missing path, an image file."""
    return sources.check_format(path, SCANNED, reader=READER)


def _check_image_fully(data: bytes) -> None:
    """Decode every pixel with the decoder training uses (training may decode at reduced scale;
    validation must not), so a record that passes here cannot fail there."""
    decode.decode_rgb(data)


def scan(
    path: str | Path, char_dict: CharDict | None = None, max_text_length: int = 25, progress=None
) -> ScanReport:
    kind = detect_kind(path)
    report = ScanReport(str(path), kind)
    source = sources.open_source(path, SCANNED, reader=READER)
    num_classes = len(getattr(source, "class_names", ()))
    for index in range(len(source)):
        report.total += 1
        try:
            data, label = source.read(index)
            if kind == sources.OCR_LMDB:
                if char_dict is not None:
                    char_dict.encode(label, max_text_length)
                elif not label.strip():
                    raise BadSampleError("empty_label", "label is empty")
            elif not 0 <= label < num_classes:
                raise BadSampleError("bad_label", f"class {label} outside 0..{num_classes - 1}")
            _check_image_fully(data)
        except BadSampleError as error:
            report.bad.append(
                (source.key(index), error.kind, source.source_of(index), error.reason)
            )
        if progress:
            progress()
    source.close()
    return report
