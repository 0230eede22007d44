"""A run that runs out of room ends with exit 4 and one line, whatever it was writing: best/, a
checkpoint, metrics.jsonl, summary.json, a plot, or a disk cache too big for its volume. Nothing
half written is left (no ``*.partial``, no torn line in metrics.jsonl), and the checkpoints
written before stay usable by --resume.

Room runs out for real, in the kernel: the file-size limit (RLIMIT_FSIZE, what ``ulimit -f``
sets: a write past it fails with EFBIG, as one to a full disk fails with ENOSPC and one over a
quota with EDQUOT), set for the whole training process or, through
tests/probes/file_size_limit.py, once a given checkpoint is written; and, for the disk cache, a
tmpfs smaller than the cache (needs root to mount; skipped otherwise). Real ``python -m train``
processes; the tests of a code path that both frameworks share (run files, the disk cache) use
one framework.
"""

from __future__ import annotations

import functools
import json
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from tests.test_checkpoint_faults import small_tmpfs
from tests.test_train import ROOT, train_cmd

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("paddle", marks=pytest.mark.paddle),
]
EVERY_2 = ["train.checkpoint_every=2", "train.keep_last=5", "loader.num_workers=0"]


def run(framework, run_dir, ocr_lmdb, steps, *extra, flags=(), limit=None, probe=None):
    """``python -m train`` on the OCR smoke config; ``limit``: the file-size limit (bytes) of
    the whole process; ``probe``: (step, LIMIT) for tests/probes/file_size_limit.py."""
    cmd = train_cmd("ocr", framework, run_dir, [f"train.max_steps={steps}", *extra], ocr_lmdb)
    cmd += list(flags)
    if probe is not None:
        cmd = [sys.executable, "tests/probes/file_size_limit.py", *map(str, probe), *cmd[3:]]

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited if limit is not None else None,
    )


def assert_one_line(result, *wanted: str) -> str:
    """Exit 4 with exactly one ``error:`` line holding ``wanted``, and no traceback (nor
    Python's "Exception ignored" or logging's "--- Logging error ---", which print one)."""
    assert result.returncode == 4, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for text in wanted:
        assert text in errors[0], errors[0]
    for noise in ("Traceback", "Exception ignored", "Logging error"):
        assert noise not in result.stderr, result.stderr[-3000:]
    return errors[0]


def assert_nothing_partial(run_dir) -> None:
    assert [p for p in run_dir.rglob("*") if "partial" in p.name] == []


def assert_resumes_from(framework, run_dir, ocr_lmdb, step: int, *extra) -> None:
    resumed = run(framework, run_dir, ocr_lmdb, step + 2, *EVERY_2, *extra, flags=["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{step:08d} (epoch 0, step {step})" in resumed.stderr
    assert "unusable" not in resumed.stderr


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, ocr_lmdb):
    """trained(framework): a 4-step run with checkpoints and evaluations every 2 steps (best/ of
    step 2: the metric of step 4 ties it), trained once per module; the tests copy it."""

    @functools.cache
    def trained(framework):
        run_dir = tmp_path_factory.mktemp(framework) / "run"
        first = run(framework, run_dir, ocr_lmdb, 4, *EVERY_2, "train.eval_every=2")
        assert first.returncode == 0, first.stderr[-3000:]
        return run_dir

    return trained


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_best_checkpoint_that_does_not_fit_keeps_the_previous_best_and_the_checkpoints(
    framework, tmp_path, ocr_lmdb, four_steps
):
    """Evaluation and checkpoint on the same step, under a file-size limit half the model's
    file: best/ is written first and fails. Unhandled, best.partial would stay and the run die
    with exit 1 and two tracebacks (torch.save's RuntimeError, then its own "unexpected pos");
    Paddle's np.savez leaves its ZIP file open, whose close at exit prints a third."""
    run_dir = tmp_path / "run"
    shutil.copytree(four_steps(framework), run_dir)
    best = run_dir / "best"
    record = json.loads((best / "metric.json").read_text())
    record["value"] = -1.0  # so that the evaluation of step 6 beats it and writes best/
    (best / "metric.json").write_text(json.dumps(record))
    before = {p.name: p.read_bytes() for p in best.iterdir()}
    model = max(best.iterdir(), key=lambda p: p.stat().st_size)

    full = run(
        framework,
        run_dir,
        ocr_lmdb,
        8,
        *EVERY_2,
        "train.eval_every=2",
        flags=["--resume"],
        limit=model.stat().st_size // 2,
    )
    assert_one_line(
        full,
        "file-size limit reached: the best checkpoint (step 6",
        "the previous best/ and the checkpoints are intact",
        "ulimit -f",
    )
    assert_nothing_partial(run_dir)
    assert {p.name: p.read_bytes() for p in best.iterdir()} == before  # best/ of step 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000004",
    ]
    assert_resumes_from(framework, run_dir, ocr_lmdb, 4)


@pytest.mark.torch
def test_a_checkpoint_past_the_file_size_limit_is_named_as_such(tmp_path, ocr_lmdb, four_steps):
    """torch.save reports a failed write as RuntimeError("file write failed"), without the
    errno: a probe write to the partial file finds EFBIG, so that the one line names the limit
    rather than the RuntimeError (whose only fix would be a guess: permissions)."""
    run_dir = tmp_path / "run"
    shutil.copytree(four_steps("torch"), run_dir)
    full = run("torch", run_dir, ocr_lmdb, 8, *EVERY_2, flags=["--resume"], limit=(1 << 20) // 2)
    assert_one_line(
        full,
        "file-size limit reached: the checkpoint of step 6 does not fit in",
        "the previous checkpoints are intact",
    )
    assert_nothing_partial(run_dir)
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step-00000004"
    assert_resumes_from("torch", run_dir, ocr_lmdb, 4)


@pytest.mark.paddle  # the run files' code is the same for both frameworks: run in the Paddle half
def test_a_metrics_record_that_does_not_fit_ends_the_run_and_leaves_whole_lines(tmp_path, ocr_lmdb):
    """After the checkpoint of step 2, metrics.jsonl may grow by 100 bytes: the record of step 4
    (about 300) fails part way: the part written is cut off, exit 4 names the file, and
    --resume appends to whole lines (a buffered writer would flush the half line again at exit,
    with Python's "Exception ignored")."""
    run_dir = tmp_path / "run"
    full = run("paddle", run_dir, ocr_lmdb, 8, *EVERY_2, probe=(2, "metrics.jsonl+100"))
    assert_one_line(full, f"file-size limit reached: could not write {run_dir / 'metrics.jsonl'}")
    assert_nothing_partial(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2]
    assert_resumes_from("paddle", run_dir, ocr_lmdb, 2)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["type"], r["step"]) for r in records] == [("train", 2), ("train", 4), ("eval", 4)]


@pytest.mark.paddle  # as above
def test_train_log_that_cannot_grow_is_one_warning_and_the_run_goes_on(tmp_path, ocr_lmdb):
    """train.log is a copy of stderr: when it cannot grow, one warning and no more writes to it
    (logging's own handling prints "--- Logging error ---" and a traceback per line). The run
    then goes on until a write it needs fails: the checkpoint of step 4 or, when the scalar
    log's writer thread meets the limit first, the scalar log; exit 4 either way."""
    run_dir = tmp_path / "run"
    full = run("paddle", run_dir, ocr_lmdb, 8, *EVERY_2, probe=(2, "train.log+10"))
    line = assert_one_line(full, "file-size limit reached")
    assert "the checkpoint of step 4 does not fit" in line or str(run_dir / "scalars") in line
    warnings = [line for line in full.stderr.splitlines() if "train.log is no longer" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), full.stderr
    assert "[train] step=4" in full.stderr  # logged on stderr after train.log stopped
    assert_nothing_partial(run_dir)


@pytest.mark.torch
def test_a_plot_that_does_not_fit_ends_with_the_run_complete(tmp_path, ocr_lmdb):
    """The file-size limit set after the run's last checkpoint (step 4, evaluated first): a plot
    (tens of KB) past 8000 bytes, after summary.json (about 300) was written through the same
    run-file writer. Exit 4 naming the file, nothing partial; the run's weights are complete
    (latest and best/), and the line says so and how to draw the plots again (savefig writes in
    place: a failed one leaves half a file)."""
    limit, file = 8000, "plots/loss.png"
    run_dir = tmp_path / "run"
    full = run(
        "torch",
        run_dir,
        ocr_lmdb,
        4,
        *EVERY_2,
        "train.eval_every=2",
        "output.plots=true",
        probe=(4, limit),
    )
    line = assert_one_line(full, f"file-size limit reached: could not write {run_dir / file}")
    assert_nothing_partial(run_dir)
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step-00000004"
    assert (run_dir / "best/metric.json").is_file()
    assert not (run_dir / file).exists()
    assert (run_dir / "summary.json").is_file() and "the run itself is complete" in line
    redraw = subprocess.run(
        [sys.executable, "-m", "train.report", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert redraw.returncode == 0, redraw.stderr
    assert (run_dir / "plots/loss.png").stat().st_size > 8000


# The OCR fixture's LMDB is 240 KB: its disk cache needs about that much, and a batch of 8
# (3 x 32 x 160 bytes) that the loaders pass through shared memory takes 123 KB.
CACHE_NEEDS = "error: data.cache: disk needs 0.2"


@pytest.mark.torch
def test_a_disk_cache_on_a_volume_too_small_is_one_error_before_training(tmp_path, ocr_lmdb):
    """data.cache: disk in a 128 KB tmpfs. A sparse cache file (of data.cache_max_bytes) would
    take a SIGBUS at the first write to a page the volume has no room for: in the loader worker
    filling it (reported as dead on a good sample, exit 6), or in the trainer with num_workers 0.
    Its whole file is reserved at start: exit 4, one line naming the folder, the need, the free
    space and the fix."""
    with small_tmpfs(tmp_path / "small", 128 << 10) as disk:
        run_dir = tmp_path / "run"
        cache = [f"data.cache_dir={disk}", "data.cache=disk", "loader.num_workers=2"]
        full = run("torch", run_dir, ocr_lmdb, 12, *cache)  # an epoch: every record cached
        line = assert_one_line(full, CACHE_NEEDS, str(disk), "MB are free there")
        assert "data.cache: memory" in line and "or none" in line
        assert list(disk.iterdir()) == []  # its partial file removed
    assert_nothing_partial(run_dir)


@pytest.mark.torch
def test_a_disk_cache_past_the_file_size_limit_is_one_error_before_training(tmp_path, ocr_lmdb):
    """The same under a file-size limit of 200 KB, no root needed: the reservation meets EFBIG,
    named as the limit."""
    run_dir = tmp_path / "run"
    cache = [f"data.cache_dir={tmp_path / 'cache'}", "data.cache=disk", "loader.num_workers=2"]
    full = run("torch", run_dir, ocr_lmdb, 4, *cache, limit=200 << 10)
    assert_one_line(full, CACHE_NEEDS, "file-size limit is 0.20 MB")
    assert list((tmp_path / "cache").iterdir()) == []
    assert_nothing_partial(run_dir)
    # With the room, the same run builds the cache and trains (the reserved file is no bigger
    # than the dataset's bytes plus their framing, far under data.cache_max_bytes).
    fits = run("torch", tmp_path / "run2", ocr_lmdb, 4, *cache)
    assert fits.returncode == 0, fits.stderr[-3000:]
    (built,) = (tmp_path / "cache").iterdir()
    assert 240_000 < built.stat().st_size < 270_000
    assert built.stat().st_blocks * 512 >= built.stat().st_size  # allocated, not sparse
