"""scripts/bench_loader.py runs end to end in its tiny preset and writes the documented keys.
No timing assertions: speed targets live in the benchmark (docs/benchmarks.md), not in tests."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_tiny(tmp_path: Path, framework: str) -> dict:
    out = tmp_path / f"tiny-{framework}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.bench_loader",
            "--preset",
            "tiny",
            "--framework",
            framework,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert out.with_suffix(".md").is_file()
    return json.loads(out.read_text())


def _check_arm(row: dict, workers: list[str], copies: int | None = None) -> None:
    assert sorted(row["samples_per_s"]) == workers
    for w in workers:
        assert row["samples_per_s"][w] > 0
        detail = row["detail"][w]
        assert detail["trials_ok"] == detail["trials"] >= 1
        # CPU time is counted in clock ticks: a tiny window may read 0, never less.
        assert detail["cpu_us_per_sample"] >= 0
        assert detail["faults_per_batch"] >= 0  # minor page faults, counted from /proc
        assert len(row["rounds"][w]) == detail["trials"] and all(row["rounds"][w])
        for key in ("batch_bytes", "peak_worker_uss_mb", "shm_peak_delta_bytes", "first_batch_s"):
            assert key in detail
        if w != "0" and copies is not None:  # the hand-over of worker batches (bench/handover.py)
            assert detail["copies_per_batch"] == copies
            assert detail["handover_ms"] > 0 and detail["handover_share"] > 0


def _check_ratios(task: dict, names: set[str], workers: list[str]) -> None:
    """The three ratio kinds, each per peer and worker count (None where a figure is 0)."""
    for kind in ("ratios", "paired_ratios", "cpu_ratios"):
        assert set(task[kind]) == names, kind
        for by_workers in task[kind].values():
            assert sorted(by_workers) == workers
            assert all(r is None or r > 0 for r in by_workers.values())
    for name in names:  # tiny runs one round: the paired ratio is that round's own
        assert task["paired_ratios"][name] == pytest.approx(task["ratios"][name], rel=1e-3)


def _check_common(result: dict, framework: str) -> None:
    assert result["schema_version"] == 1 and result["framework"] == framework
    assert {"cpu", "cores", "python", "packages"} <= set(result["machine"])
    stall = result["stall"][framework]
    assert stall["step_s"] > 0 and len(stall["configs"]) == 3
    for row in stall["configs"].values():
        assert 0 <= row["wait_fraction"] <= 1


@pytest.mark.torch
def test_bench_tiny_torch(tmp_path):
    result = _run_tiny(tmp_path, "torch")
    _check_common(result, "torch")
    for arm, copies in (("ours", 1), ("torchvision_ref", 0), ("decode_only", 1)):
        _check_arm(result["resnet50"][arm], ["0", "1"], copies)
    _check_ratios(
        result["resnet50"], {"ours_vs_torchvision_ref", "ours_vs_decode_only"}, ["0", "1"]
    )
    ipc = result["ipc"]["resnet50"]
    assert (ipc["ours_dtype"], ipc["peer_dtype"]) == ("uint8", "float32")
    assert ipc["ratio"] == pytest.approx(0.25, abs=0.01)
    assert Path(tmp_path / "tiny-torch-resnet50-workers.png").is_file()


@pytest.mark.paddle
def test_bench_tiny_paddle_and_merge(tmp_path):
    result = _run_tiny(tmp_path, "paddle")
    _check_common(result, "paddle")
    for arm, copies in (("ours", 1), ("paddleocr", 2)):  # our batch ring; Paddle's own
        _check_arm(result["ocr"][arm], ["0", "1"], copies)
    _check_ratios(result["ocr"], {"ours_vs_paddleocr"}, ["0", "1"])
    assert result["ocr"]["png_probe"]["result"] in ("ok", "failed")
    assert result["ocr"]["records"] in ("jpeg+png", "jpeg-only")
    assert result["ipc"]["ocr"]["ours_dtype"] == "uint8"
    # --merge joins per-venv files; here one file stands in for both halves.
    merged = tmp_path / "merged.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.bench_loader",
            "--merge",
            str(tmp_path / "tiny-paddle.json"),
            "--out",
            str(merged),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    joined = json.loads(merged.read_text())
    assert "paddle" in joined["machines"] and joined["ocr"]["ours"] == result["ocr"]["ours"]


def test_ocr_layers_prints_every_layer():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.ocr_layers",
            "--lines",
            "64",
            "--batch",
            "16",
            "--passes",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("decode", "+", "get"))]
    assert len(rows) == 7 and all(float(row.split()[-1]) > 0 for row in rows)


def test_hdf5_reads_times_every_layout_alone_and_before_the_transform():
    command = [sys.executable, "-m", "bench.hdf5_reads", "--images", "16", "--passes", "2"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {
        line.rsplit(None, 2)[0]: float(line.split()[-2])
        for line in proc.stdout.splitlines()
        if line.startswith(("v1", "v2", "transform"))
    }
    expected = {"transform alone (bytes in memory)"} | {
        f"{layout}: {what}"
        for layout in ("v2 pread", "v2 h5py", "v1 row")
        for what in ("read alone", "read + transform")
    }
    assert set(rows) == expected and all(value > 0 for value in rows.values()), proc.stdout
    # A record read and transformed costs more than its transform alone, in every layout.
    for layout in ("v2 pread", "v2 h5py", "v1 row"):
        assert rows[f"{layout}: read + transform"] > rows[f"{layout}: read alone"], proc.stdout


def test_page_faults_counts_the_faults_that_reused_batches_avoid():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.page_faults", "--batch", "8", "--reps", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    faults = {
        line.split(",")[1].split(":")[0].strip(): int(line.split()[-3])
        for line in proc.stdout.splitlines()
        if line.startswith("fill a batch")
    }
    # 8 OCR lines are 90 pages: each faults once in new memory, none in a reused array (a
    # stray fault of the interpreter's own allocations aside).
    assert faults["newly mapped"] >= 90 and faults["reused"] <= 2, proc.stdout


@pytest.mark.torch
def test_torch_ring_compares_the_two_handovers_of_our_torch_loader():
    command = [sys.executable, "-m", "bench.torch_ring", "--images", "16", "--reps", "1"]
    command += ["--workers", "1", "--batches", "16", "--warmup", "8"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    faults = {
        line.split()[1].rstrip(":"): float(line.split(",")[2].split()[0])
        for line in proc.stdout.splitlines()
        if "faults/batch" in line
    }
    # A batch of 32 224x224x3 images is 1,176 pages: torch's own hand-over faults each into a
    # new /dev/shm file; the ring's 4 slots and the trainer's reused arrays are faulted in during
    # the 8 warm-up batches and stay mapped.
    assert faults["torch"] > 1000 and faults["ring"] < 200, proc.stdout
    assert "errors" not in proc.stdout and "ring / torch" in proc.stdout, proc.stdout


def _instructions(tmp_path: Path, task: str) -> dict:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed (apt-get install valgrind)")
    out = tmp_path / f"instructions-{task}.json"
    # Two batches of 16: the per-sample counts and the peer's ratio come out within 1% of
    # those over 64 items (ResNet: 2.067 against 2.066); the shape of the report is the test.
    command = [sys.executable, "-m", "bench.instructions", "--task", task, "--items", "32"]
    command += ["--batch-size", "16", "--passes", "1", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["settings"]["batch_size"] == 16 and result["settings"]["passes"] == 1
    for row in result["arms"].values():
        # Real work per sample (a decode is tens of thousands of instructions at the least),
        # most of it in named libraries.
        assert row["instructions_per_sample"] > 20_000
        assert sum(row["by_library"].values()) > 0.5 * row["instructions_per_sample"]
    assert result["peer_over_ours"] > 0
    assert result["versions"]["valgrind"].startswith("valgrind-")  # the counts' binaries
    assert f"{result['peer']} / {result['ours']} instructions" in proc.stdout
    return result


@pytest.mark.paddle
def test_instruction_counts_ocr(tmp_path):
    result = _instructions(tmp_path, "ocr")
    assert set(result["arms"]) == {"ours", "paddleocr"}
    # Ours decodes JPEGs with simplejpeg's libjpeg-turbo; PaddleOCR's with OpenCV's.
    assert any("jpeg" in name for name in result["arms"]["ours"]["by_library"])


@pytest.mark.torch
def test_instruction_child_runs_the_resnet50_arms(monkeypatch, capsys):
    """The counting itself (valgrind, callgrind_control, reading the dumps) is the same for every
    task and runs above on the OCR arms; a valgrind run of the ResNet-50 arms costs about 50 CPU
    seconds, most of it torch's start-up under valgrind. What differs per task is the data and
    the arms: here both ResNet-50 arms go through the child's protocol (a warm pass, a measured
    one, each followed by its line and a wait for the parent's go-ahead) on the task's inputs."""
    from bench import instructions, pipelines

    spec = instructions._spec("resnet50", items=32, batch_size=16)
    assert spec["workers"] == 0 and spec["batch_size"] == 16
    for arm in instructions.ARMS["resnet50"]:
        images: list[int] = []  # per pass, the images its batches held
        build = pipelines.BUILDERS[arm]

        def counted(spec, build=build, images=images):
            pipeline = build(spec)
            epoch = pipeline.epoch

            def epoch_counted(e):
                images.append(0)
                for batch in epoch(e):
                    images[-1] += len(
                        batch[0] if isinstance(batch, (list, tuple)) else batch["image"]
                    )
                    yield batch

            return pipelines.Pipeline(epoch_counted, pipeline.close, pipeline.handover)

        monkeypatch.setitem(pipelines.BUILDERS, arm, counted)
        monkeypatch.setattr(sys, "stdin", io.StringIO("go\ngo\n"))
        instructions.run_child(arm, spec, passes=1)
        lines = capsys.readouterr().out.splitlines()
        marks = [line for line in lines if line.startswith(instructions.MARK)]
        assert marks == [instructions.MARK + "warm", instructions.MARK + "measured"], lines
        assert images == [32, 32], arm  # the warm pass and the measured one: every record
