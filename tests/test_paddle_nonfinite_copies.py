"""Paddle's train step copies its state to undo a NaN/Inf step only where train.nonfinite needs
it (train/backends/paddle/trainer.py, train_step). Under skip the run goes on from the weights
of a bad step, so the step clones every trainable parameter, optimizer accumulator and
BatchNorm statistic and puts them back on the device where the step was not finite (three ops
a tensor: for ResNet-50 with momentum SGD, 1,320 of a CPU step's 2,028 profiled ops). Under
abort the loop's next read of the flags ends the run before any evaluation or checkpoint, so
the step copies nothing; that the aborted run saves nothing after the bad step is
tests/test_failure_kinds.py's test_nan_loss_aborts_naming_step_and_batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.backends import build, first_batches, make_config, start
from tests.test_host_syncs import SMALL_IMAGES, state_values

pytestmark = pytest.mark.paddle

STEPS, BAD = 3, 1  # the second step's images are NaN


class StepCopies:
    """Tensor clones and _restore_where calls, counted per train step."""

    def __init__(self, monkeypatch) -> None:
        import paddle

        from train.backends.paddle import trainer

        self.clones = self.restores = 0
        clone, restore = paddle.Tensor.clone, trainer._restore_where

        def counted_clone(tensor, *args, **kwargs):
            self.clones += 1
            return clone(tensor, *args, **kwargs)

        def counted_restore(*args):
            self.restores += 1
            return restore(*args)

        monkeypatch.setattr(paddle.Tensor, "clone", counted_clone)
        monkeypatch.setattr(trainer, "_restore_where", counted_restore)

    def step(self, backend, batch) -> tuple[int, int]:
        """(clones, restore calls) of one train step on ``batch``."""
        self.clones = self.restores = 0
        backend.trainer.train_step(batch)
        return self.clones, self.restores


def trained(policy: str, image_h5, monkeypatch):
    """A ResNet-18 backend under ``policy`` after STEPS steps, the BAD one over NaN images: the
    backend, each step's (clones, restores), and the state before and after the bad step."""
    train = {"device": "cpu", "nonfinite": policy}
    data = SMALL_IMAGES["classification"]
    config = make_config("paddle", "classification", image_h5, train=train, data=data)
    backend = start(config)
    batches, num_classes = first_batches(backend, config, STEPS)
    build(backend, config, num_classes, total_steps=STEPS)
    copies, counts, around_bad = StepCopies(monkeypatch), [], []
    for index, batch in enumerate(batches):
        if index == BAD:
            around_bad.append(state_values(backend, "paddle"))
            batch = {**batch, "image": batch["image"] * math.nan}  # as train/faults.py's nan@N
        counts.append(copies.step(backend, batch))
        if index == BAD:
            around_bad.append(state_values(backend, "paddle"))
    return backend, counts, around_bad


def nonfinite_flags(backend) -> list[int]:
    return [int(flag) for flag in backend.trainer.read_steps()[:, 1]]


def test_abort_copies_nothing_per_step_and_still_flags_the_bad_step(image_h5, monkeypatch):
    backend, counts, _ = trained("abort", image_h5, monkeypatch)
    assert counts == [(0, 0)] * STEPS
    # The bad step is flagged, and the loop's next read ends the run naming it
    # (train/nonfinite.py); its update stays, so the steps after it are not finite either.
    assert nonfinite_flags(backend) == [int(i >= BAD) for i in range(STEPS)]


def test_skip_copies_the_stepped_state_and_undoes_a_nan_step(image_h5, monkeypatch):
    from train.backends.paddle.trainer import _accumulators

    backend, counts, (before, after) = trained("skip", image_h5, monkeypatch)
    trainer = backend.trainer
    stats = [p for p in trainer.net.parameters() if p.stop_gradient]
    accumulators = _accumulators(trainer.optimizer, None)
    copied = len(trainer._trainable) + len(accumulators) + len(stats)
    assert counts == [(copied, 2)] * STEPS
    assert nonfinite_flags(backend) == [int(i == BAD) for i in range(STEPS)]
    assert after.keys() == before.keys()
    changed = [key for key in before if not np.array_equal(before[key], after[key])]
    assert not changed, f"the NaN step changed {len(changed)} tensors: {changed[:5]}"
