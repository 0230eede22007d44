"""The optimization rules both backends share (train/schedule.py): framework-free, so these run
in both environments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from train.schedule import decays, lr_factor, weight_decay_groups


def test_warmup_is_linear_from_one_step_then_cosine_to_zero():
    cosine = lr_factor("cosine", warmup_steps=4, total_steps=104)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(4) == 1.0 and cosine(54) == pytest.approx(0.5) and cosine(104) == 0.0
    short = lr_factor("cosine", warmup_steps=4, total_steps=20)
    assert short(12) == pytest.approx(0.5)
    assert short(20) == pytest.approx(0.0) and short(25) == pytest.approx(0.0)  # stays at 0


def test_step_and_constant_schedules():
    step = lr_factor("step", warmup_steps=0, total_steps=30)
    assert [step(s) for s in (0, 9, 10, 19, 20, 29)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert lr_factor("step", 0, 90)(29) == 1.0 and lr_factor("step", 0, 90)(60) == pytest.approx(
        0.01
    )
    assert lr_factor("constant", 2, 10)(0) == 0.5 and lr_factor("constant", 2, 10)(7) == 1.0


def test_weight_decay_skips_one_dimensional_parameters():
    assert decays((64, 3, 3, 3)) and decays((10, 256)) and decays([512, 128])
    assert not decays((64,)) and not decays([10]) and not decays(())


def test_weight_decay_groups():
    conv, bias, scale, linear = (
        SimpleNamespace(shape=s) for s in ((8, 3, 3, 3), (8,), [8], (4, 8))
    )
    decayed, free = weight_decay_groups([conv, bias, scale, linear], 1e-4)
    assert decayed == {"params": [conv, linear], "weight_decay": 1e-4}
    assert free == {"params": [bias, scale], "weight_decay": 0.0}
    assert weight_decay_groups([bias], 1e-4) == [{"params": [bias], "weight_decay": 0.0}]
