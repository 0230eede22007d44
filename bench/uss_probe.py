"""Measure DataLoader workers' USS growth over an epoch with a 1M-entry sample index, for our
numpy index and for a Python-list index (the pattern of pytorch issue 13246) as a control.

  python -m bench.uss_probe IMAGE_FOLDER numpy|list
Prints JSON: {"growth_mb": [per worker], "samples": n}.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import psutil

from datasets.bad_samples import BadSampleLog
from datasets.dataset import ImageClassTransform, RecordDataset
from datasets.image_folder import ImageFolderSource

INDEX_SIZE = 1_000_000
STRIDE = 97  # touch every page of the index, not just its start


def main() -> None:
    import torch
    from torch.utils.data import DataLoader

    folder, kind = sys.argv[1], sys.argv[2]
    source = ImageFolderSource(folder)
    real = len(source)
    # A 1M-entry index over the real files (as a 1M-file folder would be), held as numpy arrays
    # (ours) or as Python lists of bytes/int (the control).
    paths = np.array([source.key(i % real).encode() for i in range(INDEX_SIZE)], dtype=np.bytes_)
    labels = np.array([int(source.labels[i % real]) for i in range(INDEX_SIZE)], dtype=np.int64)
    if kind == "list":
        paths, labels = [bytes(p) for p in paths], [int(y) for y in labels]
    source._paths, source.labels = paths, labels
    dataset = RecordDataset(
        source,
        ImageClassTransform(len(source.class_names), train=False, size=32, eval_resize=36),
        bad_log=BadSampleLog(INDEX_SIZE, 1.0),
    )
    picked = list(range(0, INDEX_SIZE, STRIDE))
    loader = DataLoader(
        dataset,
        batch_size=256,
        sampler=picked,
        num_workers=2,
        persistent_workers=True,
        collate_fn=lambda s: len(s),
    )
    me = psutil.Process()
    start, end, seen = {}, {}, 0
    batches = len(loader)
    for i, n in enumerate(loader):
        seen += n
        workers = [c for c in me.children() if c.is_running()]
        uss = {c.pid: c.memory_full_info().uss for c in workers}
        if i == 1:
            start = uss
        if i == batches - 2:
            end = uss
    growth = [(end[p] - start[p]) / 2**20 for p in start if p in end]
    print(json.dumps({"growth_mb": growth, "samples": seen, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
