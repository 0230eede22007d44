"""The config's field types (each carries its own range check) and the data section every
task's has (DataConfig); a task's own data keys extend it (Task.data, train/tasks.py).

Imports nothing of train.tasks: train/tasks.py and the modules of train/task_modules/ define
their data sections with these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from datasets.cache import DEFAULT_CACHE_DIR, DEFAULT_CACHE_MAX_BYTES
from datasets.limits import MAX_IMAGE_PIXELS
from train.config.errors import ConfigError


@dataclass(frozen=True)
class Bounds:
    """Range check attached to a type with Annotated, e.g. Annotated[int, Bounds(low=1)]."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: value must be strictly greater than low
    hint: str = ""

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"between {self.low} and {self.high}"
        if self.low is not None:
            return f"> {self.low}" if self.low_open else f">= {self.low}"
        return f"<= {self.high}"

    def check(self, value: float, key: str) -> None:
        too_low = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        if too_low or (self.high is not None and value > self.high):
            raise ConfigError(key, f"must be {self.describe()}, got {value}", self.hint)


BYTES = "bytes"  # Annotated marker: the field also accepts size strings such as 512m or 8g
# Annotated marker of a float field for which an infinity is a documented value (say, "no
# limit"). Every other float field refuses both infinities, and every float field refuses NaN
# (train/config/validate.py): NaN passes every range check, since each comparison with it is
# false, and an infinity would reach the optimizer or a timer as a number.
INFINITY = "infinity allowed"
ByteSize = Annotated[int, BYTES]
PositiveInt = Annotated[int, Bounds(low=1)]
NonNegativeInt = Annotated[int, Bounds(low=0)]
PositiveFloat = Annotated[float, Bounds(low=0, low_open=True)]
NonNegativeFloat = Annotated[float, Bounds(low=0)]
Fraction = Annotated[float, Bounds(low=0, high=1)]
WorkerCount = Annotated[int, Bounds(low=0, hint="use 0 to load in the main process, or 'auto'")]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What every task's data section has; a task's own keys are in its subclass (Task.data)."""

    train: str  # dataset: a local path (relative to the repository root) or an s3:// URL
    val: str | None = None  # validation dataset, as train; None: no evaluation
    augment: bool = True  # training-time augmentation (never for evaluation)
    cache: Literal["none", "memory", "disk"] = "none"  # shared by all workers, bounded below
    cache_dir: str = DEFAULT_CACHE_DIR  # cache: disk keeps its memory-mapped file here
    cache_max_bytes: ByteSize = DEFAULT_CACHE_MAX_BYTES  # the cache's bound (memory or disk)
    max_bad_fraction: Fraction = 0.01  # abort when more samples than this fail to decode
    # An image with more pixels (read from its header, before decoding) is a bad sample of
    # kind image_too_large: 40 M fits ImageNet's largest photos and long text lines, and keeps a
    # 20000 x 20000 scan or a PNG decompression bomb from taking a worker's memory.
    max_image_pixels: PositiveInt = MAX_IMAGE_PIXELS
    skip_keys_file: str | None = None  # keys to skip, one per line (e.g. an earlier run's)
    remote_cache_dir: str = ".cache/remote"  # where s3:// data is staged before reading
    remote_cache_max_bytes: ByteSize | None = None  # None: no limit
