"""scripts/gpu_check.sh --dry-run: the GPU check's code paths on the CPU, so it cannot rot before
a GPU runs it. It prints one JSON object; every key the GPU run prints is there and every check
is "ok" (docs/first_gpu_run.md says what each one means).

The dry-run uses both venvs itself (.venv-torch and .venv-paddle, as make setup leaves them), so
it runs once per `make test`: in the torch half, skipped in the Paddle half.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHONS = [ROOT / ".venv-torch" / "bin" / "python", ROOT / ".venv-paddle" / "bin" / "python"]
MISSING = [str(p.relative_to(ROOT)) for p in VENV_PYTHONS if not p.exists()]
IN_PADDLE_HALF = os.environ.get("TEST_FRAMEWORK") == "paddle" or (
    not os.environ.get("TEST_FRAMEWORK")
    and Path(sys.prefix).resolve() == (ROOT / ".venv-paddle").resolve()
)

pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs both venvs (make setup): {MISSING} missing"),
    pytest.mark.skipif(
        IN_PADDLE_HALF, reason="runs once, in the torch half of make test (it uses both venvs)"
    ),
]

TOP_KEYS = {
    "schema",
    "mode",
    "ok",
    "started_at",
    "elapsed_s",
    "budget_s",
    "work_dir",
    "host",
    "torch_build",
    "paddle_build",
    "checks",
    "summary",
    "script_error",
}
CHECKS = [
    "setup.torch",
    "setup.paddle",
    "configs",
    "data",
    "smoke.paddle.ocr",
    "smoke.torch.resnet50",
    *(
        f"amp.{framework}.{task}.{dtype}"
        for framework in ("paddle", "torch")
        for task in ("ocr", "resnet50")
        for dtype in ("fp16", "bf16")
    ),
    "throughput.synthetic",
    *(f"throughput.loader.w{n}" for n in (1, 2, 4, 8)),
    "prefetcher.on",
    "prefetcher.off",
    "compile.paddle.ocr",
    "compile.torch.resnet50",
]
PADDLE_BUILD_KEYS = {
    "ran",
    "version",
    "compiled_with_cuda",
    "cuda",
    "cudnn",
    "cudnn_runtime",
    "device_name",
    "capability",
    "attempts",
    "cu12_source",
    "note",
}
HOST_KEYS = {"python", "cpus", "gpu", "driver", "cuda_driver", "compute_capability"}


@pytest.fixture(scope="module")
def report() -> dict:
    # Its own temporary work folder (data, checkpoints): removed when every check passed, kept
    # (path in the JSON's work_dir) when one did not.
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    try:
        return json.loads(result.stdout)  # one JSON object and nothing else on stdout
    except ValueError as error:
        raise AssertionError(f"stdout is not one JSON object: {result.stdout[-2000:]}") from error


def test_dry_run_prints_every_key_and_every_check_ok(report):
    assert set(report) >= TOP_KEYS, TOP_KEYS - set(report)
    assert report["schema"] == "gpu_check/1"
    assert report["mode"] == "dry-run"
    assert report["script_error"] is None
    assert list(report["checks"]) == CHECKS
    not_ok = {name: check for name, check in report["checks"].items() if check["status"] != "ok"}
    assert not not_ok, json.dumps(not_ok, indent=2)[-4000:]
    assert report["ok"] is True
    assert report["work_dir"] is None  # removed after a clean run
    assert set(report["paddle_build"]) >= PADDLE_BUILD_KEYS
    assert report["paddle_build"]["ran"]
    assert set(report["host"]) >= HOST_KEYS
    summary = report["summary"]
    assert summary["failed"] == [] and summary["skipped"] == []


def test_dry_run_checks_say_what_they_measured(report):
    checks = report["checks"]
    # Every command line of the GPU plan too went through the config loader.
    assert checks["configs"]["plans"] == ["gpu", "dry-run"] and checks["configs"]["validated"] > 0
    for name in ("smoke.paddle.ocr", "smoke.torch.resnet50"):
        smoke = checks[name]
        first, total = smoke["steps"]
        assert smoke["device"] == "cpu"
        assert smoke["loss_fell"] is True, smoke
        assert smoke["checkpoint_first"] == f"step-{first:08d}"
        assert smoke["resumed_from_step"] == first
        assert smoke["first_step_after_resume"] > first
        assert smoke["checkpoint_final"] == f"step-{total:08d}"
    for name in CHECKS:
        if name.startswith("amp."):
            amp = checks[name]
            assert amp["loss_finite"] is True and amp["steps"] >= 1, amp
            assert amp["amp_active"] is False  # the CPU trains in float32 and says so
    assert checks["throughput.synthetic"]["images_per_s"] > 0
    for workers in ("1", "2", "4", "8"):
        loader = report["summary"]["images_per_s"]["loader"][workers]
        assert loader["samples_per_s"] > 0
        assert 0 <= loader["data_wait_fraction"] <= 1
        assert loader["vs_synthetic"] > 0
    prefetcher = report["summary"]["prefetcher"]
    assert prefetcher["knob"] == "loader.device_prefetch"  # off: the same run with it false
    assert prefetcher["on"] > 0 and prefetcher["off"] > 0 and prefetcher["note"]
    for name in ("compile.paddle.ocr", "compile.torch.resnet50"):
        compiled = checks[name]
        for leg in ("off", "on"):
            assert compiled[leg]["steps"] >= 2 and compiled[leg]["step_s"] > 0, compiled
        assert compiled["compile_s"] is not None and compiled["step_off_over_on"] > 0
    # Paddle's to_static really runs on the CPU; torch's inductor compile would take minutes.
    assert checks["compile.paddle.ocr"]["engaged"] is True
    assert checks["compile.torch.resnet50"]["engaged"] is False
    assert set(report["summary"]["compile"]) == {"paddle.ocr", "torch.resnet50"}
    memory = report["summary"]["peak_gpu_memory_mb"]
    assert set(memory) == {"torch", "paddle", "by_check"}
    assert memory["torch"] is None and memory["paddle"] is None  # no GPU in a dry-run
