"""Per-sample metadata in numpy arrays keeps forked workers from copying the parent's memory:
a worker's USS does not grow over an epoch with a 1M-entry index, while the same index held in
Python lists (the control) does, which shows the measurement can see the effect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from datasets.synthetic import encode_image, imagenet_like

ROOT = Path(__file__).resolve().parent.parent


def _run(folder: Path, kind: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "bench.uss_probe", str(folder), kind],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.torch
def test_worker_uss_does_not_grow_with_a_million_entry_index(tmp_path, rng):
    for label in range(2):
        (tmp_path / f"c{label}").mkdir()
        for i in range(4):
            image = imagenet_like(label, rng)[:64, :64]
            (tmp_path / f"c{label}" / f"{i}.png").write_bytes(encode_image(image, "png"))
    ours = _run(tmp_path, "numpy")
    control = _run(tmp_path, "list")
    assert ours["samples"] == control["samples"] > 10_000
    assert max(ours["growth_mb"]) < 5.0, ours
    assert min(control["growth_mb"]) > 4 * max(max(ours["growth_mb"]), 1.0), (ours, control)
    print(
        f"USS growth per worker, MB: numpy index {ours['growth_mb']}, "
        f"list index {control['growth_mb']}"
    )
