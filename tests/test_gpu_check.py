"""scripts/gpu_check.sh --dry-run: the GPU check's code paths on the CPU, so they cannot rot
before a GPU runs them. It prints one JSON object (and writes it, with a Markdown table, into its
work folder), then a short summary; every key the GPU run prints is there, null where the CPU
cannot measure it, and every check is "ok" (docs/first_gpu_run.md says what each one means).

The dry-run uses both venvs itself (.venv-torch and .venv-paddle, as make setup leaves them), so
it runs once per `make test`: in the Paddle half, skipped in the torch half (the longer one: the
dry run's 70 s balance the two). make test-compat runs it once more on the GPU host's stack
(.venv-compat: Python 3.12, torch 2.11, numpy 2) with --wheelhouse and no package index, where
Paddle is absent and its checks are skipped. The pure parts (the budget, the Paddle verdicts,
the compile figure, the sampler) are tested in both halves.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu_check import commands as plan_module
from scripts.gpu_check.context import summarize_samples

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHONS = [ROOT / ".venv-torch" / "bin" / "python", ROOT / ".venv-paddle" / "bin" / "python"]
MISSING = [str(p.relative_to(ROOT)) for p in VENV_PYTHONS if not p.exists()]
IN_TORCH_HALF = os.environ.get("TEST_FRAMEWORK") == "torch" or (
    not os.environ.get("TEST_FRAMEWORK")
    and Path(sys.prefix).resolve() == (ROOT / ".venv-torch").resolve()
)

dry_run = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs both venvs (make setup): {MISSING} missing"),
    pytest.mark.skipif(
        IN_TORCH_HALF, reason="runs once, in the Paddle half of make test (it uses both venvs)"
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
    "report_md",
    "host",
    "wheelhouse",
    "torch_build",
    "paddle_build",
    "checks",
    "summary",
    "script_error",
}
SETUP_CHECKS = ["setup.torch", "setup.paddle", "configs", "data"]
RUN_CHECKS = [
    "throughput.synthetic",
    "throughput.loader.w8",
    "prefetcher.off",
    "compile.torch.resnet50",
    "compile.paddle.ocr",
    "throughput.paddle.ocr.ring_on",
    "throughput.paddle.ocr.ring_off",
    *(
        f"amp.{framework}.{task}.{dtype}"
        for framework in ("paddle", "torch")
        for task in ("ocr", "resnet50")
        for dtype in ("fp16", "bf16")
    ),
    "smoke.torch.resnet50",
    "smoke.paddle.ocr",
    "finetune.paddle.ppocrv4",
    "dist.torch.gloo2",
]
ONLY = "amp.paddle.ocr.b*"  # run --only: one check, chosen by a pattern
THROUGHPUT = [
    "throughput.loader.w8",
    "prefetcher.off",
    "throughput.paddle.ocr.ring_on",
    "throughput.paddle.ocr.ring_off",
]
BUILD_KEYS = {
    "python",
    "version",
    "compiled_with_cuda",
    "cuda",
    "cudnn",
    "cudnn_runtime",
    "device_name",
    "capability",
}
HOST_KEYS = {"python", "cpus", "gpu", "driver", "cuda_driver", "compute_capability"}
NVML_KEYS = {"busy_pct_median", "busy_pct_max", "mem_mib_median", "mem_mib_max", "samples"}


def gpu_check(*args: str, timeout: float, code: int = 0, env: dict | None = None) -> dict:
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == code, result.stderr[-4000:]
    # One JSON object, then the summary lines (each starts "gpu_check: ").
    text, summary = result.stdout.split("\n}\n", 1)
    assert summary.startswith("gpu_check: ok=") and all(
        line.startswith("gpu_check: ") for line in summary.splitlines()
    ), summary
    try:
        return json.loads(text + "\n}")
    except ValueError as error:
        raise AssertionError(f"stdout is not one JSON object: {result.stdout[-2000:]}") from error


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """The dry run, with its work folder (data, checkpoints, the reports)."""
    work = tmp_path_factory.mktemp("gpu-check")
    return {"run": gpu_check("--dry-run", "--out", str(work), timeout=900), "work": work}


def assert_all_ok(report: dict, names: list[str]) -> None:
    assert set(report) >= TOP_KEYS, TOP_KEYS - set(report)
    assert report["schema"] == "gpu_check/2"
    assert report["mode"] == "dry-run"
    assert report["script_error"] is None
    assert list(report["checks"]) == names
    not_ok = {name: check for name, check in report["checks"].items() if check["status"] != "ok"}
    assert not not_ok, json.dumps(not_ok, indent=2)[-4000:]
    assert report["ok"] is True
    assert report["summary"]["failed"] == [] and report["summary"]["skipped"] == []


@dry_run[0]
@dry_run[1]
def test_dry_run_prints_every_figure_and_every_check_ok(reports):
    report = reports["run"]
    assert_all_ok(report, SETUP_CHECKS + RUN_CHECKS)
    checks, summary = report["checks"], report["summary"]
    for name in ("setup.torch", "setup.paddle"):
        # the probe's real training step (conv, BatchNorm, backward, Adam) ran with the ops
        assert checks[name]["ops"]["train_step"] == "ok", checks[name]
    assert set(report["torch_build"]) >= BUILD_KEYS and report["torch_build"]["version"]
    assert set(report["paddle_build"]) >= BUILD_KEYS and report["paddle_build"]["version"]
    assert set(report["host"]) >= HOST_KEYS
    assert report["wheelhouse"] is None  # none given
    # Every command line of the GPU plan too went through the config loader.
    configs = checks["configs"]
    assert configs["plans"] == ["gpu", "dry-run"] and configs["validated"] > 0
    # The JSON and the table beside it, written after every check and at the end.
    work = reports["work"]
    written = json.loads((work / "gpu_check.json").read_text())
    assert written["checks"] == checks
    table = (work / "gpu_check.md").read_text()
    assert report["report_md"] == str(work / "gpu_check.md")
    for name in RUN_CHECKS:
        assert f"| {name} | ok |" in table
    plan = plan_module.DRY_PLAN
    synthetic = checks["throughput.synthetic"]
    assert synthetic["images_per_s"] > 0 and synthetic["measured_steps"] == plan.measure_steps
    for name in THROUGHPUT:
        check = checks[name]
        assert check["samples_per_s"] > 0 and 0 <= check["data_wait_fraction"] <= 1, check
        assert check["measured_steps"] >= plan.measure_steps, check  # after the warm-up window
        assert check["warmup_steps"] == plan.warmup_steps
        assert check["epochs"] == [0], check  # the window never crossed an epoch end
    # the 10 Hz GPU sampler: a figure per run, null without a GPU
    for name in RUN_CHECKS:
        assert "nvml" in checks[name] and checks[name]["nvml"] is None, name
    assert checks["throughput.loader.w8"]["vs_synthetic"] > 0
    assert summary["prefetcher"]["knob"] == "loader.device_prefetch"
    assert summary["prefetcher"]["on"] > 0 and summary["prefetcher"]["off"] > 0
    assert summary["batch_ring"]["knob"] == "loader.batch_ring"
    assert summary["batch_ring"]["on_over_off"] > 0
    assert checks["throughput.paddle.ocr.ring_on"]["batch_ring"] is True
    assert checks["throughput.paddle.ocr.ring_off"]["batch_ring"] is False
    for name in ("compile.paddle.ocr", "compile.torch.resnet50"):
        compiled = checks[name]
        for leg in ("off", "on"):
            assert compiled[leg]["measured_steps"] >= plan.measure_steps, compiled
            assert compiled[leg]["step_s"] > 0 and compiled[leg]["epochs"] == [0], compiled
        assert compiled["compile_s"] is not None and compiled["step_off_over_on"] > 0
    # The compilers and Python.h were looked for; Paddle's to_static really runs on the CPU,
    # torch's inductor compile would take minutes (tests/test_compile.py runs it).
    assert "missing" in checks["compile.torch.resnet50"]["toolchain"]
    assert checks["compile.paddle.ocr"]["engaged"] is True
    assert checks["compile.torch.resnet50"]["engaged"] is False
    for name in RUN_CHECKS:
        if name.startswith("amp."):
            amp = checks[name]
            assert amp["loss_finite"] is True and amp["steps"] >= 1, amp
            assert amp["amp_active"] is False  # the CPU trains in float32 and says so
            assert "loss_scale" in amp and amp["loss_scale"] is None  # no enabled scaler
    assert set(summary["loss_scale"]) == {n for n in RUN_CHECKS if n.endswith(".fp16")}
    for name in ("smoke.torch.resnet50", "smoke.paddle.ocr"):
        smoke = checks[name]
        first, total = smoke["steps"]
        assert smoke["device"] == "cpu"
        assert smoke["loss_fell"] is True, smoke
        assert smoke["checkpoint_first"] == f"step-{first:08d}"
        assert smoke["resumed_from_step"] == first
        assert smoke["first_step_after_resume"] > first
        assert smoke["checkpoint_final"] == f"step-{total:08d}"
        # resumed at `first` and run to `total` ends where the straight run does
        resume = smoke["resume_loss"]
        assert resume["step"] == total and resume["matches"] is True, resume
        assert summary["resume_loss"][name] == resume
    finetune = checks["finetune.paddle.ppocrv4"]
    assert finetune["steps"] == plan.finetune_steps and finetune["export_ok"] is True
    assert "inference.pdmodel" in finetune["export_files"], finetune
    dist = checks["dist.torch.gloo2"]
    assert dist["world_size"] == 2 and dist["backend"] == "gloo"
    assert dist["param_max_diff"] == 0 and dist["loss_fell"] is True
    memory = summary["peak_gpu_memory_mb"]
    assert set(memory) == {"torch", "paddle", "by_check"}
    assert memory["torch"] is None and memory["paddle"] is None  # no GPU in a dry-run
    # The dry run's trainings draw no plots (output.plots=false), in either framework.
    assert list(work.glob("runs/*/plots/*.png")) == [], list(work.glob("runs/*/plots/*"))


def test_gpu_plan_measures_every_throughput_figure_inside_one_epoch():
    plan = plan_module.GPU_PLAN
    assert plan.measure_steps >= 96
    assert plan.images_train // plan.bench_batch >= plan.bench_steps  # ResNet runs
    train_lines = plan.ocr_lines - max(8, plan.ocr_lines // 10)
    assert train_lines // plan.ocr_bench_batch >= plan.bench_steps  # Paddle OCR runs
    # one command of at most 9 minutes on the lent host, with room to end it
    assert plan.budget_s <= 510


def test_sampler_figures_leave_out_the_idle_start_and_end():
    text = "0, 500\n0, 600\n90, 9000\n100, 9100\n80, 9050\n0, 700\n"
    figures = summarize_samples(text)
    assert figures == {
        "busy_pct_median": 90.0,
        "busy_pct_max": 100.0,
        "mem_mib_median": 9050.0,
        "mem_mib_max": 9100.0,
        "samples": 3,
    }
    assert summarize_samples("")["samples"] == 0


def test_only_runs_the_selected_checks_and_skips_the_rest_with_the_reason(tmp_path):
    """--only (the tail of a cut run): a check runs when a pattern matches it and is still
    undecided; the others are skipped naming the patterns, and the reports go beside the full
    run's."""
    from scripts.gpu_check.cli import _ready, parser, report_paths, skeleton
    from scripts.gpu_check.context import Context

    ctx = Context(plan_module.DRY_PLAN, tmp_path, budget_s=60)
    ctx.only = [ONLY]
    report = skeleton(plan_module.DRY_PLAN, tmp_path, SETUP_CHECKS + RUN_CHECKS)
    report["checks"]["amp.paddle.ocr.fp16"] = {"status": "skipped", "reason": "no Paddle in X"}
    selected = [name for name in RUN_CHECKS if _ready(report, ctx, name)]
    assert selected == ["amp.paddle.ocr.bf16"]
    for name in RUN_CHECKS:
        reason = report["checks"][name].get("reason", "")
        if name == "amp.paddle.ocr.fp16":
            assert reason == "no Paddle in X"  # decided by its setup: kept as it was
        elif name != "amp.paddle.ocr.bf16":
            assert reason.startswith(f"not selected (--only {ONLY})"), (name, reason)
    args = parser().parse_args(["--only", ONLY, "--out", str(tmp_path)])
    assert report_paths(tmp_path, [ONLY]) == (
        tmp_path / "gpu_check-only.json",
        tmp_path / "gpu_check-only.md",
    )
    assert report_paths(tmp_path, []) == (tmp_path / "gpu_check.json", tmp_path / "gpu_check.md")
    assert args.only == ONLY


FAKE_SMI = """#!/usr/bin/env bash
# nvidia-smi --query-gpu=... -lms 100 -i N: a sample per 0.05 s (idle first) until killed
echo "0, 400"
while true; do echo "75, 8000"; sleep 0.05; done
"""


def test_sampler_runs_beside_a_gpu_run_child_and_is_null_in_the_dry_run(tmp_path, monkeypatch):
    """Context.spawn with sample_gpu: in GPU mode nvidia-smi samples while the child runs and
    the run's figures come back; in the dry-run there is no sampler (null)."""
    from scripts.gpu_check.context import Context

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    child = ["python3", "-c", "import time; time.sleep(0.6)"]
    gpu = Context(plan_module.GPU_PLAN, tmp_path / "gpu", budget_s=60)
    result = gpu.spawn("sampled", child, timeout_s=30, sample_gpu=True)
    assert result.ok and result.nvml["samples"] >= 3, result.nvml
    assert result.nvml["busy_pct_median"] == 75.0 and result.nvml["mem_mib_max"] == 8000.0
    assert (tmp_path / "gpu" / "stats" / "sampled.nvml.csv").is_file()
    dry = Context(plan_module.DRY_PLAN, tmp_path / "dry", budget_s=60)
    assert dry.spawn("unsampled", child, timeout_s=30, sample_gpu=True).nvml is None


def test_train_helper_records_the_fp16_loss_scale_after_each_update(monkeypatch):
    """_train's instrumentation (GPU_CHECK_LOSS_SCALE): the scale after each update of an
    enabled GradScaler, as its changes. torch's scaler runs on the CPU too, so an overflow (an
    infinite gradient) halves it here as it would on the GPU."""
    torch = pytest.importorskip("torch")
    from scripts.gpu_check.helpers import _record_loss_scale, _scale_trajectory

    monkeypatch.setattr(torch.amp.GradScaler, "update", torch.amp.GradScaler.update)  # restored
    scales = _record_loss_scale(["--set", "framework=torch"])
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for overflow in (False, True, False):
        optimizer.zero_grad()
        loss = (weight * (math.inf if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scales == [1024.0, 512.0, 512.0]
    assert _scale_trajectory(scales) == {
        "source": "GradScaler.update",
        "updates": 3,
        "changes": [[1, 1024.0], [2, 512.0]],
        "final": 512.0,
    }
    assert _scale_trajectory([]) is None  # no enabled scaler: null in the JSON


def test_a_child_cut_by_the_budget_is_skipped_and_the_exit_code_says_so(tmp_path):
    """A check whose child the budget's end kills is skipped (not an error), and a run with a
    skipped check exits 3; a child killed by its own, shorter timeout is a failure."""
    from scripts.gpu_check.cli import exit_code, run_check, skeleton
    from scripts.gpu_check.context import Context, OutOfTime

    sleeper = ["python3", "-c", "import time; time.sleep(30)"]
    ctx = Context(plan_module.DRY_PLAN, tmp_path, budget_s=1.5)
    with pytest.raises(OutOfTime, match="cut by the time budget"):
        ctx.spawn("cut", sleeper, timeout_s=60, reserve_s=0)
    report = skeleton(plan_module.DRY_PLAN, tmp_path, ["data"])
    result = run_check(report, ctx, "data", lambda c: {"status": "ok", **c.spawn("x", sleeper)})
    assert result["status"] == "skipped" and "budget" in result["reason"], result
    assert exit_code(report) == 3
    own = Context(plan_module.DRY_PLAN, tmp_path, budget_s=60)
    timed_out = own.spawn("own-timeout", sleeper, timeout_s=0.5)
    assert timed_out.rc is None and "timed out" in timed_out.failure()
    report["checks"]["data"] = {"status": "error", "error": timed_out.failure()}
    assert exit_code(report) == 0  # every check ran; the error is in the JSON


def test_compile_figure_leaves_out_the_wait_for_data():
    """Compiled vs eager from loader-bound runs: each step's time less its wait for data, so a
    loader that sets the pace (the same in both runs) does not hide what compile changed."""
    from scripts.gpu_check.checks import step_compute_s

    eager = [{"batch_cost_s": 0.50, "reader_cost_s": 0.40} for _ in range(4)]  # 0.1 s compute
    compiled = [{"batch_cost_s": 0.50, "reader_cost_s": 0.45} for _ in range(4)]  # 0.05 s
    off, on = step_compute_s(eager), step_compute_s(compiled)
    assert off[-1] / on[-1] == pytest.approx(2.0)  # whole steps would read 1.0
    assert step_compute_s([{"batch_cost_s": 0.2}]) == [0.2]  # no wait recorded
    assert step_compute_s([{"loss": 1.0}]) == []


def _stub_probe(monkeypatch, facts: dict) -> None:
    from scripts.gpu_check import checks
    from scripts.gpu_check.context import RunResult

    result = RunResult(0, 1.0, Path("probe.log"), "", stats=facts)
    monkeypatch.setattr(checks, "probe", lambda ctx, name, framework: (result, facts))


def _gpu_context(tmp_path):
    from scripts.gpu_check.context import Context

    ctx = Context(plan_module.GPU_PLAN, tmp_path, budget_s=60)
    ctx.python.update(torch="/opt/py/bin/python3", paddle="/opt/py/bin/python3")
    return ctx


def test_paddle_cuda11_build_on_hopper_fails_setup_naming_the_fix(tmp_path, monkeypatch):
    """A CUDA 11.8 Paddle build on an sm_90 GPU: the probe runs no op (they would pass and
    training would abort later); setup.paddle fails with the reason and the CUDA 12 base."""
    from scripts.gpu_check.checks import setup_paddle
    from scripts.gpu_check.helpers import paddle_arch_problem

    verdict = paddle_arch_problem("2.6.2", "11.8", (9, 0))
    assert verdict["fatal"] is True and "sm_90" in verdict["reason"]
    assert paddle_arch_problem("2.6.2", "12.0", (9, 0)) is None
    assert paddle_arch_problem("2.6.2", "11.8", (8, 9)) is None  # Ada runs the 11.8 build
    facts = {
        "ok": False,
        "error": verdict["reason"],
        "version": "2.6.2",
        "compiled_with_cuda": True,
        "cuda": "11.8",
        "capability": "9.0",
        "arch_problem": verdict,
    }
    _stub_probe(monkeypatch, facts)
    result = setup_paddle(_gpu_context(tmp_path))
    assert result["status"] == "error", result
    assert "sm_90" in result["error"] and "cuda12" in result["error"]
    assert result["cuda"] == "11.8"


def test_no_paddle_build_skips_the_paddle_checks_saying_why(tmp_path, monkeypatch):
    from scripts.gpu_check.checks import setup_paddle

    _stub_probe(monkeypatch, {"ok": False, "import_error": "ModuleNotFoundError: paddle"})
    result = setup_paddle(_gpu_context(tmp_path))
    assert result["status"] == "skipped" and "--paddle-python" in result["reason"], result
    _stub_probe(monkeypatch, {"ok": True, "version": "2.6.2", "compiled_with_cuda": False})
    result = setup_paddle(_gpu_context(tmp_path))
    assert result["status"] == "skipped" and "CPU build" in result["reason"], result


def test_a_missing_data_layer_package_names_the_wheelhouse(tmp_path, monkeypatch):
    from scripts.gpu_check.checks import setup_torch

    facts = {"ok": False, "missing_imports": ["lmdb", "isal"], "version": "2.11.0"}
    _stub_probe(monkeypatch, facts)
    result = setup_torch(_gpu_context(tmp_path))
    assert result["status"] == "error", result
    assert re.search("cannot import lmdb, isal: .*make gpu-wheelhouse", result["error"]), result


COMPAT_WHEELHOUSE = ROOT / ".cache" / "gpu-wheelhouse" / "py3.12"


@pytest.mark.compat
@pytest.mark.skipif(
    os.environ.get("TEST_COMPAT") != "1", reason="make test-compat runs it, in .venv-compat"
)
def test_dry_run_on_the_gpu_hosts_stack_with_a_wheelhouse_and_no_package_index(tmp_path):
    """What a borrowed GPU host runs: its own Python and torch (here .venv-compat: Python 3.12,
    torch 2.11, numpy 2), the wheelhouse installed with --no-index into the work folder, no
    package index (pip pointed at a closed port), no Paddle: every torch check ok, every Paddle
    check skipped with the reason, exit 3."""
    closed = "http://127.0.0.1:9/"
    env = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": closed}
    env.update(HTTPS_PROXY=closed, HTTP_PROXY=closed)
    work = tmp_path / "out"
    args = ["--python", sys.executable, "--wheelhouse", str(COMPAT_WHEELHOUSE), "--dry-run"]
    report = gpu_check(*args, "--out", str(work), timeout=900, code=3, env=env)
    checks = report["checks"]
    assert report["script_error"] is None
    wheels = report["wheelhouse"]
    assert {w.split("-")[0] for w in wheels["wheels"]} == {"isal", "lmdb", "simplejpeg"}, wheels
    setup = checks["setup.torch"]
    assert setup["status"] == "ok" and setup["numpy"].startswith("2."), setup
    assert setup["imports"]["lmdb"].startswith(str(work / "site")), setup["imports"]
    paddle_checks = [n for n in SETUP_CHECKS + RUN_CHECKS if ".paddle" in n]
    for name in paddle_checks:
        assert checks[name]["status"] == "skipped", (name, checks[name])
        assert "no Paddle in" in checks[name]["reason"], checks[name]
    not_ok = {n: c for n, c in checks.items() if n not in paddle_checks and c["status"] != "ok"}
    assert not not_ok, json.dumps(not_ok, indent=2)[-4000:]
    synthetic = checks["throughput.synthetic"]
    assert synthetic["images_per_s"] > 0 and synthetic["nvml"] is None
    assert checks["compile.torch.resnet50"]["step_off_over_on"] > 0
    assert checks["smoke.torch.resnet50"]["resume_loss"]["matches"] is True
    assert report["summary"]["skipped"] == paddle_checks
