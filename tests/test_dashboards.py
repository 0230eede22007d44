"""The dashboards: every float of a training or evaluation record goes to the framework's scalar log
(TensorBoard for torch, VisualDL for Paddle, both installed and on by default), the log line
carries an ETA, and a data-starved stretch of windows is warned about once.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" tests/test_dashboards.py
"""

from __future__ import annotations

import logging
import time

import pytest

from tests.backends import make_config, start
from train.telemetry import STALL_WINDOWS, Telemetry

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]


def _read_scalars(framework: str, log_dir) -> dict[str, list[tuple[int, float]]]:
    if framework == "torch":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(log_dir))
        events.Reload()
        return {
            tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]
        }
    from visualdl import LogReader

    (path,) = log_dir.iterdir()
    reader = LogReader(file_path=str(path))
    return {
        tag: [(e.id, e.value) for e in reader.get_data("scalar", tag)]
        for tag in reader.get_tags()["scalar"]
    }


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_scalars_reach_the_dashboard_and_the_log_has_an_eta(framework, ocr_lmdb, tmp_path, caplog):
    backend = start(make_config(framework, "ocr", ocr_lmdb))
    writer = backend.runtime.scalar_writer(tmp_path / "scalars")
    assert writer is not None, f"the {framework} env lacks its dashboard package"
    telemetry = Telemetry(tmp_path, True, 8, None, "knobs", 0.3, writer)
    telemetry.start_progress(total_steps=10, done=0)
    for step in range(1, 5):
        telemetry.step_done(step)
    with caplog.at_level(logging.INFO, logger="train"):
        record = telemetry.log_window(4, 0, loss=2.5, lr=1e-3, bad=0)
        telemetry.emit({"type": "eval", "step": 4, "epoch": 0, "acc": 0.25})
    telemetry.close()

    mean_step = telemetry.totals["wall_s"] / telemetry.totals["steps"]
    assert record["eta_s"] == pytest.approx(6 * mean_step)
    minutes, seconds = divmod(round(record["eta_s"]), 60)
    assert f"eta={minutes // 60}:{minutes % 60:02d}:{seconds:02d}" in caplog.text
    scalars = _read_scalars(framework, tmp_path / "scalars")
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "train/eta_s", "eval/acc"):
        assert tag in scalars, (tag, sorted(scalars))
    assert scalars["train/loss"] == [(4, 2.5)] and scalars["eval/acc"] == [(4, 0.25)]


def test_data_starved_windows_in_a_row_warn_once_naming_the_knobs_and_the_tuner(tmp_path, caplog):
    """Steps that only wait for their batches (here a loader that takes 20 ms a batch and a step
    that takes nothing): after STALL_WINDOWS such logging windows in a row, one warning names
    the wait, the loader's knobs and the tuner; a longer starved stretch does not repeat it."""
    knobs = "workers=0 prefetch=2 persistent=False batch=8"
    telemetry = Telemetry(tmp_path, True, 8, None, knobs, 0.3)

    def slow_batches(count: int):
        for _ in range(count):
            time.sleep(0.02)
            yield {}

    with caplog.at_level(logging.WARNING, logger="train"):
        for window in range(1, STALL_WINDOWS + 3):
            for _ in telemetry.timed(slow_batches(2)):
                telemetry.step_done(2 * window)
            record = telemetry.log_window(2 * window, 0, loss=1.0, lr=1e-3, bad=0)
            assert record["data_wait_fraction"] > 0.3
    telemetry.close()
    starved = [r.getMessage() for r in caplog.records if "data-starved" in r.getMessage()]
    assert len(starved) == 1, starved
    assert f"last {STALL_WINDOWS} windows ({knobs})" in starved[0]
    assert "python -m train.tune --config" in starved[0]
