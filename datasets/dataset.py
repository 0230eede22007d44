"""Map-style datasets over a record source, framework-free.

``RecordDataset[i]`` reads record i (through the shared cache when there is one), runs the
task's transform with a random generator seeded by (seed, epoch, i), and returns a dict of
numpy arrays. The per-sample seed makes augmentation independent of which worker ran the
sample and of the number of workers, so a resumed or re-sharded run sees the same data.

Items may be plain ints (the epoch then comes from the shared state that the main process sets
with ``start_epoch``) or ``(epoch, index)`` pairs, which samplers in train/ use so that a batch
prefetched across an epoch boundary still gets the right seed. A ``WholeBatch`` of such items
returns the whole batch, one array per field (``get_batch``: the backends' loaders use it at 0
workers); a transform whose ``fills_rows`` is true then also takes ``out=``, the sample's rows of
the batch, and writes the sample there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np

from datasets import decode, faults, image_transforms
from datasets.bad_samples import BadSampleLog, read_bad_keys, read_bad_kinds
from datasets.batch_buffers import BatchBuffers
from datasets.cache import DEFAULT_CACHE_DIR, DEFAULT_CACHE_MAX_BYTES, SharedRecordCache
from datasets.errors import BAD_SAMPLE_KINDS, BadSampleError, DatasetError, TooManyBadSamplesError
from datasets.handles import die_with_parent
from datasets.in_flight import RAISED, RAISED_DATA_ERROR, InFlightTable
from datasets.ocr_transforms import CharDict, augment_text_line, resize_and_pad
from datasets.sampler import WholeBatch

if TYPE_CHECKING:
    # typing.Unpack is new in Python 3.11 and the Paddle GPU image runs 3.10; the annotations
    # below are strings (from __future__ import annotations), so only a type checker needs it.
    from typing import Unpack

Sample = dict[str, np.ndarray]
Transform = Callable[[bytes, "str | int", np.random.Generator], Sample]


class RecordSource(Protocol):
    def __len__(self) -> int: ...
    def read(self, index: int) -> tuple[bytes, str | int]: ...
    def key(self, index: int) -> str: ...
    def index_of_key(self, key: str) -> int | None: ...
    def source_of(self, index: int) -> str: ...
    def close(self) -> None: ...


class SampleRng:
    """The sample's ``np.random.Generator``, seeded from (seed, epoch, index) on first use:
    seeding costs about 15 us, a tenth of an OCR sample, and a transform that does not augment
    never draws."""

    __slots__ = ("_key", "_rng")

    def __init__(self, key: tuple[int, int, int]) -> None:
        self._key = key
        self._rng: np.random.Generator | None = None

    def __getattr__(self, name: str):
        if self._rng is None:
            self._rng = np.random.default_rng(self._key)
        return getattr(self._rng, name)


class RecordDataset:
    def __init__(
        self,
        source: RecordSource,
        transform: Transform,
        *,
        seed: int = 0,
        bad_log: BadSampleLog | None = None,
        cache: SharedRecordCache | None = None,
        skip_keys: list[str] = (),
        max_substitutions: int = 32,
    ) -> None:
        self.source = source
        self.transform = transform
        self.seed = seed
        self.cache = cache
        self.max_substitutions = max_substitutions
        self._indices = self._without_skipped(skip_keys)
        self.bad_log = bad_log or BadSampleLog(len(source), max_bad_fraction=1.0)
        # A resumed run appends to the same bad-keys file: what it holds is reported already.
        self._known_bad = self._bad_in_keys_file()
        self.bad_log.mark_reported(self._known_bad)
        self.in_flight = InFlightTable()
        self.batch_buffers = BatchBuffers()  # get_batch's arrays, reused once dropped
        self._owner_pid = os.getpid()

    def _without_skipped(self, skip_keys: list[str]) -> np.ndarray | None:
        """int64 array of kept source indices, or None when every record is kept."""
        if not skip_keys:
            return None
        skipped = [self.source.index_of_key(k) for k in skip_keys]
        skipped = np.array([i for i in skipped if i is not None], dtype=np.int64)
        kept = np.setdiff1d(np.arange(len(self.source), dtype=np.int64), skipped)
        if len(kept) == 0:
            raise DatasetError("every record is in the skip-keys file", "check data.skip_keys_file")
        return kept

    def __len__(self) -> int:
        return len(self.source) if self._indices is None else len(self._indices)

    def _source_index(self, position: int) -> int:
        return position if self._indices is None else int(self._indices[position])

    def _read(self, index: int) -> tuple[bytes, str | int]:
        if self.cache is None:
            faults.storage_latency()
            return self.source.read(index)
        record = self.cache.get(index)
        if record is None:
            faults.storage_latency()
            record = self.source.read(index)
            self.cache.put(index, record)
        return record

    def start_worker(self) -> None:
        """First thing in a loader worker (the backends' worker_init_fn): tie the worker's life
        to the trainer's, see handles.die_with_parent."""
        faults.delay_start()
        die_with_parent(self._owner_pid)

    def __getitem__(self, item: int | tuple[int, int] | WholeBatch) -> Sample:
        if isinstance(item, WholeBatch):
            return self.get_batch(item.items)
        return self._sample(item)

    def get_batch(self, items: list) -> Sample:
        """The samples of ``items`` as one array per field, as stacking ``[self[i] for i in
        items]`` would give them. The first sample fixes each field's shape and dtype; a
        transform with ``fills_rows`` then writes every later sample straight into its row of
        the batch (OCR: the resize lands in the batch), which saves a per-sample array and the
        stacking copy, a tenth of an OCR sample's time at 0 workers. Other transforms' samples
        are copied into their rows. The batch's arrays come from ``batch_buffers``: those of an
        earlier batch that nothing refers to any more, so filling them takes no page faults."""
        # The epoch is the same for the whole batch: read it from the shared log once, not per
        # sample (a mapped-file read, 2-3% of an OCR sample at 0 workers).
        epoch = self.bad_log.epoch
        items = [item if isinstance(item, tuple) else (epoch, item) for item in items]
        first = self._sample(items[0])
        batch = {
            key: self.batch_buffers.empty((len(items), *np.shape(value)), np.asarray(value).dtype)
            for key, value in first.items()
        }
        fills_rows = getattr(self.transform, "fills_rows", False)
        for row, item in enumerate(items):
            # array[row, ...] is a view even for a 1-d field (a 0-d array), so it can be written
            rows = {key: array[row, ...] for key, array in batch.items()}
            sample = first if row == 0 else self._sample(item, rows if fills_rows else None)
            if sample is not rows:
                _copy_into_rows(rows, sample)
        return batch

    def _sample(self, item: int | tuple[int, int], rows: Sample | None = None) -> Sample:
        """One sample; with ``rows``, the transform writes it into those arrays and returns
        them (a substituted bad record overwrites them whole)."""
        die_with_parent(self._owner_pid)  # for loaders built without our worker_init_fn
        epoch, position = item if isinstance(item, tuple) else (self.bad_log.epoch, item)
        position = int(position)
        for attempt in range(self.max_substitutions + 1):
            # Substitute with the next record: deterministic, keeps the batch size.
            index = self._source_index((position + attempt) % len(self))
            self.in_flight.start(index)
            try:
                faults.maybe_inject(index)
                data, label = self._read(index)
                rng = SampleRng((self.seed, epoch, index))
                if rows is None:
                    sample = self.transform(data, label, rng)
                else:
                    sample = self.transform(data, label, rng, out=rows)
                self.in_flight.done()
                return sample
            except BadSampleError as error:
                self.in_flight.done()
                self.bad_log.record(
                    index,
                    self.source.key(index),
                    self.source.source_of(index),
                    error,
                    counted=attempt == 0,
                )
            except BaseException as error:
                # Left in the table, marked: the trainer then reports what raised on which
                # sample, not a dead worker (the loader re-raises this in the trainer, where
                # Paddle keeps only its text and torch may change its type).
                data_error = isinstance(error, (DatasetError, TooManyBadSamplesError))
                self.in_flight.raised(data_error)
                raise
        first = self._source_index(position % len(self))  # positions past the end wrap
        self.in_flight.start(first)
        self.in_flight.raised(data_error=True)
        raise TooManyBadSamplesError(
            f"{self.max_substitutions + 1} consecutive bad records from position {position} "
            f"({self.source.key(first)}). HINT: run "
            "scripts/validate_data.py on the dataset"
        )

    def _bad_in_keys_file(self) -> dict[int, str]:
        """{source index: kind} of the records the bad-keys file holds (a resumed run's)."""
        if not self.bad_log.bad_keys_file:
            return {}
        found = {}
        for key, kind in read_bad_kinds(self.bad_log.bad_keys_file).items():
            index = self.source.index_of_key(key)
            if index is not None and kind in BAD_SAMPLE_KINDS:
                found[index] = kind
        return found

    def start_epoch(self, epoch: int) -> None:
        self.bad_log.start_epoch(epoch)

    def count_resumed(self, positions) -> None:
        """After start_epoch on resume: count the bad records among the positions the epoch
        consumed before the checkpoint (the run before wrote them to the bad-keys file), so that
        the epoch's counts are those of an uninterrupted run."""
        indices = (self._source_index(int(p)) for p in positions)
        self.bad_log.add_counts([self._known_bad[i] for i in indices if i in self._known_bad])

    def describe_in_flight(self, hung_after_s: float | None = None) -> dict[str, list[str]]:
        """The samples processes were on when a loader failed, one line each, by what happened:
        ``died`` (the process is gone: it crashed on the sample), ``hung`` (still reading it
        after ``hung_after_s``), ``raised_data_error`` / ``raised`` (its code raised on it). A
        worker still reading for less than ``hung_after_s`` is innocent and left out."""
        found: dict[str, list[str]] = {
            "died": [],
            "hung": [],
            "raised_data_error": [],
            "raised": [],
        }
        for pid, index, seconds, alive, state in self.in_flight.rows():
            key, file = self.source.key(index), self.source.source_of(index)
            where = f"sample #{index} (key {key}, file {file})"
            if state == RAISED_DATA_ERROR:
                found["raised_data_error"].append(f"process pid {pid} raised on {where}")
            elif state == RAISED:
                found["raised"].append(f"process pid {pid} raised on {where}")
            elif not alive:
                found["died"].append(f"worker pid {pid} died while reading {where}")
            elif hung_after_s is not None and seconds >= hung_after_s:
                found["hung"].append(f"worker pid {pid} running for {seconds:.0f}s on {where}")
        return found

    def close(self) -> None:
        self.source.close()
        self.bad_log.close()
        self.in_flight.close()
        if self.cache is not None:
            self.cache.close()


def _copy_into_rows(rows: Sample, sample: Sample) -> None:
    """Copy a sample into its rows of a batch; a field whose shape differs from the first
    sample's is an error (broadcasting would hide it), as it is for np.stack."""
    if sample.keys() != rows.keys():
        raise ValueError(
            f"sample fields {sorted(sample)} differ from the batch's first sample's {sorted(rows)}"
        )
    for key, value in sample.items():
        if np.shape(value) != rows[key].shape:
            raise ValueError(
                f"sample field {key!r} has shape {np.shape(value)}, the batch's first sample "
                f"{rows[key].shape}: every sample of a batch needs the same shape per field"
            )
        rows[key][...] = value


class OcrTransform:
    """(image bytes, text) -> {"image": uint8 HxWxC, "label": int32[max_len], "length": int32}.
    C, H, W come from ``image_shape``; the backend transposes to CxHxW on the device. Given
    ``out`` (rows of a batch, RecordDataset.get_batch), it writes the sample there instead."""

    fills_rows = True

    def __init__(
        self,
        char_dict: CharDict,
        image_shape=(3, 48, 320),
        max_text_length: int = 25,
        augment: bool = False,
        max_pixels: int | None = decode.MAX_IMAGE_PIXELS,
    ) -> None:
        self.char_dict = char_dict
        self.max_pixels = max_pixels
        self.image_shape = tuple(image_shape)
        self.max_text_length = max_text_length
        self.augment = augment

    def __call__(
        self, data: bytes, label, rng: np.random.Generator, out: Sample | None = None
    ) -> Sample:
        # The label first: it is cheap, and a bad one spares the decode.
        if out is None:
            encoded, length = self.char_dict.encode(str(label), self.max_text_length)
        else:
            length = self.char_dict.encode_into(str(label), self.max_text_length, out["label"])
        image = decode.decode_bgr(data, self.max_pixels)
        if self.augment:
            image = augment_text_line(image, rng)
        if out is None:
            image, _ = resize_and_pad(image, self.image_shape)
            return {"image": image, "label": encoded, "length": np.int32(length)}
        resize_and_pad(image, self.image_shape, out=out["image"])
        out["length"][...] = length
        return out


class ImageClassTransform:
    """(image bytes, class) -> {"image": uint8 HxWx3 RGB, "label": int64}. Given ``out`` (rows
    of a batch, RecordDataset.get_batch), the crop is resized (and flipped) straight into the
    batch's row: no per-sample image and no copy into the batch."""

    fills_rows = True

    def __init__(
        self,
        num_classes: int,
        train: bool,
        size: int = 224,
        eval_resize: int = 256,
        max_pixels: int | None = decode.MAX_IMAGE_PIXELS,
    ):
        self.num_classes = num_classes
        self.max_pixels = max_pixels
        self.train = train
        self.size = size
        self.eval_resize = eval_resize

    def __call__(
        self, data: bytes, label, rng: np.random.Generator, out: Sample | None = None
    ) -> Sample:
        if not 0 <= int(label) < self.num_classes:
            raise BadSampleError("bad_label", f"class {label} outside 0..{self.num_classes - 1}")
        image = self._image(data, rng, None if out is None else out["image"])
        if out is None:
            return {"image": image, "label": np.int64(label)}
        out["label"][...] = label
        return out

    def _image(self, data: bytes, rng: np.random.Generator, rows: np.ndarray | None):
        if self.train:
            return image_transforms.train_transform(data, rng, self.size, self.max_pixels, rows)
        return image_transforms.eval_transform(
            data, self.size, self.eval_resize, self.max_pixels, rows
        )


class ImageTagTransform(ImageClassTransform):
    """(image bytes, tags as bits of an int) -> {"image": uint8 HxWx3 RGB, "label": float32
    [num_tags] multi-hot}: ImageClassTransform's image, with the tags a multi-label loss reads
    (``num_classes``: the number of tags)."""

    def __call__(
        self, data: bytes, label, rng: np.random.Generator, out: Sample | None = None
    ) -> Sample:
        mask = int(label)
        if mask < 0 or mask >> self.num_classes:
            problem = f"tag bits {mask:#x} name tags outside 0..{self.num_classes - 1}"
            raise BadSampleError("bad_label", problem)
        tags = np.array([(mask >> i) & 1 for i in range(self.num_classes)], np.float32)
        image = self._image(data, rng, None if out is None else out["image"])
        if out is None:
            return {"image": image, "label": tags}
        out["label"][...] = tags
        return out


class SamplePolicy(TypedDict, total=False):
    """What both dataset builders take besides the data and its transform (defaults: below)."""

    max_bad_fraction: float  # bad samples tolerated before the run stops (0.01)
    bad_keys_file: str | Path | None  # where bad keys are recorded (None: nowhere)
    skip_keys_file: str | Path | None  # keys a previous run found bad, left out of the index
    cache: str  # none | memory | disk
    cache_max_bytes: int
    cache_dir: str | Path  # for cache: disk
    state_dir: str | Path | None  # the bad-sample counters shared by workers


def _record_dataset(
    source,
    transform,
    path,
    seed: int,
    *,
    max_bad_fraction: float = 0.01,
    bad_keys_file=None,
    skip_keys_file=None,
    cache: str = "none",
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    state_dir=None,
) -> RecordDataset:
    if cache not in ("none", "memory", "disk"):
        raise DatasetError(f"unknown cache mode {cache!r}", "use none, memory or disk")
    bad_log = BadSampleLog(len(source), max_bad_fraction, bad_keys_file, state_dir)
    shared_cache = None
    if cache != "none":
        shared_cache = SharedRecordCache(cache, len(source), cache_max_bytes, str(path), cache_dir)
    return RecordDataset(
        source,
        transform,
        bad_log=bad_log,
        cache=shared_cache,
        skip_keys=read_bad_keys(skip_keys_file) if skip_keys_file else [],
        seed=seed,
    )


def build_ocr_dataset(
    path: str | Path,
    char_dict: CharDict,
    *,
    train: bool,
    seed: int = 0,
    image_shape=(3, 48, 320),
    max_text_length: int = 25,
    augment: bool = True,
    max_image_pixels: int | None = decode.MAX_IMAGE_PIXELS,
    reader: str = "build_ocr_dataset",
    **policy: Unpack[SamplePolicy],
) -> RecordDataset:
    """An OCR LMDB (tree) of text lines; ``reader`` names the caller in the error for a path of
    another format (a task passes its own name)."""
    from datasets.sources import OCR_LMDB, open_source

    source = open_source(path, (OCR_LMDB,), reader=reader)
    transform = OcrTransform(
        char_dict, image_shape, max_text_length, augment and train, max_image_pixels
    )
    return _record_dataset(source, transform, path, seed, **policy)


def build_image_dataset(
    path: str | Path,
    *,
    train: bool,
    seed: int = 0,
    image_size: int = 224,
    eval_resize: int = 256,
    max_image_pixels: int | None = decode.MAX_IMAGE_PIXELS,
    reader: str = "build_image_dataset",
    **policy: Unpack[SamplePolicy],
) -> RecordDataset:
    """An HDF5 image file or an image folder, a class per image; ``reader`` as
    build_ocr_dataset's."""
    from datasets.sources import HDF5, IMAGE_FOLDER, open_source

    source = open_source(path, (HDF5, IMAGE_FOLDER), reader=reader)
    transform = ImageClassTransform(
        len(source.class_names), train, image_size, eval_resize, max_image_pixels
    )
    return _record_dataset(source, transform, path, seed, **policy)


def build_tagged_image_dataset(
    path: str | Path,
    *,
    train: bool,
    seed: int = 0,
    image_size: int = 224,
    eval_resize: int = 256,
    max_image_pixels: int | None = decode.MAX_IMAGE_PIXELS,
    reader: str = "build_tagged_image_dataset",
    **policy: Unpack[SamplePolicy],
) -> RecordDataset:
    """An HDF5 image file with tags (datasets/hdf5_images.py): images as build_image_dataset's,
    each with its multi-hot tags; ``dataset.source.class_names`` are the tag names. ``reader``
    as build_ocr_dataset's."""
    from datasets.sources import open_tag_source

    source = open_tag_source(path, reader=reader)
    transform = ImageTagTransform(
        len(source.class_names), train, image_size, eval_resize, max_image_pixels
    )
    return _record_dataset(source, transform, path, seed, **policy)
