"""What a ResNet-50 record costs to read from HDF5, alone and right before its transform, in
the layout of each schema (datasets/hdf5_images.py), framework-free, on one core:

    .venv-torch/bin/python -m bench.hdf5_reads [--images 256] [--passes 7]

- ``v1 row``: schema 1, one variable-length uint8 row per image, read through h5py (HDF5's
  global heap), as the reader did before schema 2;
- ``v2 pread``: schema 2, one ``os.pread`` at the record's place in the contiguous image_bytes;
- ``v2 h5py``: schema 2 read through h5py (``Hdf5ImageSource(pread=False)``), the way a file
  whose image_bytes is not contiguous is read.

The benchmark's ImageNet-like file (bench/data.py) is the schema-2 one; the schema-1 copy of the
same records is written into a temporary folder with h5py, as the schema-1 writer laid it out.
Each pass reads every record once in a shuffled order; for each layout it times the reads
alone, then each read followed by ``train_transform`` of the record (RandomResizedCrop + flip,
the ``resnet50.ours`` transform), and the transform alone on bytes read beforehand (``--only``
keeps some of these rows). CPU time
(``time.process_time``) per record, the passes interleaved: median and minimum over them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np


def write_schema_1_copy(source, out: Path) -> Path:
    """The records, labels and class names of ``source`` in the schema-1 layout."""
    with h5py.File(out, "w") as f:
        f.attrs.update(format="resnet50-hdf5", schema_version=1)
        f.attrs["class_names"] = json.dumps(source.class_names)
        vlen = h5py.vlen_dtype(np.uint8)
        images = f.create_dataset("images", (len(source),), vlen, maxshape=(None,), chunks=(256,))
        for index in range(len(source)):
            images[index] = np.frombuffer(source.read(index)[0], np.uint8)
        f["labels"] = source.labels
        f["keys"] = [source.key(i) for i in range(len(source))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument(
        "--only",
        action="append",
        help="time only this row (repeatable; 'none' times nothing): to run one row under "
        "valgrind's callgrind, against a 'none' run for the set-up's instructions",
    )
    args = parser.parse_args()

    from bench.data import image_data
    from datasets.hdf5_images import Hdf5ImageSource

    # The schema-1 copy is made on purpose: its "reads slower, upgrade it" warning is noise here.
    logging.getLogger("datasets.hdf5_images").setLevel(logging.ERROR)
    from datasets.image_transforms import train_transform

    path = Path(image_data(args.images)["hdf5"])
    with tempfile.TemporaryDirectory(prefix="hdf5-reads-") as tmp:
        sources = {"v2 pread": Hdf5ImageSource(path)}
        sources["v2 h5py"] = Hdf5ImageSource(path, pread=False)
        sources["v1 row"] = Hdf5ImageSource(
            write_schema_1_copy(sources["v2 pread"], Path(tmp) / "v1.h5")
        )
        in_memory = [sources["v2 pread"].read(i)[0] for i in range(args.images)]
        order = np.random.default_rng(0).permutation(args.images).tolist()

        def transform(data: bytes, index: int) -> None:
            train_transform(data, np.random.default_rng((0, index)))

        rows = {"transform alone (bytes in memory)": lambda i: transform(in_memory[i], i)}
        for name, source in sources.items():
            rows[f"{name}: read alone"] = lambda i, s=source: s.read(i)
            rows[f"{name}: read + transform"] = lambda i, s=source: transform(s.read(i)[0], i)
        if args.only:
            unknown = set(args.only) - set(rows) - {"none"}
            if unknown:
                raise SystemExit(f"--only: no row {sorted(unknown)}; rows: {list(rows)}")
            rows = {name: run for name, run in rows.items() if name in args.only}
        times: dict[str, list[float]] = {name: [] for name in rows}
        for number in range(args.passes):
            names = list(rows) if number % 2 == 0 else list(reversed(rows))
            for name in names:
                started = time.process_time()
                for index in order:
                    rows[name](index)
                times[name].append((time.process_time() - started) / len(order) * 1e6)
        for source in sources.values():
            source.close()
    print(f"CPU us per record, {args.passes} interleaved passes over {args.images} records")
    print(f"{'':40s} {'median':>8s} {'min':>8s}")
    for name, values in times.items():
        print(f"{name:40s} {statistics.median(values):8.1f} {min(values):8.1f}")


if __name__ == "__main__":
    main()
