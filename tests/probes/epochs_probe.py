"""Short epochs with non-persistent workers over an LMDB, with every core kept busy: report the
trainer's open file descriptors and child processes after epoch 10 and after the last (resource
hygiene).

  python tests/probes/epochs_probe.py FRAMEWORK OCR_LMDB CHARSET EPOCHS
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datasets.dataset import build_ocr_dataset  # noqa: E402
from datasets.ocr_transforms import CharDict  # noqa: E402
from datasets.sampler import EpochSampler  # noqa: E402
from train.backends.common import LoaderKnobs  # noqa: E402


@contextlib.contextmanager
def every_core_kept_busy():
    """One spinning process per core for the duration: Paddle's descriptors can grow only when
    the host is loaded (its pipes close late), so the epochs run under load. Yields the
    spinners, which the counts below pause: counting needs no load, and the cores are shared."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@contextlib.contextmanager
def paused(processes):
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


def settled_fd_count(timeout_s: float = 5.0, enough: int | None = None) -> int:
    """Open descriptors once the last epoch's shutdown has finished: the fewest seen over up to
    `timeout_s`, or the first count at most `enough` (the fewest can only fall further, and the
    caller asks no more). Under load a loader's pipes can close a moment after its iterator ends
    (seen with Paddle on a busy 2-core host); a leak stays open, so it still counts."""
    gc.collect()
    fewest = len(os.listdir("/proc/self/fd"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (enough is None or fewest > enough):
        time.sleep(0.1)
        fewest = min(fewest, len(os.listdir("/proc/self/fd")))
    return fewest


def main() -> None:
    framework, lmdb_path, charset, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dataset = build_ocr_dataset(lmdb_path, CharDict.from_file(charset), train=True)
    sampler = EpochSampler(len(dataset), seed=0)
    if framework == "torch":
        from train.backends.torch.data import make_loader

        loader = make_loader(dataset, sampler, LoaderKnobs(batch_size=8, num_workers=2))
    else:
        from train.backends.paddle.data import make_loader

        loader = make_loader(dataset, sampler, LoaderKnobs(batch_size=8, num_workers=2))
    me = psutil.Process()
    counts = []
    with every_core_kept_busy() as spinners:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for _ in loader:
                pass
            if epoch in (min(10, epochs - 2), epochs - 1):  # after warm-up: lazily opened files
                # The last count only has to come down to the first (the test's bound).
                enough = counts[0]["fds"] if counts else None
                with paused(spinners):
                    fds = settled_fd_count(enough=enough)
                    counts.append({"fds": fds, "children": children(me, spinners)})
    print(json.dumps({"after_epoch_10": counts[0], "after_last": counts[1], "epochs": epochs}))


def children(me: psutil.Process, spinners) -> int:
    """Live child processes other than the spinners: loader workers left behind."""
    spinning = {spinner.pid for spinner in spinners}
    return len(
        [
            c
            for c in me.children()
            if c.pid not in spinning and c.is_running() and c.status() != psutil.STATUS_ZOMBIE
        ]
    )


if __name__ == "__main__":
    main()
