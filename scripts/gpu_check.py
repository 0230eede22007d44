#!/usr/bin/env python
r"""The first GPU run in one command: set-up, smoke trainings, AMP, throughput, one JSON object.

    bash scripts/gpu_check.sh > gpu_check.json   # a host with one NVIDIA GPU
    bash scripts/gpu_check.sh --dry-run          # the same code paths on the CPU, no installs

What it measures and how to read the JSON: docs/first_gpu_run.md.

The orchestrator (``main``) uses the standard library only: it runs on the host's python3 before
any venv exists, makes the venvs (GPU mode) and runs every check as a child process of a venv's
python, so a check that fails, hangs or aborts inside a CUDA library is recorded in the JSON and
the next one runs. The children are this file's helper commands, whose names start with "_":
``_probe`` (framework build and a few ops on the device), ``_data`` (synthetic datasets),
``_train`` (``python -m train`` plus peak device memory, optionally without the torch
side-stream prefetcher) and ``_synthetic`` (ResNet-50 steps on random device tensors).

Progress goes to stderr, the JSON to stdout. Exit 0: every check ran (its status, ok or error,
is in the JSON); 3: the time budget (GPU_CHECK_BUDGET_S) left some checks skipped; 1: the script
itself broke (the JSON then has script_error); 2: bad command line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import glob
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
SCHEMA = "gpu_check/1"
CACHE = ROOT / ".cache" / "gpu-check"  # GPU mode's venvs (ignored by git and the images)
# Paddle 2.6's CUDA 12 build (2.6.2.post120) is published only on Paddle's own package index.
PADDLE_CU12_INDEX = "https://www.paddlepaddle.org.cn/packages/stable/cu120/"
PADDLE_BUILDS = {
    # build: (requirements file, extra index, what it is)
    "cu118": ("requirements/paddle-gpu-cu118.txt", None, "paddlepaddle-gpu 2.6.2, CUDA 11.8"),
    "cu120": (
        "requirements/paddle-gpu-cu120.txt",
        "cu12",
        "paddlepaddle-gpu 2.6.2.post120, CUDA 12.0",
    ),
}
TASKS = ("ocr", "resnet50")
FRAMEWORKS = ("paddle", "torch")
AMP_DTYPES = ("fp16", "bf16")
WORKER_COUNTS = (1, 2, 4, 8)
MARK = "GPU-CHECK "  # helpers print one line "GPU-CHECK {json}" among whatever a framework prints


def check_names() -> list[str]:
    """Every check of the JSON, in the order they run (the dry-run prints the same ones)."""
    names = ["setup.torch", "setup.paddle", "configs", "data"]
    names += ["smoke.paddle.ocr", "smoke.torch.resnet50"]
    names += [
        f"amp.{fw}.{task}.{dtype}" for fw in FRAMEWORKS for task in TASKS for dtype in AMP_DTYPES
    ]
    names += ["throughput.synthetic"]
    names += [f"throughput.loader.w{n}" for n in WORKER_COUNTS]
    return names + ["prefetcher.on", "prefetcher.off"]


# --------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Plan:
    """Sizes for one mode. GPU: enough steps to see learning and stable throughput in minutes;
    dry-run: the fewest steps that still walk every code path, on the CPU."""

    gpu: bool
    jobs: int  # smoke and AMP runs at once (the throughput runs always run alone)
    budget_s: float  # wall-clock budget from the start; checks past it are skipped
    run_timeout_s: float  # one training run
    ocr_lines: int
    images_train: int
    images_val: int
    classes: int
    smoke_steps: tuple[int, int]  # first run, then --resume up to the second
    # The dry-run's smoke runs train on the small validation split: a batch or two seen again and
    # again, so that 6 CPU steps show the loss falling (on a fresh batch each step they may not).
    smoke_split: str
    smoke_sets: dict[str, tuple[str, ...]]
    amp_steps: int
    amp_sets: dict[str, tuple[str, ...]]
    bench_sets: tuple[str, ...]
    bench_batch: int
    bench_steps: int
    bench_log_every: int
    synthetic_steps: tuple[int, int]  # warm-up, timed

    @property
    def device(self) -> str:
        return "gpu" if self.gpu else "cpu"


GPU_PLAN = Plan(
    gpu=True,
    jobs=4,
    budget_s=470.0,
    run_timeout_s=240.0,
    ocr_lines=2000,
    images_train=2048,
    images_val=128,
    classes=10,
    smoke_steps=(80, 120),
    smoke_split="train",
    smoke_sets={
        task: ("train.log_every=10", "train.eval_every=40", "train.checkpoint_every=40")
        for task in TASKS
    },
    amp_steps=8,
    amp_sets={task: ("train.log_every=2",) for task in TASKS},
    bench_sets=(),
    bench_batch=128,
    bench_steps=32,
    bench_log_every=8,
    synthetic_steps=(8, 30),
)
_TINY = ("loader.batch_size=8", "optim.warmup_steps=1")
_TINY_IMAGES = ("data.image_size=32", "data.eval_resize=36")
DRY_PLAN = Plan(
    gpu=False,
    jobs=2,
    budget_s=420.0,
    run_timeout_s=180.0,
    ocr_lines=160,
    images_train=48,
    images_val=16,
    classes=4,
    smoke_steps=(4, 6),
    smoke_split="val",
    smoke_sets={
        "ocr": (
            *_TINY,
            "loader.num_workers=1",
            "train.log_every=2",
            "train.eval_every=4",
            "train.checkpoint_every=4",
        ),
        "resnet50": (
            "loader.batch_size=16",  # the whole validation file: one batch per epoch
            "optim.warmup_steps=1",
            *_TINY_IMAGES,
            "loader.num_workers=1",
            "train.log_every=2",
            "train.eval_every=4",
            "train.checkpoint_every=4",
        ),
    },
    amp_steps=2,
    amp_sets={
        "ocr": (*_TINY, "loader.num_workers=1", "train.log_every=1"),
        "resnet50": (*_TINY, *_TINY_IMAGES, "loader.num_workers=1", "train.log_every=1"),
    },
    bench_sets=("model.name=resnet18", *_TINY_IMAGES),
    bench_batch=4,
    bench_steps=4,
    bench_log_every=2,
    synthetic_steps=(1, 2),
)


# --------------------------------------------------------------------------------- utilities
_print_lock = threading.Lock()
_START = time.monotonic()


def say(message: str) -> None:
    with _print_lock:
        print(
            f"[gpu_check {time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True
        )


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def marked(stdout: str) -> dict:
    """The helper's ``GPU-CHECK {json}`` line (the last one), whatever else was printed."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            with contextlib.suppress(ValueError):
                return json.loads(line[len(MARK) :])
    return {}


_ERROR_LINE = re.compile(r"^((config )?error:|[\w.]*(Error|Exception|Interrupt)\b|.*Error: )")


def error_text(log: str, limit: int = 600) -> str:
    """The line that says what went wrong: the last exception or ``error:`` line of a log."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line) and not line.startswith("File "):
            return line[:limit]
    return (lines[-1] if lines else "no output")[:limit]


def tail(text: str, lines: int = 15, limit: int = 2000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-limit:]


def clean(value):
    """JSON-safe: non-finite floats as strings (NaN is not JSON), other objects as text."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def rounded(value, digits: int = 4):
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else str(value)
    return value


@dataclass
class RunResult:
    """One child process: exit code, seconds, its log, and the stats file a helper wrote."""

    rc: int | None  # None: timed out (killed)
    elapsed_s: float
    log_path: Path
    output: str
    stats: dict = field(default_factory=dict)
    timeout_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def failure(self) -> str:
        if self.rc is None:
            return f"timed out after {self.timeout_s:.0f} s: {error_text(self.output)}"
        return f"exit {self.rc}: {error_text(self.output)}"


class OutOfTime(Exception):
    """The budget is spent: the check is skipped, not failed."""


class Context:
    """What every check needs: the plan, the work folder, the venvs' pythons, the clock."""

    def __init__(self, plan: Plan, work: Path, budget_s: float) -> None:
        self.plan = plan
        self.work = work
        self.deadline = _START + budget_s
        self.budget_s = budget_s
        self.python: dict[str, str | None] = {"torch": None, "paddle": None}
        self.env: dict[str, dict[str, str]] = {"torch": {}, "paddle": {}}
        self.setup_error: dict[str, str] = {}
        self.stopping = False  # interrupted: start nothing more
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        for sub in ("logs", "stats", "runs", "data"):
            (work / sub).mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        """Kill every child still running, with its process group (they run in sessions of
        their own, so a Ctrl-C or SIGTERM of this script does not reach them)."""
        self.stopping = True
        with self._lock:
            running = list(self._running)
        for proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def spawn(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        reserve_s: float = 20.0,
    ) -> RunResult:
        """Run ``cmd`` from the repository root, output to logs/NAME.log; kill it (and its
        process group) past its timeout, which never reaches past the budget."""
        if self.stopping:
            raise OutOfTime("interrupted")
        left = self.remaining()
        if left < reserve_s:
            raise OutOfTime(f"time budget spent ({self.budget_s:.0f} s, GPU_CHECK_BUDGET_S)")
        timeout = min(timeout_s or self.plan.run_timeout_s, left)
        log_path = self.work / "logs" / f"{name}.log"
        full_env = dict(os.environ)
        for key in ("OCR_DATA_DIR", "RESNET50_DATA_DIR", "RUNS_ROOT", "CACHE_ROOT"):
            full_env.pop(key, None)  # the scenario files' container roots: paths are explicit here
        full_env.update({"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
        full_env.update(env or {})
        started = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            with self._lock:
                self._running.add(proc)
            try:
                rc: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
            finally:
                with self._lock:
                    self._running.discard(proc)
        output = log_path.read_text(encoding="utf-8", errors="replace")
        return RunResult(rc, time.monotonic() - started, log_path, output, timeout_s=timeout)

    def helper(
        self,
        name: str,
        framework: str,
        args: list[str],
        timeout_s: float | None = None,
        stats: bool = False,
    ) -> RunResult:
        """Run a helper command of this file in ``framework``'s venv."""
        python = self.python[framework]
        if python is None:
            raise RuntimeError(f"setup.{framework} failed: {self.setup_error.get(framework, '?')}")
        stats_path = self.work / "stats" / f"{name}.json"
        extra = ["--stats", str(stats_path)] if stats else []
        cmd = [python, str(SCRIPT), args[0], *extra, *args[1:]]
        result = self.spawn(name, cmd, self.env[framework], timeout_s)
        result.stats = read_json(stats_path) if stats else marked(result.output)
        return result

    def train(
        self, name: str, framework: str, train_args: list[str], no_prefetch: bool = False
    ) -> RunResult:
        """``python -m train TRAIN_ARGS`` in the framework's venv, through ``_train``."""
        flags = ["--no-prefetch"] if no_prefetch else []
        return self.helper(name, framework, ["_train", *flags, "--", *train_args], stats=True)


# ------------------------------------------------------------------ the training command lines
# Pure functions of (plan, work folder), so that the `configs` check can validate every command
# of both plans, the GPU one included, wherever it runs (make test runs the dry-run).
def data_sets(work: Path, task: str, val: bool = True, train_split: str = "train") -> list[str]:
    """--set items for the synthetic data: OCR LMDBs or HDF5 files, by split."""
    data = work / "data"
    if task == "ocr":
        split = {name: data / "ocr" / name for name in ("train", "val")}
        items = [f"data.char_dict={data / 'ocr' / 'charset.txt'}"]
    else:
        split = {name: data / "imagenet" / f"{name}.h5" for name in ("train", "val")}
        items = []
    items.append(f"data.train={split[train_split]}")
    items.append(f"data.val={split['val']}" if val else "data.val=null")
    return items


def smoke_args(plan: Plan, work: Path, framework: str, task: str, leg: int) -> list[str]:
    """Leg 1: the smoke config from scratch to smoke_steps[0]; leg 2: --resume to [1]."""
    name = f"smoke.{framework}.{task}"
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        *data_sets(work, task, train_split=plan.smoke_split),
        *plan.smoke_sets[task],
        f"train.max_steps={plan.smoke_steps[leg - 1]}",
    ]
    return [
        "--config",
        f"configs/{task}/smoke.yaml",
        "--output-dir",
        str(work / "runs" / name),
        *sets(*overrides),
        "--overwrite" if leg == 1 else "--resume",
    ]


def amp_args(plan: Plan, work: Path, framework: str, task: str, dtype: str) -> list[str]:
    steps = plan.amp_steps
    overrides = [
        f"framework={framework}",
        f"train.device={plan.device}",
        f"train.amp={dtype}",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"train.checkpoint_every={steps}",
        f"optim.warmup_steps={max(1, steps // 4)}",  # the smoke configs' 20-30 are past the end
        *data_sets(work, task),
        *plan.amp_sets[task],
    ]
    name = f"amp.{framework}.{task}.{dtype}"
    return [
        "--config",
        f"configs/{task}/smoke.yaml",
        "--output-dir",
        str(work / "runs" / name),
        "--overwrite",
        *sets(*overrides),
    ]


def bench_overrides(plan: Plan, work: Path) -> list[str]:
    """single_gpu.yaml as the throughput runs and the synthetic-input run use it."""
    return [
        "framework=torch",
        f"train.device={plan.device}",
        "train.amp=bf16",
        *data_sets(work, "resnet50", val=False),
        f"loader.batch_size={plan.bench_batch}",
        *plan.bench_sets,
    ]


def bench_args(plan: Plan, work: Path, name: str, workers: int) -> list[str]:
    overrides = [
        *bench_overrides(plan, work),
        f"loader.num_workers={workers}",
        f"train.max_steps={plan.bench_steps}",
        f"train.log_every={plan.bench_log_every}",
        f"train.checkpoint_every={plan.bench_steps}",
        f"optim.warmup_steps={plan.bench_steps // 2}",  # base.yaml's 500 is past the end
    ]
    return [
        "--config",
        "configs/resnet50/single_gpu.yaml",
        "--output-dir",
        str(work / "runs" / name),
        "--overwrite",
        *sets(*overrides),
    ]


def all_train_commands(plan: Plan, work: Path) -> dict[str, list[str]]:
    """Every ``python -m train`` command line of ``plan``, by run name."""
    commands = {}
    for framework, task in (("paddle", "ocr"), ("torch", "resnet50")):
        for leg in (1, 2):
            commands[f"smoke.{framework}.{task}.{leg}"] = smoke_args(
                plan, work, framework, task, leg
            )
    for framework in FRAMEWORKS:
        for task in TASKS:
            for dtype in AMP_DTYPES:
                name = f"amp.{framework}.{task}.{dtype}"
                commands[name] = amp_args(plan, work, framework, task, dtype)
    for workers in WORKER_COUNTS:
        name = f"throughput.loader.w{workers}"
        commands[name] = bench_args(plan, work, name, workers)
    commands["throughput.synthetic"] = [
        "--config",
        "configs/resnet50/single_gpu.yaml",
        *sets(*bench_overrides(plan, work)),
    ]
    return commands


# --------------------------------------------------------------------------- reading a run dir
def train_records(run_dir: Path) -> list[dict]:
    records = []
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("type") == "train":
                    records.append(record)
    return records


def latest_checkpoint(run_dir: Path) -> str | None:
    marker = run_dir / "checkpoints" / "latest"
    with contextlib.suppress(OSError):
        name = marker.read_text().strip()
        if (run_dir / "checkpoints" / name / "trainer.json").is_file():
            return name
    return None


def train_log(run_dir: Path) -> str:
    with contextlib.suppress(OSError):
        return (run_dir / "train.log").read_text(encoding="utf-8", errors="replace")
    return ""


_RUN_LINE = re.compile(r"INFO train: run .*?: \w+ \w+ on (.+?), \d+ rank")
_RESUMED = re.compile(r"resumed from (\S+) \(epoch (\d+), step (\d+)\)")
CPU_AMP_WARNING = "but the device is the CPU: training in float32"


def run_device(log: str) -> str | None:
    found = _RUN_LINE.findall(log)
    return found[-1] if found else None


def on_expected_device(plan: Plan, device: str | None) -> bool:
    if device is None:
        return False
    return device.startswith("cpu") != plan.gpu


def window_stats(records: list[dict], skip_first: bool = True) -> dict:
    """samples/s and data-wait share over the logging windows (the first, warm-up one dropped),
    weighted by each window's wall time, as the run's summary does."""
    used = records[1:] if skip_first and len(records) > 1 else records
    wall = wait = samples = 0.0
    previous = records[0]["step"] if skip_first and len(records) > 1 else 0
    for record in used:
        steps = max(1, record["step"] - previous)
        previous = record["step"]
        wall += record["batch_cost_s"] * steps
        wait += record["reader_cost_s"] * steps
        samples += record["samples_per_s"] * record["batch_cost_s"] * steps
    util = [r["gpu_util"] for r in used if "gpu_util" in r]
    return {
        "samples_per_s": samples / wall if wall else None,
        "data_wait_fraction": min(1.0, wait / wall) if wall else None,
        "windows": len(used),
        "gpu_util_mean": sum(util) / len(util) if util else None,
    }


# ---------------------------------------------------------------------------------- set-up
PIP = ["-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", "--no-input"]


def pip_install(
    ctx: Context, name: str, python: str, requirements: list[str], own_index: str | None = None
) -> RunResult:
    """pip install -r each of ``requirements`` -c constraints.txt. With ``own_index``, the one
    paddlepaddle-gpu pin of the first file comes from that index first, alone (--no-deps, one
    retry): everything else still comes from the default index, and an index this machine cannot
    reach fails in seconds instead of stalling every other package's look-up."""
    if own_index:
        pin = framework_pin(requirements[0])
        first = [python, *PIP, "--no-deps", "--index-url", own_index, "--retries", "1"]
        result = ctx.spawn(f"{name}.own-index", [*first, "--timeout", "30", pin], timeout_s=600)
        if not result.ok:
            return result
    cmd = [python, *PIP]
    for req in requirements:
        cmd += ["-r", req]
    cmd += ["-c", "requirements/constraints.txt"]
    return ctx.spawn(name, cmd, timeout_s=max(60.0, ctx.remaining() - 30.0))


def framework_pin(requirements: str) -> str:
    """The paddlepaddle-gpu==... line of a requirements file."""
    for line in (ROOT / requirements).read_text().splitlines():
        if line.strip().startswith("paddlepaddle-gpu=="):
            return line.strip()
    raise RuntimeError(f"{requirements} pins no paddlepaddle-gpu")


def make_venv(ctx: Context, name: str, base_python: str, venv: Path) -> str:
    """A venv at ``venv``; falls back to virtualenv where the host python lacks ensurepip
    (Debian and Ubuntu without python3-venv). Returns its python."""
    python = venv / "bin" / "python"
    if python.exists():
        return str(python)
    result = ctx.spawn(f"{name}.venv", [base_python, "-m", "venv", str(venv)], timeout_s=120)
    if not result.ok:
        shutil.rmtree(venv, ignore_errors=True)
        say(f"{name}: python -m venv failed ({error_text(result.output)}); trying virtualenv")
        probe = ctx.spawn(
            f"{name}.virtualenv-check", [base_python, "-m", "virtualenv", "--version"]
        )
        if not probe.ok:
            user = [
                base_python,
                "-m",
                "pip",
                "install",
                "--user",
                "--disable-pip-version-check",
                "virtualenv",
            ]
            got = ctx.spawn(f"{name}.virtualenv-install", user, timeout_s=180)
            if not got.ok and "externally-managed" in got.output:
                got = ctx.spawn(
                    f"{name}.virtualenv-install2", [*user, "--break-system-packages"], timeout_s=180
                )
            if not got.ok:
                raise RuntimeError(f"cannot make a venv: {result.failure()}; {got.failure()}")
        made = ctx.spawn(
            f"{name}.virtualenv", [base_python, "-m", "virtualenv", str(venv)], timeout_s=180
        )
        if not made.ok:
            raise RuntimeError(f"cannot make a venv: {made.failure()}")
    upgrade = [
        str(python),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--upgrade",
        "pip",
    ]
    ctx.spawn(f"{name}.pip", upgrade, timeout_s=180)  # best effort: an old pip works too
    return str(python)


def requirements_digest(files: list[str], extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for name in [*files, "requirements/common.txt", "requirements/constraints.txt"]:
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


def ensure_installed(
    ctx: Context,
    name: str,
    base_python: str,
    venv: Path,
    requirements: list[str],
    own_index: str | None = None,
) -> tuple[str, dict]:
    """Make ``venv`` and install ``requirements`` unless a stamp says they already are."""
    stamp = venv / ".gpu-check-installed"
    digest = requirements_digest(requirements, own_index or "")
    info = {"venv": str(venv.relative_to(ROOT)) if venv.is_relative_to(ROOT) else str(venv)}
    if stamp.is_file() and stamp.read_text().strip() == digest and (venv / "bin/python").exists():
        info["installed"] = "reused"
        return str(venv / "bin" / "python"), info
    started = time.monotonic()
    python = make_venv(ctx, name, base_python, venv)
    result = pip_install(ctx, f"{name}.install", python, requirements, own_index)
    info["install_s"] = round(time.monotonic() - started, 1)
    if not result.ok:
        info["install_log"] = str(result.log_path)
        raise InstallError(result.failure(), result.output, info)
    stamp.write_text(digest + "\n")
    info["installed"] = "now"
    return python, info


class InstallError(RuntimeError):
    def __init__(self, message: str, output: str, info: dict) -> None:
        super().__init__(message)
        self.output, self.info = output, info


def nvidia_lib_dirs(venv: Path) -> list[Path]:
    """lib folders of NVIDIA's pip wheels (site-packages/nvidia/*/lib) in ``venv``."""
    found = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "nvidia" / "*" / "lib"))
    return sorted(Path(p) for p in found)


def link_cuda_libs(lib_dirs: list[Path], links: Path) -> list[str]:
    """Unversioned names beside the versioned files NVIDIA's wheels ship (libcudnn.so ->
    libcudnn.so.8, ...): Paddle 2.6 dlopens the unversioned ones. Also libcuda.so -> the
    driver's libcuda.so.1 when only that is installed. Returns the names linked."""
    links.mkdir(parents=True, exist_ok=True)
    chosen: dict[str, Path] = {}
    for lib_dir in lib_dirs:
        for path in sorted(lib_dir.glob("lib*.so.*")):
            base = path.name.split(".so.")[0] + ".so"
            if (lib_dir / base).exists():
                continue  # the wheel ships the unversioned name itself
            if base not in chosen or len(path.name) < len(chosen[base].name):
                chosen[base] = path
    driver = driver_libcuda()
    if driver is not None:
        chosen.setdefault("libcuda.so", driver)
    for base, target in chosen.items():
        link = links / base
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return sorted(chosen)


def driver_libcuda() -> Path | None:
    """The driver's libcuda.so.1 when the unversioned libcuda.so is not on the loader's path."""
    try:
        listing = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if re.search(r"^\s*libcuda\.so\s", listing, re.MULTILINE):
        return None
    match = re.search(r"^\s*libcuda\.so\.1\s.*=>\s*(\S+)", listing, re.MULTILINE)
    return Path(match.group(1)) if match else None


def cuda_lib_env(venv: Path, links: Path) -> tuple[dict[str, str], list[str]]:
    """LD_LIBRARY_PATH for a venv whose framework loads CUDA libraries from NVIDIA's wheels."""
    lib_dirs = nvidia_lib_dirs(venv)
    if not lib_dirs:
        return {}, []
    linked = link_cuda_libs(lib_dirs, links)
    path = [str(links), *map(str, lib_dirs)]
    if os.environ.get("LD_LIBRARY_PATH"):
        path.append(os.environ["LD_LIBRARY_PATH"])
    # Lazy module loading (the default from CUDA 12.2 on) makes a CUDA 11.8 build JIT-compile
    # only the kernels it runs when the GPU is newer than the build's binaries.
    # The JIT cache keeps those kernels for the next process (the default 256 MiB is small for
    # Paddle's libraries).
    env = {"LD_LIBRARY_PATH": ":".join(path), "CUDA_MODULE_LOADING": "LAZY"}
    env["CUDA_CACHE_MAXSIZE"] = str(4 << 30)
    return env, linked


def probe(ctx: Context, name: str, framework: str) -> tuple[RunResult, dict]:
    result = ctx.helper(
        name,
        framework,
        ["_probe", "--framework", framework, "--device", ctx.plan.device],
        timeout_s=240,
    )
    return result, result.stats


def probe_failure(result: RunResult, facts: dict) -> str | None:
    if not facts:
        return f"the probe gave no answer ({result.failure()})"
    if not facts.get("ok"):
        return facts.get("error") or "an op failed"
    return None


def setup_torch(ctx: Context) -> dict:
    plan = ctx.plan
    info: dict = {}
    existing = ROOT / ".venv-torch" / "bin" / "python"
    if not plan.gpu:
        if not existing.exists():
            raise RuntimeError(".venv-torch/bin/python is missing: run `make setup` first")
        ctx.python["torch"] = str(existing)
        info.update(venv=".venv-torch", installed="existing (dry-run installs nothing)")
    else:
        # make setup's .venv-torch holds the same torch (PyPI's torch 2.6.0 is the CUDA 12.4
        # build): reuse it when it works on this GPU, else a venv of our own.
        if existing.exists():
            ctx.python["torch"] = str(existing)
            result, facts = probe(ctx, "setup.torch.existing", "torch")
            if probe_failure(result, facts) is None:
                info.update(venv=".venv-torch", installed="existing")
                return _setup_result(info, facts, result)
            failure = probe_failure(result, facts)
            say(f"setup.torch: .venv-torch does not run on this GPU ({failure})")
        reqs = ["requirements/torch.txt", "requirements/remote.txt"]
        try:
            python, got = ensure_installed(
                ctx, "setup.torch", sys.executable, CACHE / "venv-torch", reqs
            )
        except InstallError as error:
            raise SetupError(str(error), {**info, **error.info}) from None
        info.update(got)
        ctx.python["torch"] = python
    result, facts = probe(ctx, "setup.torch", "torch")
    failure = probe_failure(result, facts)
    if failure:
        raise SetupError(
            failure, {**info, **{k: v for k, v in facts.items() if k not in ("ok", "error")}}
        )
    return _setup_result(info, facts, result)


class SetupError(RuntimeError):
    """A set-up failed; ``info`` says how far it got (venv, install time, the probe's facts)."""

    def __init__(self, message: str, info: dict) -> None:
        super().__init__(message)
        self.info = info


def _setup_result(info: dict, facts: dict, result: RunResult) -> dict:
    return {
        "status": "ok",
        **info,
        **{k: v for k, v in facts.items() if k != "ok"},
        "elapsed_s": round(result.elapsed_s, 1),
    }


def paddle_python() -> str:
    """Python 3.10 when the host has one that runs (the Paddle image's), else this interpreter.
    pyenv's shims exist for versions that are not selected, so each candidate is tried."""
    candidates = [shutil.which("python3.10")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10.*/bin/python3.10")))
    for candidate in filter(None, candidates):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            found = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if found.stdout.strip() == "True":
                return candidate
    return sys.executable


def cu12_note(output: str) -> str | None:
    markers = (
        "NameResolutionError",
        "Failed to resolve",
        "Connection refused",
        "No matching distribution",
        "Could not find a version",
        "Could not fetch URL",
        "Failed to establish",
        "Name or service not known",
        "Temporary failure in name",
        "timed out",
        "ProxyError",
        "SSLError",
        "Network is unreachable",
    )
    hit = next((m for m in markers if m in output), None)
    if hit is None:
        return None
    return (
        f"Paddle 2.6's CUDA 12 build (paddlepaddle-gpu==2.6.2.post120) is published only on "
        f"Paddle's own package index ({cu12_index()}), not on the default index, and this "
        f"machine could not get it from there ({hit}). Point GPU_CHECK_PADDLE_CU12_INDEX at a "
        "mirror, or use the CUDA 12 image (README: PADDLE_BASE_IMAGE)."
    )


def cu12_index() -> str:
    return os.environ.get("GPU_CHECK_PADDLE_CU12_INDEX", PADDLE_CU12_INDEX)


def setup_paddle(ctx: Context, build_info: dict) -> dict:
    """Dry-run: .venv-paddle (the CPU build). GPU: the CUDA 11.8 build from the default index;
    when it cannot run the probe's ops on this GPU, the CUDA 12.0 build from Paddle's index."""
    plan = ctx.plan
    if not plan.gpu:
        existing = ROOT / ".venv-paddle" / "bin" / "python"
        if not existing.exists():
            raise RuntimeError(".venv-paddle/bin/python is missing: run `make setup` first")
        ctx.python["paddle"] = str(existing)
        # The GPU mode's library links, made here from the torch venv's NVIDIA wheels into the
        # work folder, so that code runs too (the CPU build loads none of them).
        env, linked = cuda_lib_env(ROOT / ".venv-torch", ctx.work / "cuda-libs")
        ctx.env["paddle"] = {k: v for k, v in env.items() if k == "CUDA_MODULE_LOADING"}
        result, facts = probe(ctx, "setup.paddle", "paddle")
        attempt = {
            "build": "existing .venv-paddle",
            "status": "ok",
            "cuda_libs_linked": len(linked),
        }
        failure = probe_failure(result, facts)
        if failure:
            attempt.update(status="error", error=failure)
        build_info["attempts"].append(attempt)
        if failure:
            raise RuntimeError(failure)
        build_info.update(
            ran=f"paddlepaddle {facts.get('version')} (CPU build, dry-run)", **_build_facts(facts)
        )
        return _setup_result(
            {"venv": ".venv-paddle", "installed": "existing (dry-run)"}, facts, result
        )
    order = os.environ.get("GPU_CHECK_PADDLE_BUILDS", "cu118,cu120").split(",")
    failures = []
    for build in [b.strip() for b in order if b.strip()]:
        if build not in PADDLE_BUILDS:
            failures.append(
                f"{build}: unknown (GPU_CHECK_PADDLE_BUILDS takes {list(PADDLE_BUILDS)})"
            )
            continue
        requirements, index_kind, label = PADDLE_BUILDS[build]
        attempt: dict = {
            "build": build,
            "package": label,
            "source": cu12_index() if index_kind else "default package index",
        }
        build_info["attempts"].append(attempt)
        venv = CACHE / f"venv-paddle-{build}"
        name = f"setup.paddle.{build}"
        try:
            python, got = ensure_installed(
                ctx,
                name,
                paddle_python(),
                venv,
                [requirements, "requirements/remote.txt"],
                cu12_index() if index_kind else None,
            )
        except InstallError as error:
            attempt.update(status="error", error=str(error), **error.info)
            note = cu12_note(error.output) if index_kind else None
            if note:
                attempt["note"] = note
                build_info["note"] = note
            failures.append(f"{build}: install failed: {error}")
            continue
        attempt.update(got)
        env, linked = cuda_lib_env(venv, venv / "cuda-libs")
        attempt["cuda_libs_linked"] = len(linked)
        ctx.python["paddle"], ctx.env["paddle"] = python, env
        result, facts = probe(ctx, name, "paddle")
        failure = probe_failure(result, facts)
        attempt.update({k: facts[k] for k in ("version", "cuda", "cudnn", "ops") if k in facts})
        if failure is None:
            attempt["status"] = "ok"
            build_info.update(ran=f"{label} ({build})", **_build_facts(facts))
            if failures:
                build_info["note"] = f"fell back to the {build} build: " + "; ".join(failures)
            return _setup_result(dict(got), facts, result)
        attempt.update(status="error", error=failure)
        failures.append(f"{build}: {failure}")
        say(f"{name}: cannot run GPU ops ({failure})")
    ctx.python["paddle"] = None
    raise RuntimeError("no Paddle build ran a GPU op here: " + "; ".join(failures))


BUILD_FACTS = (
    "version",
    "compiled_with_cuda",
    "cuda",
    "cudnn",
    "cudnn_runtime",
    "device_name",
    "capability",
)


def _build_facts(facts: dict) -> dict:
    return {k: facts.get(k) for k in BUILD_FACTS}


# ---------------------------------------------------------------------------------- checks
def check_configs(ctx: Context) -> dict:
    """Every training command of BOTH plans, the GPU one included, through the project's own
    config loader: a GPU-plan command that no longer fits the configs fails here, in the
    dry-run that make test runs, not first on the GPU."""
    commands = {
        f"{label}:{name}": args
        for label, plan in (("gpu", GPU_PLAN), ("dry-run", DRY_PLAN))
        for name, args in all_train_commands(plan, ctx.work).items()
    }
    path = ctx.work / "stats" / "configs.commands.json"
    path.write_text(json.dumps(commands))
    run = ctx.helper("configs", "torch", ["_configs", "--commands", str(path)], timeout_s=120)
    if not run.ok or not run.stats:
        return failed(run)
    errors = run.stats.get("errors", {})
    result = {"validated": run.stats.get("validated"), "plans": ["gpu", "dry-run"]}
    if errors:
        return {"status": "error", **result, "errors": errors, "error": next(iter(errors.values()))}
    return {"status": "ok", **result, "elapsed_s": round(run.elapsed_s, 1)}


def check_data(ctx: Context) -> dict:
    plan = ctx.plan
    args = [
        "_data",
        "--out",
        str(ctx.work / "data"),
        "--ocr-lines",
        str(plan.ocr_lines),
        "--images-train",
        str(plan.images_train),
        "--images-val",
        str(plan.images_val),
        "--classes",
        str(plan.classes),
    ]
    result = ctx.helper("data", "torch", args, timeout_s=300)
    if not result.ok or not result.stats:
        return {"status": "error", "error": result.failure(), "log": str(result.log_path)}
    return {"status": "ok", **result.stats, "elapsed_s": round(result.elapsed_s, 1)}


def peak(*results: RunResult) -> float | None:
    values = [r.stats.get("peak_mem_mb") for r in results]
    values = [v for v in values if isinstance(v, (int, float))]
    return round(max(values), 1) if values else None


def failed(result: RunResult, **fields) -> dict:
    return {
        "status": "error",
        "error": result.failure(),
        "log": str(result.log_path),
        "log_tail": tail(result.output),
        **fields,
    }


def check_smoke(ctx: Context, framework: str, task: str) -> dict:
    """The task's smoke config on the device: loss falls, checkpoints, --resume continues."""
    plan = ctx.plan
    name = f"smoke.{framework}.{task}"
    run_dir = ctx.work / "runs" / name
    first, total = plan.smoke_steps
    one = ctx.train(f"{name}.1", framework, smoke_args(plan, ctx.work, framework, task, 1))
    if not one.ok:
        return failed(one, leg="first run")
    checkpoint_first = latest_checkpoint(run_dir)
    records_first = len(train_records(run_dir))
    two = ctx.train(f"{name}.2", framework, smoke_args(plan, ctx.work, framework, task, 2))
    if not two.ok:
        return failed(two, leg="--resume", checkpoint_first=checkpoint_first)
    records = train_records(run_dir)  # metrics.jsonl: the first run's records, then the resumed
    resumed_records = records[records_first:]
    log = train_log(run_dir)
    resumed = _RESUMED.findall(log)  # train.log's "resumed from ..." line, when it says so
    resumed_step = int(resumed[-1][2]) if resumed else None
    after = [r["step"] for r in resumed_records]
    summary = read_json(run_dir / "summary.json")
    device = run_device(log) or two.stats.get("device")
    losses = [r["loss"] for r in records]
    third = max(1, len(losses) // 3)  # mean of the first and the last third of the windows
    loss_first = sum(losses[:third]) / third if losses else None
    loss_last = sum(losses[-third:]) / third if losses else None
    result = {
        "device": device,
        "steps": [first, total],
        "checkpoint_first": checkpoint_first,
        "checkpoint_final": latest_checkpoint(run_dir),
        "resumed_from_step": resumed_step,
        "first_step_after_resume": after[0] if after else None,
        "final_step": summary.get("steps"),
        "loss_first": rounded(loss_first),
        "loss_last": rounded(loss_last),
        "loss_fell": bool(losses) and loss_last < loss_first,
        "samples_per_s": rounded(summary.get("samples_per_s"), 1),
        "data_wait_fraction": rounded(summary.get("data_wait_fraction")),
        **{k: rounded(v) for k, v in summary.items() if k.startswith("val_")},
        "peak_mem_mb": peak(one, two),
        "elapsed_s": round(one.elapsed_s + two.elapsed_s, 1),
    }
    problems = []
    if not on_expected_device(plan, device):
        problems.append(f"trained on {device}, expected {plan.device}")
    if checkpoint_first != f"step-{first:08d}":
        problems.append(f"after the first run the latest checkpoint is {checkpoint_first}")
    if not after or after[0] <= first or (resumed_step is not None and resumed_step != first):
        started = resumed_step if resumed_step is not None else after[:1]
        problems.append(f"--resume did not continue from step {first} (from {started})")
    if result["checkpoint_final"] != f"step-{total:08d}" or summary.get("steps") != total:
        problems.append(f"the resumed run ended at {summary.get('steps')}, expected {total}")
    if not result["loss_fell"]:
        problems.append(f"loss did not fall: {result['loss_first']} -> {result['loss_last']}")
    return {
        "status": "error" if problems else "ok",
        **result,
        **({"error": "; ".join(problems)} if problems else {}),
    }


def check_amp(ctx: Context, framework: str, task: str, dtype: str) -> dict:
    """A few steps (and an evaluation) with train.amp=fp16|bf16. On the CPU the backends train in
    float32 (and say so: ``float32_warning``), so the dry-run checks the run, not AMP."""
    plan = ctx.plan
    name = f"amp.{framework}.{task}.{dtype}"
    run_dir = ctx.work / "runs" / name
    steps = plan.amp_steps
    run = ctx.train(name, framework, amp_args(plan, ctx.work, framework, task, dtype))
    if not run.ok:
        return failed(run)
    log = train_log(run_dir)
    records = train_records(run_dir)
    summary = read_json(run_dir / "summary.json")
    losses = [r["loss"] for r in records]
    device = run_device(log) or run.stats.get("device")
    amp_active = on_expected_device(plan, device) and plan.gpu and CPU_AMP_WARNING not in log
    result = {
        "device": device,
        "amp_active": amp_active,
        "float32_warning": CPU_AMP_WARNING in log,
        "steps": summary.get("steps"),
        "losses": [rounded(x) for x in losses],
        "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
        **{k: rounded(v) for k, v in summary.items() if k.startswith("val_")},
        "peak_mem_mb": peak(run),
        "elapsed_s": round(run.elapsed_s, 1),
    }
    problems = []
    if not on_expected_device(plan, device):
        problems.append(f"trained on {device}, expected {plan.device}")
    if summary.get("steps") != steps:
        problems.append(f"ran {summary.get('steps')} steps, expected {steps}")
    if not result["loss_finite"]:
        problems.append(f"loss not finite: {result['losses']}")
    if plan.gpu and not amp_active:
        problems.append("AMP was not active on the GPU")
    return {
        "status": "error" if problems else "ok",
        **result,
        **({"error": "; ".join(problems)} if problems else {}),
    }


def check_loader(ctx: Context, workers: int, no_prefetch: bool = False) -> dict:
    """single_gpu.yaml (ResNet-50, bf16, prefetch 4, persistent workers) fed by our loader."""
    name = "prefetcher.off" if no_prefetch else f"throughput.loader.w{workers}"
    run_dir = ctx.work / "runs" / name
    args = bench_args(ctx.plan, ctx.work, name, workers)
    run = ctx.train(name, "torch", args, no_prefetch=no_prefetch)
    if not run.ok:
        return failed(run, workers=workers)
    records = train_records(run_dir)
    device = run_device(train_log(run_dir)) or run.stats.get("device")
    stats = window_stats(records)
    result = {
        "device": device,
        "workers": workers,
        "batch": ctx.plan.bench_batch,
        "steps": records[-1]["step"] if records else None,
        **{k: rounded(v, 1 if k.endswith("_per_s") else 4) for k, v in stats.items()},
        "peak_mem_mb": peak(run),
        "elapsed_s": round(run.elapsed_s, 1),
    }
    problems = []
    if not on_expected_device(ctx.plan, device):
        problems.append(f"ran on {device}, expected {ctx.plan.device}")
    if not stats["samples_per_s"]:
        problems.append("no logging window to measure")
    if no_prefetch and not run.stats.get("prefetch_patched"):
        problems.append("the prefetcher could not be switched off")
    return {
        "status": "error" if problems else "ok",
        **result,
        **({"error": "; ".join(problems)} if problems else {}),
    }


def check_synthetic(ctx: Context) -> dict:
    """ResNet-50 steps through the torch backend on random device tensors: no loader at all."""
    plan = ctx.plan
    warmup, steps = plan.synthetic_steps
    overrides = bench_overrides(plan, ctx.work)
    args = [
        "_synthetic",
        "--config",
        "configs/resnet50/single_gpu.yaml",
        "--classes",
        str(plan.classes),
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
        *sets(*overrides),
    ]
    run = ctx.helper("throughput.synthetic", "torch", args, stats=True)
    if not run.ok or not run.stats.get("images_per_s"):
        return failed(run)
    device = run.stats.get("device")
    problems = [] if on_expected_device(plan, device) else [f"ran on {device}"]
    return {
        "status": "error" if problems else "ok",
        **{k: rounded(v, 1) for k, v in run.stats.items()},
        "elapsed_s": round(run.elapsed_s, 1),
        **({"error": "; ".join(problems)} if problems else {}),
    }


PREFETCH_NOTE = (
    "train/backends/torch has no knob for the side-stream prefetcher: on CUDA, "
    "TorchBackend.device_batches always copies and normalizes the next batch on a side stream "
    "(_cuda_prefetch). 'off' is the same training run with device_batches replaced, in the check's "
    "own process, by the per-batch copy the CPU path uses (_to_device on the compute stream). "
    "On the CPU the prefetcher never runs, so both runs take the same path there."
)


# ------------------------------------------------------------------------------ orchestration
def skeleton(plan: Plan, work: Path) -> dict:
    return {
        "schema": SCHEMA,
        "mode": "gpu" if plan.gpu else "dry-run",
        "ok": False,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": None,
        "budget_s": None,
        "work_dir": str(work),
        "host": {},
        "torch_build": {},
        "paddle_build": {
            "ran": None,
            **dict.fromkeys(BUILD_FACTS),
            "attempts": [],
            "cu12_source": f"{cu12_index()} (Paddle's own package index)",
            "note": None,
        },
        "checks": {name: {"status": "skipped", "reason": "not reached"} for name in check_names()},
        "summary": {},
        "script_error": None,
    }


def host_facts(plan: Plan) -> dict:
    facts: dict = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "gpu": None,
        "driver": None,
        "cuda_driver": None,
        "compute_capability": None,
        "gpu_memory_mib": None,
    }
    with contextlib.suppress(OSError):
        stat = os.statvfs("/dev/shm")
        facts["dev_shm_gib"] = round(stat.f_blocks * stat.f_frsize / 2**30, 1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        facts["nvidia_smi"] = "not found" if plan.gpu else "not found (dry-run)"
        return facts
    query = [
        smi,
        "--query-gpu=name,driver_version,compute_cap,memory.total",
        "--format=csv,noheader,nounits",
    ]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
        first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        parts = [p.strip() for p in first.split(",")]
        if len(parts) >= 4:
            facts.update(
                gpu=parts[0], driver=parts[1], compute_capability=parts[2], gpu_memory_mib=parts[3]
            )
        banner = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
        match = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        facts["cuda_driver"] = match.group(1) if match else None
        facts["gpus_visible"] = len(out.stdout.strip().splitlines())
    except (OSError, subprocess.SubprocessError, IndexError) as error:
        facts["nvidia_smi"] = f"failed: {error}"
    return facts


def run_check(report: dict, ctx: Context, name: str, func, *args) -> dict:
    """Run one check; whatever it raises becomes its error, and past the budget it is skipped."""
    say(f"{name}: start")
    try:
        result = func(ctx, *args)
    except OutOfTime as error:
        result = {"status": "skipped", "reason": str(error)}
    except Exception as error:  # a check's failure must not stop the others
        result = {
            "status": "error",
            "error": f"{type(error).__name__}: {error}",
            "traceback": tail(traceback.format_exc(), 8),
        }
    report["checks"][name] = result
    say(
        f"{name}: {result['status']}" + (f" ({result.get('error')})" if result.get("error") else "")
    )
    return result


def blocked(report: dict, names: list[str], reason: str) -> None:
    for name in names:
        report["checks"][name] = {"status": "error", "error": reason}


def summarize(report: dict) -> None:
    checks = report["checks"]
    synthetic = checks["throughput.synthetic"].get("images_per_s")
    loader = {}
    for workers in WORKER_COUNTS:
        check = checks[f"throughput.loader.w{workers}"]
        rate = check.get("samples_per_s")
        if synthetic and rate:
            check["vs_synthetic"] = round(rate / synthetic, 3)
        loader[str(workers)] = {
            k: check.get(k)
            for k in ("samples_per_s", "data_wait_fraction", "vs_synthetic", "status")
        }
    on, off = checks["prefetcher.on"], checks["prefetcher.off"]
    gain = None
    if on.get("samples_per_s") and off.get("samples_per_s"):
        gain = round(on["samples_per_s"] / off["samples_per_s"], 3)
    memory: dict = {"torch": None, "paddle": None, "by_check": {}}
    for name, check in checks.items():
        value = check.get("peak_mem_mb")
        if isinstance(value, (int, float)):
            memory["by_check"][name] = value
            framework = (
                "torch"
                if ".torch." in name or name.startswith(("throughput", "prefetch"))
                else "paddle"
                if ".paddle." in name
                else None
            )
            if framework and (memory[framework] is None or value > memory[framework]):
                memory[framework] = value
    statuses = {name: check["status"] for name, check in checks.items()}
    report["summary"] = {
        "images_per_s": {"synthetic": synthetic, "loader": loader},
        "prefetcher": {
            "knob": None,
            "on": on.get("samples_per_s"),
            "off": off.get("samples_per_s"),
            "on_over_off": gain,
            "engaged": report["mode"] == "gpu",
            "note": PREFETCH_NOTE,
        },
        "peak_gpu_memory_mb": memory,
        "paddle_build": report["paddle_build"].get("ran"),
        "failed": [n for n, s in statuses.items() if s == "error"],
        "skipped": [n for n, s in statuses.items() if s == "skipped"],
    }
    report["ok"] = all(s == "ok" for s in statuses.values())


def orchestrate(report: dict, ctx: Context) -> None:
    plan = ctx.plan
    report["host"] = host_facts(plan)
    try:
        torch_result = setup_torch(ctx)
    except OutOfTime as error:
        torch_result = {"status": "skipped", "reason": str(error)}
    except SetupError as error:
        torch_result = {**error.info, "status": "error", "error": str(error)}
    except Exception as error:
        torch_result = {"status": "error", "error": str(error)}
    report["checks"]["setup.torch"] = torch_result
    report["torch_build"] = {
        k: torch_result.get(k)
        for k in ("version", "cuda", "cudnn_runtime", "device_name", "capability", "venv")
    }
    say(f"setup.torch: {torch_result['status']} {torch_result.get('error', '')}")
    if torch_result["status"] != "ok":
        ctx.python["torch"] = None
        ctx.setup_error["torch"] = torch_result.get("error") or torch_result.get("reason", "")
    try:
        paddle_result = setup_paddle(ctx, report["paddle_build"])
    except OutOfTime as error:
        paddle_result = {"status": "skipped", "reason": str(error)}
    except Exception as error:
        paddle_result = {"status": "error", "error": str(error)}
    report["checks"]["setup.paddle"] = paddle_result
    say(f"setup.paddle: {paddle_result['status']} {paddle_result.get('error', '')}")
    if paddle_result["status"] != "ok":
        ctx.python["paddle"] = None
        ctx.setup_error["paddle"] = paddle_result.get("error") or paddle_result.get("reason", "")

    if ctx.python["torch"] is None:  # the data and every torch check need the torch venv
        reason = f"setup.torch failed: {ctx.setup_error['torch']}"
        blocked(report, [n for n in check_names()[2:] if ".paddle." not in n], reason)
        blocked(
            report,
            [n for n in check_names() if ".paddle." in n],
            f"no data (the data check runs in the torch venv): {reason}",
        )
        return
    run_check(report, ctx, "configs", check_configs)
    if run_check(report, ctx, "data", check_data)["status"] != "ok":
        names = check_names()
        blocked(report, names[names.index("data") + 1 :], "no data: the data check failed")
        return
    if ctx.python["paddle"] is None:
        blocked(
            report,
            [n for n in check_names() if ".paddle." in n],
            f"setup.paddle failed: {ctx.setup_error['paddle']}",
        )

    # Phase A: smoke and AMP runs, several at once (each is small; none is timed).
    jobs: list[tuple] = []
    for framework, task in (("paddle", "ocr"), ("torch", "resnet50")):
        if ctx.python[framework]:
            jobs.append((f"smoke.{framework}.{task}", check_smoke, framework, task))
    for framework in FRAMEWORKS:
        if ctx.python[framework]:
            for task in TASKS:
                for dtype in AMP_DTYPES:
                    jobs.append(
                        (f"amp.{framework}.{task}.{dtype}", check_amp, framework, task, dtype)
                    )
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=plan.jobs)
    try:
        futures = [
            pool.submit(run_check, report, ctx, name, func, *args) for name, func, *args in jobs
        ]
        for future in futures:
            future.result()
    except BaseException:
        ctx.stop()  # Ctrl-C or SIGTERM: end the running checks, so the pool can close
        raise
    finally:
        pool.shutdown(wait=True)

    # Phase B: throughput, one run at a time, nothing else on the GPU or the CPUs.
    run_check(report, ctx, "throughput.synthetic", check_synthetic)
    for workers in WORKER_COUNTS:
        run_check(report, ctx, f"throughput.loader.w{workers}", check_loader, workers)
    widest = report["checks"][f"throughput.loader.w{WORKER_COUNTS[-1]}"]
    report["checks"]["prefetcher.on"] = {
        **{
            k: widest.get(k)
            for k in (
                "status",
                "samples_per_s",
                "data_wait_fraction",
                "workers",
                "device",
                "error",
                "reason",
            )
            if k in widest
        },
        "engaged": plan.gpu,
        "run": f"throughput.loader.w{WORKER_COUNTS[-1]}",
    }
    off = run_check(report, ctx, "prefetcher.off", check_loader, WORKER_COUNTS[-1], True)
    off["engaged"] = False


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_check.sh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the same checks on the CPU with tiny step counts, using the "
        "existing .venv-torch and .venv-paddle (no installs)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="data, runs and logs (default: runs/gpu-check; dry-run: a temporary "
        "folder, removed when every check passed)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the dry-run's work folder")
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", plan.budget_s))
    temporary = args.work_dir is None and args.dry_run
    if args.work_dir is not None:
        work = args.work_dir.resolve()
    elif args.dry_run:
        work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    else:
        work = ROOT / "runs" / "gpu-check"
    if work.exists() and not temporary:
        for sub in ("logs", "stats", "runs"):  # the data is reused; results start over
            shutil.rmtree(work / sub, ignore_errors=True)
    report = skeleton(plan, work)
    report["budget_s"] = budget
    code = 0
    ctx = None
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        ctx = Context(plan, work, budget)
        orchestrate(report, ctx)
        summarize(report)
        if report["summary"]["skipped"]:
            code = 3
    except KeyboardInterrupt:
        report["script_error"] = "interrupted (SIGINT or SIGTERM)"
        code = 130
        with contextlib.suppress(Exception):
            summarize(report)
    except Exception:
        report["script_error"] = traceback.format_exc()
        code = 1
    finally:
        if ctx is not None:
            ctx.stop()
    report["elapsed_s"] = round(time.monotonic() - _START, 1)
    if temporary and report["ok"] and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        report["work_dir"] = None
    print(json.dumps(clean(report), indent=2, allow_nan=False), flush=True)
    summary = report["summary"]
    say(
        f"done in {report['elapsed_s']} s: ok={report['ok']}, failed={summary.get('failed')}, "
        f"skipped={summary.get('skipped')}"
    )
    return code


# ======================================================================== helpers (in a venv)
def _project_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)


def _emit(payload: dict) -> None:
    print(MARK + json.dumps(payload, default=str), flush=True)


def _short(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if "rror" in x), lines[-1] if lines else "")
    return f"{type(error).__name__}: {line}"[:600]


def helper_probe(args: argparse.Namespace) -> int:
    """The framework build and a few ops on the device: elementwise, matmul (cuBLAS), conv2d
    (cuDNN), LSTM and CTC loss (what the CRNN uses). One JSON line."""
    facts: dict = {"framework": args.framework, "device": args.device}
    ops: dict[str, str] = {}
    try:
        if args.framework == "torch":
            import torch

            facts.update(
                version=torch.__version__,
                cuda=torch.version.cuda,
                compiled_with_cuda=torch.version.cuda is not None,
                cudnn_runtime=torch.backends.cudnn.version(),
            )
            if args.device == "gpu":
                if not torch.cuda.is_available():
                    raise RuntimeError("torch.cuda.is_available() is False")
                device = torch.device("cuda", 0)
                facts.update(
                    device_name=torch.cuda.get_device_name(0),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    arch_list=torch.cuda.get_arch_list(),
                )
            else:
                device = torch.device("cpu")
            ops = _torch_ops(torch, device)
        else:
            import paddle

            compiled = bool(paddle.is_compiled_with_cuda())
            facts.update(
                version=paddle.__version__,
                compiled_with_cuda=compiled,
                cuda=paddle.version.cuda() if compiled else None,
                cudnn=paddle.version.cudnn() if compiled else None,
            )
            if args.device == "gpu":
                if not compiled:
                    raise RuntimeError("this is Paddle's CPU build")
                count = paddle.device.cuda.device_count()
                if count == 0:
                    raise RuntimeError(
                        "Paddle sees no GPU (paddle.device.cuda.device_count() == 0)"
                    )
                paddle.set_device("gpu:0")
                facts.update(
                    device_name=paddle.device.cuda.get_device_name(0),
                    capability=".".join(map(str, paddle.device.cuda.get_device_capability(0))),
                    cudnn_runtime=paddle.get_cudnn_version(),
                )
            else:
                paddle.set_device("cpu")
            ops = _paddle_ops(paddle)
    except BaseException as error:  # noqa: BLE001  (report, whatever it is)
        facts.update(ok=False, error=_short(error), ops=ops)
        _emit(facts)
        return 0
    bad = {name: result for name, result in ops.items() if result != "ok"}
    facts.update(ok=not bad, ops=ops)
    if bad:
        facts["error"] = "; ".join(f"{name}: {result}" for name, result in bad.items())
    _emit(facts)
    return 0


def _run_ops(ops) -> dict[str, str]:
    results = {}
    for name, op in ops:
        try:
            op()
            results[name] = "ok"
        except Exception as error:  # each op on its own: the first failure names the library
            results[name] = _short(error)
    return results


def _torch_ops(torch, device) -> dict[str, str]:
    import torch.nn.functional as F

    def elementwise():
        value = float((torch.arange(4.0, device=device) * 2).sum())  # float() waits
        assert value == 12.0, value

    def matmul():
        a = torch.randn(64, 64, device=device)
        float((a @ a).sum())

    def conv2d():
        conv = torch.nn.Conv2d(3, 8, 3).to(device)
        float(conv(torch.randn(2, 3, 16, 16, device=device)).sum())

    def lstm():
        net = torch.nn.LSTM(8, 8, bidirectional=True).to(device)
        float(net(torch.randn(5, 2, 8, device=device))[0].sum())

    def ctc():
        log_probs = torch.randn(10, 2, 5, device=device).log_softmax(2)
        targets = torch.tensor([[1, 2], [3, 4]], device=device)
        lengths = torch.full((2,), 10, dtype=torch.long, device=device)
        float(F.ctc_loss(log_probs, targets, lengths, torch.tensor([2, 2], device=device)))

    return _run_ops(
        [
            ("elementwise", elementwise),
            ("matmul", matmul),
            ("conv2d", conv2d),
            ("lstm", lstm),
            ("ctc_loss", ctc),
        ]
    )


def _paddle_ops(paddle) -> dict[str, str]:
    import paddle.nn.functional as F

    def elementwise():
        value = float((paddle.arange(4, dtype="float32") * 2).sum())
        assert value == 12.0, value

    def matmul():
        a = paddle.randn([64, 64])
        float(paddle.matmul(a, a).sum())

    def conv2d():
        conv = paddle.nn.Conv2D(3, 8, 3)
        float(conv(paddle.randn([2, 3, 16, 16])).sum())

    def lstm():
        net = paddle.nn.LSTM(8, 8, direction="bidirect")
        float(net(paddle.randn([2, 5, 8]))[0].sum())

    def ctc():
        logits = paddle.randn([10, 2, 5])
        labels = paddle.to_tensor([[1, 2], [3, 4]], dtype="int32")
        loss = F.ctc_loss(
            logits,
            labels,
            paddle.full([2], 10, dtype="int64"),
            paddle.full([2], 2, dtype="int64"),
            blank=0,
            reduction="mean",
        )
        float(loss)

    return _run_ops(
        [
            ("elementwise", elementwise),
            ("matmul", matmul),
            ("conv2d", conv2d),
            ("lstm", lstm),
            ("ctc_loss", ctc),
        ]
    )


def helper_configs(args: argparse.Namespace) -> int:
    """load_config() on the --config and --set items of each command line: the errors, by name."""
    from train.config import load_config

    commands = json.loads(Path(args.commands).read_text())
    errors = {}
    for name, argv in commands.items():
        config = argv[argv.index("--config") + 1]
        overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        try:
            load_config(config, overrides)
        except Exception as error:  # ConfigError, or whatever else the loader raises
            errors[name] = (
                _short(error) if not str(error).startswith("config error") else str(error)
            )
    _emit({"validated": len(commands), "errors": errors})
    return 0


def _imagenet_chunk(job: tuple[int, int, int]) -> list[tuple[bytes, int]]:
    from datasets.synthetic import imagenet_samples

    count, classes, seed = job
    return list(imagenet_samples(count, classes, seed))


def helper_data(args: argparse.Namespace) -> int:
    """Digit lines for the OCR (as make train-ocr) and ImageNet-like JPEGs, written with the
    project's writers; the images are drawn in parallel (one chunk per seed)."""
    import multiprocessing

    from datasets.hdf5_images import Hdf5ImageWriter
    from datasets.lmdb_ocr import LmdbOcrWriter
    from datasets.synthetic import ocr_charset, ocr_samples, write_all

    started = time.perf_counter()
    out = Path(args.out)
    charset, font = ocr_charset("digits")
    ocr = out / "ocr"
    ocr.mkdir(parents=True, exist_ok=True)
    (ocr / "charset.txt").write_text("".join(c + "\n" for c in charset), encoding="utf-8")
    val_lines = max(8, args.ocr_lines // 10)
    for split, count, seed in (("train", args.ocr_lines - val_lines, 0), ("val", val_lines, 1)):
        samples = ocr_samples(count, charset, font, seed, max_len=6)
        write_all(LmdbOcrWriter(ocr / split, overwrite=True), samples)
    names = [f"class_{i:04d}" for i in range(args.classes)]
    chunk = 32
    processes = max(1, min(8, (os.cpu_count() or 1)))
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for split, count, seed in (
            ("train", args.images_train, 0),
            ("val", args.images_val, 1_000_003),
        ):
            jobs = [
                (min(chunk, count - start), args.classes, seed + start)
                for start in range(0, count, chunk)
            ]
            writer = Hdf5ImageWriter(out / "imagenet" / f"{split}.h5", names, overwrite=True)
            rows = (sample for part in pool.imap(_imagenet_chunk, jobs) for sample in part)
            write_all(
                writer,
                ((image, label, f"{split}-{i:06d}.jpg") for i, (image, label) in enumerate(rows)),
            )
    _emit(
        {
            "ocr_lines": args.ocr_lines,
            "images_train": args.images_train,
            "images_val": args.images_val,
            "classes": args.classes,
            "seconds": round(time.perf_counter() - started, 1),
        }
    )
    return 0


def _peak_memory_mb() -> tuple[str, float | None]:
    """The framework's device and its peak allocated device memory in this process (MiB)."""
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            return f"cuda:{torch.cuda.current_device()}", torch.cuda.max_memory_allocated() / 2**20
        return "cpu", None
    if "paddle" in sys.modules:
        import paddle

        device = paddle.device.get_device()
        if device.startswith("gpu"):
            return device, paddle.device.cuda.max_memory_allocated() / 2**20
        return device, None
    return "none", None


def _without_prefetch() -> None:
    """TorchBackend.device_batches without the side stream: the CPU path's per-batch copy."""
    from train.backends.torch import backend as torch_backend

    cls = torch_backend.TorchBackend
    if not hasattr(cls, "_to_device"):
        raise RuntimeError("TorchBackend has no _to_device: cannot switch the prefetcher off")

    def device_batches_without_prefetch(self, loader):
        return (self._to_device(batch) for batch in loader)

    cls.device_batches = device_batches_without_prefetch


def helper_train(args: argparse.Namespace) -> int:
    """``python -m train ARGS`` in this process (runpy, as -m does), then the peak device memory
    into the stats file."""
    import runpy

    _project_path()
    stats: dict = {"prefetch_patched": False}
    code: int | str | None = 0
    try:
        if args.no_prefetch:
            _without_prefetch()
            stats["prefetch_patched"] = True
        sys.argv = ["python -m train", *args.train_args]
        runpy.run_module("train", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException as error:
        stats["error"] = _short(error)
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            stats["device"], stats["peak_mem_mb"] = _peak_memory_mb()
        stats["exit"] = code
        Path(args.stats).write_text(json.dumps(stats, default=str))
    if isinstance(code, str):
        print(code, file=sys.stderr)
        return 1
    return int(code or 0)


def _make_backend(config):
    """train/backends' make_backend, wherever this checkout keeps it."""
    try:
        from train.backends import make_backend
    except ImportError:  # before train/backends/__init__.py registered the backends
        from train.backends.base import make_backend
    return make_backend(config)


def _build(backend, config, num_classes: int, total_steps: int) -> None:
    """Backend.build for either form of the contract: build(model, optim, input_shape,
    num_classes, total_steps) or the older build(num_classes, total_steps)."""
    import inspect

    if "optim" in inspect.signature(backend.build).parameters:
        shape = (3, config.data.image_size, config.data.image_size)  # the ResNet task's input
        backend.build(config.model, config.optim, shape, num_classes, total_steps)
    else:
        backend.build(num_classes, total_steps)


def helper_synthetic(args: argparse.Namespace) -> int:
    """The torch backend's own build() and train_step() on random device tensors (NCHW,
    channels-last on CUDA, as its device_batches hands them over): the images/s with no loader."""
    _project_path()
    import torch

    from train.config import load_config

    config = load_config(args.config, args.overrides)
    backend = _make_backend(config)
    backend.init_distributed()
    if not backend.uses_gpu:
        # The CPU number is no measurement (the dry-run's); one thread keeps it from spinning
        # against the other processes on a small host.
        torch.set_num_threads(1)
    backend.seed_everything(config.seed, config.deterministic)
    _build(backend, config, args.classes, args.warmup + args.steps)
    device = torch.device("cuda", torch.cuda.current_device()) if backend.uses_gpu else "cpu"
    size, batch_size = config.data.image_size, config.loader.batch_size
    images = torch.randn(batch_size, 3, size, size, device=device)
    if backend.uses_gpu:
        images = images.contiguous(memory_format=torch.channels_last)
    batch = {"image": images, "label": torch.randint(0, args.classes, (batch_size,), device=device)}
    for _ in range(args.warmup):
        loss = backend.train_step(batch)
    backend.to_float(loss)
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = backend.train_step(batch)
    final = backend.to_float(loss)
    backend.synchronize()
    elapsed = time.perf_counter() - started
    memory = torch.cuda.max_memory_allocated() / 2**20 if backend.uses_gpu else None
    backend.shutdown()
    stats = {
        "images_per_s": args.steps * batch_size / elapsed,
        "batch": batch_size,
        "image_size": size,
        "steps": args.steps,
        "model": config.model.name,
        "amp": config.train.amp if backend.uses_gpu else "none (CPU)",
        "device": backend.device_name,
        "loss": final,
        "peak_mem_mb": memory,
    }
    Path(args.stats).write_text(json.dumps(stats))
    return 0


def helper_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py (helper)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("_probe")
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--device", choices=("gpu", "cpu"), required=True)
    p = sub.add_parser("_configs")
    p.add_argument("--commands", required=True)
    p = sub.add_parser("_data")
    p.add_argument("--out", required=True)
    for option in ("--ocr-lines", "--images-train", "--images-val", "--classes"):
        p.add_argument(option, type=int, required=True)
    p = sub.add_parser("_train")
    p.add_argument("--stats", required=True)
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("_synthetic")
    p.add_argument("--stats", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    if args.command == "_train" and args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if args.command in ("_data", "_configs"):
        _project_path()
    handlers = {
        "_configs": helper_configs,
        "_probe": helper_probe,
        "_data": helper_data,
        "_train": helper_train,
        "_synthetic": helper_synthetic,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.exit(helper_main(sys.argv[1:]))
    sys.exit(main())
