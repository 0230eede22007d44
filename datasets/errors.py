"""Errors raised by the data layer. Each message names the problem, the file and the fix."""

from __future__ import annotations


class DatasetError(Exception):
    """A whole dataset cannot be used: wrong path, wrong format, wrong schema, damaged file."""

    def __init__(self, problem: str, hint: str = "") -> None:
        self.problem = problem
        self.hint = hint
        super().__init__(f"{problem}. HINT: {hint}" if hint else problem)


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
