"""What python -m train says of a failed loader (train.cli.loader_report), in the cases
whose timing a training cannot set: a worker killed by a signal can still be tearing down when
the loader notices its broken pipe, so the report waits for it to be gone (up to 3 s) and then
names the sample it died on; a worker alive on a sample for less than hung_after_s is innocent
and left out. A real dataset's in-flight table and a real forked process on one of its samples."""

from __future__ import annotations

import multiprocessing
import os
import time
from types import SimpleNamespace

from tests.backends import make_config, open_dataset
from train.cli import loader_report


def test_a_worker_still_tearing_down_is_named_once_it_is_gone(ocr_lmdb):
    dataset, _ = open_dataset(make_config("paddle", "ocr", ocr_lmdb))  # no framework imported
    context = multiprocessing.get_context("fork")
    reading = context.Event()

    def killed_on_sample_5() -> None:
        dataset.in_flight.start(5)
        reading.set()
        time.sleep(0.6)  # what the loader sees of a worker the kernel is still tearing down
        os._exit(1)

    worker = context.Process(target=killed_on_sample_5)
    worker.start()
    try:
        assert reading.wait(30)
        started = time.monotonic()
        found = loader_report(SimpleNamespace(train=dataset, val=None), hung_after_s=60)
        waited = time.monotonic() - started
    finally:
        worker.join(30)
        dataset.close()
    died = found.get("died", [])
    assert len(died) == 1 and died[0].startswith(f"worker pid {worker.pid} died while reading")
    assert "sample #5 (key" in died[0], died
    assert not found.get("hung") and 0.2 <= waited < 3.0, (found, waited)
