"""Errors raised by the data layer. Each message names the problem, the file and the fix."""

from __future__ import annotations

from pathlib import Path


class DatasetError(Exception):
    """A whole dataset cannot be used: wrong path, wrong format, wrong schema, damaged file."""

    def __init__(self, problem: str, hint: str = "") -> None:
        self.problem = problem
        self.hint = hint
        super().__init__(f"{problem}. HINT: {hint}" if hint else problem)


class CacheSpaceError(DatasetError):
    """``data.cache: disk`` cannot get the room its file needs in the cache folder (a full
    volume, a quota, the file-size limit). The trainer exits 4, as for any write that runs out
    of room (train/errors.py)."""


def read_utf8(path: str | Path, what: str, fix: str) -> str:
    """The text of ``path``, a file of metadata (``what``: a character dictionary, a key list),
    or a DatasetError naming the file and where its first byte that is not UTF-8 lies, with
    ``fix``: such a file cannot be read, and reading it as another encoding would give other
    characters than the file's writer meant."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DatasetError(
            f"{what} {path} is not UTF-8 text: byte {data[exc.start]:#04x} on line {line} "
            f"({exc.reason})",
            fix,
        ) from None


class BadSampleError(Exception):
    """One record cannot be turned into a sample. ``kind`` is one of ``BAD_SAMPLE_KINDS``."""

    def __init__(self, kind: str, reason: str) -> None:
        if kind not in BAD_SAMPLE_KINDS:
            raise ValueError(f"unknown bad-sample kind {kind!r}")
        self.kind = kind
        self.reason = reason
        super().__init__(f"{kind}: {reason}")


class TooManyBadSamplesError(Exception):
    """Raised when the bad fraction of an epoch passes ``max_bad_fraction``."""


# Every way a record can be bad. The order is the column order of reports.
BAD_SAMPLE_KINDS = (
    "missing_key",  # the index points at a record that is not in the file
    "read_error",  # the storage layer failed to return the record's bytes
    "empty_image",  # zero bytes
    "garbage_image",  # bytes that are not any image format we know
    "truncated_image",  # a known format that ends early (JPEG without EOI, PNG without IEND)
    "undecodable_image",  # a known, complete-looking format that the decoder rejects
    "empty_label",  # OCR label is empty or whitespace
    "label_too_long",  # OCR label longer than max_text_length after encoding
    "label_out_of_dict",  # OCR label has characters missing from the character dictionary
    "bad_label",  # classification label outside [0, num_classes)
    "image_too_large",  # more pixels than data.max_image_pixels (a decompression bomb, a scan)
)
