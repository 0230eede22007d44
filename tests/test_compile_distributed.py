"""train.compile on 2 CPU ranks (gloo): the compiled, data-parallel training step still
all-reduces the gradients, so ranks that train on different batches keep equal parameters.
Paddle must trace the bare model and wrap it in DataParallel after (PaddleOCR's order):
to_static over DataParallel's dygraph-only forward fails at the first step; a rank whose
gradients are not all-reduced fails the equality check."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_distributed import run_two_ranks

STEPS = 4


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("torch", marks=pytest.mark.torch),
        pytest.param("paddle", marks=pytest.mark.paddle),
    ],
)
def test_compiled_two_rank_training_keeps_the_ranks_parameters_equal(framework, tmp_path):
    probe = "tests/probes/compiled_ranks_probe.py"
    result = run_two_ranks(framework, tmp_path, probe, str(tmp_path), str(STEPS), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    with (
        np.load(tmp_path / "initial.npz") as initial,
        np.load(tmp_path / "rank0.npz") as rank0,
        np.load(tmp_path / "rank1.npz") as rank1,
    ):
        assert rank0.files and sorted(rank0.files) == sorted(rank1.files)
        trained = [k for k in rank0.files if not np.array_equal(rank0[k], initial[k])]
        assert len(trained) == len(rank0.files), "some parameters did not train at all"
        drifted = [k for k in rank0.files if not np.array_equal(rank0[k], rank1[k])]
        assert drifted == [], f"{len(drifted)} of {len(rank0.files)} differ: {drifted[:5]}"
