"""What a page fault costs on this host, and what reusing batch arrays saves.

    .venv-torch/bin/python -m bench.page_faults [--batch 64] [--reps 41]

Framework-free (either venv). Three measures, interleaved over ``--reps`` rounds, medians:
- the first touch of each 4 KB page of a fresh anonymous mapping (one byte per page: nothing
  but the fault), per page;
- filling an OCR batch (batch x 48 x 320 x 3 uint8, every byte written once, as resizing the
  lines into it does) in newly mapped memory: what a loader pays for a batch whose memory
  glibc has just mapped or given back to the kernel;
- the same fill into an array from ``datasets.batch_buffers.BatchBuffers``, which hands the
  dropped batch's array back.
Minor faults per batch come from ``resource.getrusage``. How many of a loader's batches land in
newly mapped memory depends on glibc's heuristics (a freed heap top is trimmed, big blocks are
mapped alone) and on the thread: the benchmark's ``faults_per_batch`` counts them in the real
loaders. docs/benchmarks.md ("Page faults") quotes a run.
"""

from __future__ import annotations

import argparse
import mmap
import resource
import statistics
import time

import numpy as np

from datasets.batch_buffers import BatchBuffers

PAGE = 4096
OCR_LINE = (48, 320, 3)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def first_touch_us_per_page(nbytes: int) -> float:
    mapping = mmap.mmap(-1, nbytes)
    pages = np.frombuffer(mapping, dtype=np.uint8)
    start = time.perf_counter()
    pages[::PAGE] = 1
    elapsed = time.perf_counter() - start
    del pages
    mapping.close()
    return elapsed / (nbytes // PAGE) * 1e6


def newly_mapped(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array in memory mapped for it alone (gone with the array), as glibc gives big blocks."""
    return np.frombuffer(mmap.mmap(-1, int(np.prod(shape))), dtype=dtype).reshape(shape)


def fill_ms(make_batch, shape: tuple[int, ...]) -> tuple[float, int]:
    """(ms to get a batch array and write all of it, minor faults taken), the array dropped."""
    faults = _faults()
    start = time.perf_counter()
    batch = make_batch(shape, np.uint8)
    batch.fill(128)
    elapsed = time.perf_counter() - start
    del batch
    return elapsed * 1e3, _faults() - faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="OCR lines per batch")
    parser.add_argument("--reps", type=int, default=41, help="interleaved rounds")
    args = parser.parse_args()
    shape = (args.batch, *OCR_LINE)
    nbytes = int(np.prod(shape))
    buffers = BatchBuffers()
    fill_ms(buffers.empty, shape)  # the pool's first array is a fresh one
    rows: dict[str, list] = {"touch": [], "newly mapped": [], "reused": []}
    for _ in range(args.reps):
        rows["touch"].append(first_touch_us_per_page(nbytes))
        rows["newly mapped"].append(fill_ms(newly_mapped, shape))
        rows["reused"].append(fill_ms(buffers.empty, shape))
    print(f"host: {nbytes / 2**20:.1f} MB batch ({nbytes // PAGE} pages), {args.reps} rounds")
    print(f"first touch of a fresh page: {statistics.median(rows['touch']):.2f} us")
    for name in ("newly mapped", "reused"):
        ms = statistics.median(m for m, _ in rows[name])
        faults = statistics.median(f for _, f in rows[name])
        print(f"fill a batch, {name:12s}: {ms:6.3f} ms, {faults:5.0f} minor faults")


if __name__ == "__main__":
    main()
