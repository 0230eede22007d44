"""A batch fetch that waits for the device is not data wait (train/telemetry.py,
waiting_for_device): Paddle's batch ring (PinnedCopies.stage) waits for a pinned buffer's last
copy to the GPU before it writes that buffer again, and in a GPU-bound run that wait is the
device's back-pressure. Telemetry reports it as the device-wait share, and the data wait, the
stall warning and the summary's loader_bottleneck see only the loader's own time.

The ring copies to a GPU only in production; here a stand-in copy event whose synchronize()
sleeps plays a device still busy with earlier steps, and the loader itself is instant."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from train.device_wait import waiting_for_device
from train.telemetry import Telemetry

STEPS = 4
DEVICE_S = 0.05  # each fetch's wait for the device


def timed_window(tmp_path, batches) -> tuple[Telemetry, dict]:
    """One logging window of STEPS instant steps over ``batches``: the telemetry and its
    record."""
    telemetry = Telemetry(tmp_path, True, 4, None, "knobs", 0.3, num_workers=1)
    for _ in telemetry.timed(batches):
        telemetry.step_done(0)
    record = telemetry.log_window(step=STEPS, epoch=0, loss=1.0, lr=0.1, bad=0)
    telemetry.close()
    return telemetry, record


def assert_device_wait_only(telemetry: Telemetry, record: dict) -> None:
    totals = telemetry.totals
    # The fetches' own work is a few small copies: a small part of one device wait.
    assert totals["wait_s"] < DEVICE_S / 2, totals
    assert totals["device_wait_s"] >= STEPS * DEVICE_S, totals
    assert record["reader_cost_s"] < DEVICE_S / 8, record
    assert record["device_wait_fraction"] > 0.5 > record["data_wait_fraction"], record


def run_summary(telemetry: Telemetry) -> dict:
    """train.loop's run summary over ``telemetry``, for a run with nothing else to report."""
    from train.loop import Run

    bad_log = SimpleNamespace(total_counts=dict)
    run = SimpleNamespace(
        telemetry=telemetry,
        loss=1.0,
        position=SimpleNamespace(step=STEPS, epoch=0),
        data=SimpleNamespace(train=SimpleNamespace(bad_log=bad_log)),
        last_eval={},
        autotune=SimpleNamespace(summary=dict),  # loader.autotune off: nothing to report
    )
    return Run.finish(run)


def test_a_fetch_waiting_for_the_device_is_device_wait_in_the_window_and_the_summary(tmp_path):
    """The wait's CPU time (a device wait may spin) leaves the data wait's CPU too, which the
    loader's diagnosis reads as the trainer busy receiving batches."""

    def batches():
        for _ in range(STEPS):
            with waiting_for_device():
                end = time.perf_counter() + DEVICE_S
                while time.perf_counter() < end:  # a spinning wait: CPU time, no data
                    pass
            yield None

    telemetry, record = timed_window(tmp_path, batches())
    assert_device_wait_only(telemetry, record)
    assert telemetry.totals["wait_cpu_s"] < DEVICE_S / 2, telemetry.totals
    summary = run_summary(telemetry)
    assert summary["device_wait_fraction"] > 0.5 > summary["data_wait_fraction"], summary
    assert "loader_bottleneck" not in summary, summary  # the loader held nothing


class BusyDeviceCopy:
    """A copy's event (PinnedCopies._copied) on a device still running earlier steps."""

    def synchronize(self) -> None:
        time.sleep(DEVICE_S)


def host_pinned(shape, dtype):
    """PinnedCopies' page-locked buffer, as plain host memory (no GPU here)."""
    from train.backends.paddle.data import _as_tensor

    array = np.empty(shape, dtype)
    return _as_tensor(array), array


@pytest.mark.paddle
def test_the_paddle_rings_wait_for_its_last_copy_is_device_wait_not_data_wait(
    tmp_path, monkeypatch
):
    """PinnedCopies.stage, as PaddleLoader._from_ring calls it for each batch of an instant
    loader, with the buffers' last copies still queued on the device."""
    import paddle

    import train.backends.paddle  # noqa: F401  (zlib before paddle)
    from train.backends.paddle import data

    monkeypatch.setattr(data, "_pinned", host_pinned)
    copies = data.PinnedCopies(paddle.CPUPlace())
    views = {"image": np.zeros((4, 8, 8, 3), np.uint8), "label": np.arange(4)}

    def batches():
        for _ in range(STEPS):
            copies._copied[copies._next] = BusyDeviceCopy()  # as start() leaves each set
            yield copies.stage(views)

    telemetry, record = timed_window(tmp_path, batches())
    assert_device_wait_only(telemetry, record)
