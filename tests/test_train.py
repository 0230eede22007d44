"""End to end: python -m train on the four {ocr, resnet50} x {paddle, torch} smoke configs over
tiny fixture data, the run directory's contents, one-line errors, and resume after SIGTERM."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = [
    "train.max_steps=12",
    "train.log_every=2",
    "train.eval_every=6",
    "train.checkpoint_every=6",
    "loader.num_workers=2",
    "loader.batch_size=8",
    "optim.warmup_steps=2",
    # Drawing the plots costs a run 0.6-0.9 CPU-s (matplotlib); the smoke test below draws them.
    "output.plots=false",
]


def data_overrides(task: str, ocr_lmdb: Path, image_h5: Path) -> list[str]:
    if task == "ocr":
        return [
            f"data.train={ocr_lmdb}",
            f"data.val={ocr_lmdb}",
            f"data.char_dict={ocr_lmdb.parent / 'charset.txt'}",
        ]
    return [
        f"data.train={image_h5}",
        f"data.val={image_h5}",
        # ResNet's smallest input (five halvings leave 1 x 1): the tests' trainings prove the
        # data path and the run's mechanics, and Paddle's CPU convolutions cost a ResNet-18 step
        # at 64 pixels 0.42 s (batch 8), at 32 pixels 0.15 s.
        "data.image_size=32",
        "data.eval_resize=36",
    ]


def set_args(items) -> list[str]:
    """["--set", item, "--set", item, ...] for python -m train."""
    return [arg for item in items for arg in ("--set", item)]


def train_cmd(task, framework, out, extra=(), ocr_lmdb=None, image_h5=None) -> list[str]:
    sets = [f"framework={framework}", *FAST, *data_overrides(task, ocr_lmdb, image_h5), *extra]
    cmd = [
        sys.executable,
        "-m",
        "train",
        "--config",
        f"configs/{task}/smoke.yaml",
        "--output-dir",
        str(out),
    ]
    return cmd + set_args(sets)


# A loader worker lost, in our words or the frameworks'. A bare "died" is not enough: the
# /dev/shm sweep's line about files that dead processes of other runs left also holds it.
LOST_WORKER = re.compile(r"worker pid \d+ died|killed by signal|exited unexpectedly")


def run_train(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_cmd(*args, **kwargs), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


PAIRS = [
    pytest.param("ocr", "paddle", marks=pytest.mark.paddle),
    pytest.param("resnet50", "paddle", marks=pytest.mark.paddle),
    pytest.param("ocr", "torch", marks=pytest.mark.torch),
    pytest.param("resnet50", "torch", marks=pytest.mark.torch),
]


@pytest.mark.parametrize("task, framework", PAIRS)
def test_smoke_config_trains_end_to_end(task, framework, tmp_path, ocr_lmdb, image_h5):
    out = tmp_path / "run"
    result = run_train(
        task, framework, out, ["output.plots=true"], ocr_lmdb=ocr_lmdb, image_h5=image_h5
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for name in (
        "config.resolved.yaml",
        "train.log",
        "metrics.jsonl",
        "summary.json",
        "plots/loss.png",
        "plots/throughput.png",
        "checkpoints/latest",
    ):
        assert (out / name).exists(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(2, 13, 2))
    for key in (
        "loss",
        "lr",
        "samples_per_s",
        "reader_cost_s",
        "batch_cost_s",
        "data_wait_fraction",
        "bad_samples",
    ):
        assert all(key in r for r in train), key
    assert any(r["type"] == "eval" and r["step"] == 12 for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["bad_samples_total"] == 0
    assert "samples_per_s" in result.stdout  # the summary table
    # A data wait above 10% comes with its bottleneck and the tuner's command for this scenario
    stalled = summary["data_wait_fraction"] > 0.10
    assert ("loader_bottleneck" in summary) == stalled == ("loader_tune" in summary), summary
    if stalled:
        tune = f"python -m train.tune --config configs/{task}/smoke.yaml --set framework="
        assert summary["loader_tune"].startswith(tune + framework), summary["loader_tune"]
        assert "loader_bottleneck" in result.stdout and "loader_tune" in result.stdout
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == ["step-00000006", "step-00000012"]


@pytest.mark.parametrize("task, framework", [PAIRS[0], PAIRS[3]])
def test_existing_run_needs_resume_or_overwrite(task, framework, tmp_path, ocr_lmdb, image_h5):
    out = tmp_path / "run"
    first = run_train(
        task, framework, out, ["train.max_steps=6"], ocr_lmdb=ocr_lmdb, image_h5=image_h5
    )
    assert first.returncode == 0, first.stderr[-3000:]
    before = _tree(out)
    again = run_train(
        task, framework, out, ["train.max_steps=6"], ocr_lmdb=ocr_lmdb, image_h5=image_h5
    )
    assert again.returncode != 0 and "already holds a run" in again.stderr
    assert "--resume" in again.stderr and "Traceback" not in again.stderr
    # Nothing overwritten, added or removed: every file's bytes and mtime as the first run left
    # them, but the run lock's own file (.lock: the refused run held the lock while it looked,
    # and empties the holder's line again when it lets go).
    assert _tree(out) == before


def _tree(root) -> dict[str, tuple[bytes, int]]:
    return {
        str(path.relative_to(root)): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != ".lock"
    }


def test_bad_config_is_one_line_without_traceback(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "train",
        "--config",
        "configs/ocr/smoke.yaml",
        "--set",
        "loader.num_wokers=3",
        "--output-dir",
        str(tmp_path),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "loader.num_workers" in lines[0], result.stderr


@pytest.mark.parametrize("command", ["train", "train.tune"])
def test_a_config_for_the_other_frameworks_environment_is_one_line_exit_2(command, tmp_path):
    """The venvs and images hold one framework each: a config naming the other one is the
    likely mistake, told in one line with the environment to use, not an import traceback."""
    import importlib.util

    missing = [name for name in ("torch", "paddle") if importlib.util.find_spec(name) is None]
    if not missing:
        pytest.skip("this environment has both frameworks")
    args = ["--config", "configs/ocr/smoke.yaml", "--set", f"framework={missing[0]}"]
    args += ["--output-dir", str(tmp_path / "out")]
    result = subprocess.run(
        [sys.executable, "-m", command, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert f"framework: {missing[0]}, which this Python" in line
    assert f".venv-{missing[0]}/bin/python" in line


@pytest.mark.parametrize("task, framework", [PAIRS[0], PAIRS[3]])
def test_missing_dataset_is_a_clear_data_error(task, framework, tmp_path, ocr_lmdb, image_h5):
    missing = (f"data.train={tmp_path / 'nope'}",)
    result = run_train(
        task, framework, tmp_path / "run", missing, ocr_lmdb=ocr_lmdb, image_h5=image_h5
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "error:" in result.stderr and "HINT" in result.stderr
    assert "Traceback" not in result.stderr
