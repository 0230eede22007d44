"""Where an OCR sample's CPU time goes at 0 workers, layer by layer.

    .venv-torch/bin/python -m bench.ocr_layers [--lines 768] [--batch 128] [--passes 21]

Framework-free (either venv). Each layer adds one piece of ``RecordDataset.get_batch``'s work to
the layer above it, over the same shuffled records of the quick preset's OCR LMDB (written by
bench/data.py on first use), and prints CPU time per sample (``time.process_time``): the
minimum and the first quartile over interleaved passes, since a pass can only be slowed by the
shared host, never sped up. The first layer is the C work alone (libjpeg-turbo, ISA-L's inflate
and the PNG unfilter, OpenCV's resize); the differences between layers are the Python around it.
docs/benchmarks.md ("Where the time goes") quotes a run.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import cv2
import numpy as np
import simplejpeg

from bench.data import ocr_data
from bench.pipelines import MAX_TEXT_LENGTH, OCR_SHAPE
from datasets import decode, png_inflate
from datasets.dataset import SampleRng, build_ocr_dataset
from datasets.ocr_transforms import CharDict, resize_and_pad

SHAPE = tuple(OCR_SHAPE)  # the bench's OCR arms' shape and label length


def _layers(lines: int, batch_size: int) -> list[tuple[str, Callable[[], None], int]]:
    paths = ocr_data(lines)
    char_dict = CharDict.from_file(paths["charset"])
    dataset = build_ocr_dataset(
        paths["mixed"],
        char_dict,
        train=True,
        augment=False,
        image_shape=SHAPE,
        max_text_length=MAX_TEXT_LENGTH,
    )
    positions = [int(i) for i in np.random.default_rng(0).permutation(len(dataset))]
    positions = positions[: len(positions) // batch_size * batch_size]
    indices = [dataset._source_index(p) for p in positions]
    records = [dataset.source.read(i) for i in indices]
    # The layers time the decoders on these records, the first without the checks around them:
    # each record passes the pixel budget (from its header) here once, so no layer decodes an
    # image training would refuse.
    for data, _ in records:
        decode.check_encoded(data, decode.MAX_IMAGE_PIXELS)
    _, height, width = SHAPE
    batch = {
        "image": np.empty((batch_size, height, width, 3), np.uint8),
        "label": np.empty((batch_size, MAX_TEXT_LENGTH), np.int32),
        "length": np.empty((batch_size,), np.int32),
    }
    images = batch["image"]

    def c_only(data: bytes) -> np.ndarray:
        if data.startswith(b"\xff\xd8"):
            return simplejpeg.decode_jpeg(data, "BGR")
        return png_inflate.decode(data)

    def resize(image: np.ndarray, out: np.ndarray) -> None:
        resized_w = min(width, math.ceil(height * image.shape[1] / image.shape[0]))
        cv2.resize(
            image, (resized_w, height), dst=out[:, :resized_w], interpolation=cv2.INTER_LINEAR
        )

    def decode_and_resize():
        for k, (data, _) in enumerate(records):
            resize(c_only(data), images[k % batch_size])

    def plus_read():
        for k, index in enumerate(indices):
            data, _ = dataset.source.read(index)
            resize(c_only(data), images[k % batch_size])

    def plus_checks():
        for k, index in enumerate(indices):
            data, _ = dataset.source.read(index)
            resize(decode.decode_bgr(data), images[k % batch_size])

    def plus_resize_and_pad():
        for k, index in enumerate(indices):
            data, _ = dataset.source.read(index)
            resize_and_pad(decode.decode_bgr(data), SHAPE, out=images[k % batch_size])

    def plus_label():
        for k, index in enumerate(indices):
            data, label = dataset.source.read(index)
            encoded, length = char_dict.encode(label, MAX_TEXT_LENGTH)
            resize_and_pad(decode.decode_bgr(data), SHAPE, out=images[k % batch_size])
            batch["label"][k % batch_size] = encoded
            batch["length"][k % batch_size] = length

    def plus_transform_call():
        for k, index in enumerate(indices):
            data, label = dataset.source.read(index)
            rows = {key: array[k % batch_size, ...] for key, array in batch.items()}
            dataset.transform(data, label, SampleRng((0, 0, index)), out=rows)

    def get_batch():
        for start in range(0, len(positions), batch_size):
            dataset.get_batch(positions[start : start + batch_size])

    return [
        ("decode + resize (C alone)", decode_and_resize, len(records)),
        ("+ LMDB read", plus_read, len(records)),
        ("+ check_encoded", plus_checks, len(records)),
        ("+ resize_and_pad", plus_resize_and_pad, len(records)),
        ("+ CTC label", plus_label, len(records)),
        ("+ transform call, batch rows", plus_transform_call, len(records)),
        ("get_batch (all of it)", get_batch, len(positions)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=768, help="OCR LMDB size (bench/data.py)")
    parser.add_argument("--batch", type=int, default=128, help="get_batch's batch size")
    parser.add_argument("--passes", type=int, default=21, help="interleaved passes per layer")
    args = parser.parse_args()
    cv2.setNumThreads(1)
    if not 0 < args.batch <= args.lines:
        parser.error(f"--batch must be between 1 and --lines ({args.lines})")
    layers = _layers(args.lines, args.batch)
    times: dict[str, list[float]] = {name: [] for name, _, _ in layers}
    for _ in range(args.passes):
        for name, run, samples in layers:
            start = time.process_time()
            run()
            times[name].append((time.process_time() - start) / samples * 1e6)
    print(f"CPU us per sample, {args.passes} interleaved passes over {args.lines} lines")
    print(f"{'layer':32s} {'min':>7s} {'p25':>7s}")
    for name, values in times.items():
        values.sort()
        print(f"{name:32s} {values[0]:7.1f} {values[len(values) // 4]:7.1f}")


if __name__ == "__main__":
    main()
