"""best/ in the run directory (train/checkpoint.py's save_best, called by the loop after each
evaluation): the weights of the best evaluation by the task's main metric, with
best/metric.json beside them, never rotated out by keep_last.

    TEST_FRAMEWORK=torch .venv-torch/bin/python -m pytest -m "not paddle" tests/test_best.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.backends import build, first_batches, make_config, start
from tests.test_train import run_train
from train import checkpoint

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]


def _weights(directory, framework) -> dict[str, np.ndarray]:
    if framework == "paddle":
        with np.load(directory / "model.npz") as npz:
            return {name: npz[name] for name in npz.files}
    import torch

    state = torch.load(directory / "model.pt", weights_only=True)
    return {name: value.numpy() for name, value in state.items()}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_best_keeps_the_peak_when_the_metric_dips(framework, ocr_lmdb, tmp_path):
    config = make_config(framework, "ocr", ocr_lmdb, data={"image_shape": [3, 16, 80]})
    backend = start(config)
    batches, num_classes = first_batches(backend, config, 3)
    build(backend, config, num_classes, total_steps=3)
    run_dir, position = tmp_path / "run", checkpoint.Position()
    kept = {}
    for step, (batch, value) in enumerate(zip(batches, (0.5, 0.8, 0.3)), 1):
        backend.trainer.train_step(batch)  # other weights at each evaluation
        position.step, position.epoch = step, step // 2
        record = checkpoint.save_best(run_dir, backend, position, config, "acc", value)
        if record is not None:
            kept = _weights(run_dir / "best", framework)
        # a full checkpoint each step with keep_last=1 rotates the others, never best/
        checkpoint.save(run_dir, backend, position, 1, config)

    assert checkpoint.best_metric(run_dir) == {"metric": "acc", "value": 0.8, "step": 2, "epoch": 1}
    assert not (run_dir / "best.partial").exists() and not (run_dir / "best.old").exists()
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")] == ["step-00000003"]
    best, last = (
        _weights(run_dir / "best", framework),
        _weights(checkpoint.latest(run_dir), framework),
    )
    assert any(not np.array_equal(best[k], last[k]) for k in best)  # step 3's differ...
    for name, value in kept.items():  # ...and best/ still holds step 2's
        np.testing.assert_array_equal(best[name], value, err_msg=name)
    assert json.loads((run_dir / "best" / "trainer.json").read_text())["position"]["step"] == 2


@pytest.mark.torch
def test_run_keeps_its_best_evaluation(tmp_path, ocr_lmdb, image_h5):
    out = tmp_path / "run"
    extra = ["train.eval_every=3", "train.keep_last=1", "optim.lr=3.0e-3"]
    result = run_train("resnet50", "torch", out, extra=extra, image_h5=image_h5)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6, 9, 12]
    peak = max(evals, key=lambda r: r["top1"])  # max keeps the first of equal values
    saved = json.loads((out / "best" / "metric.json").read_text())
    assert saved == {
        "metric": "top1",
        "value": peak["top1"],
        "step": peak["step"],
        "epoch": peak["epoch"],
    }
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000012"]
