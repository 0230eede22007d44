"""The host waiting for the training device inside a loader's ``next`` (the batch ring reusing a
pinned buffer whose copy the device has not run yet): the device holding the host back, which
train/telemetry.py counts as device wait, not as data wait. A module of its own so that a
backend's loader marks the wait without importing the telemetry that reads it."""

from __future__ import annotations

import contextlib
import threading
import time


class _DeviceWaits(threading.local):
    """This thread's seconds blocked in ``waiting_for_device`` so far: wall and own CPU time."""

    wall_s = 0.0
    cpu_s = 0.0


DEVICE_WAITS = _DeviceWaits()


@contextlib.contextmanager
def waiting_for_device():
    """Around a host wait for the training device inside a loader's ``next``: Telemetry.timed
    counts it as device wait, not as data wait. Per thread, like the fetch it is part of."""
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        DEVICE_WAITS.wall_s += time.perf_counter() - start
        DEVICE_WAITS.cpu_s += time.thread_time() - cpu
