"""``Context`` runs each child in its own session with a log and a timeout inside the budget,
and beside a GPU run the 10 Hz sampler (nvidia-smi, a process of its own). Standard library."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from train.launch import launch_command

from .commands import ROOT, Plan, train_commands

MODULE = __package__  # the helpers run as `python -m scripts.gpu_check _NAME` from the root
# The scenario files' container roots: a child gets none of them, its paths are explicit here.
CONTAINER_ROOTS = ("OCR_DATA_DIR", "RESNET50_DATA_DIR", "RUNS_ROOT", "CACHE_ROOT")
NVML_FIELDS = ("busy_pct_median", "busy_pct_max", "mem_mib_median", "mem_mib_max", "samples")
_ERROR_LINE = re.compile(r"^((config )?error:|[\w.]*(Error|Exception|Interrupt)\b|.*Error: )")
START = time.monotonic()


def say(message: str) -> None:
    sys.stderr.write(f"[gpu_check {time.monotonic() - START:6.1f}s] {message}\n")  # one write


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def tail(text: str, lines: int = 15, limit: int = 2000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-limit:]


def rounded(value, digits: int = 4):
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else str(value)
    return value


def summarize_samples(text: str) -> dict:
    """Median and maximum of busy share and memory from the first busy sample to the last."""
    rows = []
    for parts in (line.split(",") for line in text.splitlines()):
        with contextlib.suppress(ValueError):
            rows += [(float(parts[0]), float(parts[1]))] if len(parts) == 2 else []
    if not rows:
        return {**dict.fromkeys(NVML_FIELDS), "samples": 0, "error": text.strip()[-300:] or "none"}
    busy = [i for i, (util, _) in enumerate(rows) if util > 0] or [0, len(rows) - 1]
    util, mem = zip(*rows[busy[0] : busy[-1] + 1])
    figures = (statistics.median(util), max(util), statistics.median(mem), max(mem), len(util))
    return {k: round(v, 1) if "median" in k else v for k, v in zip(NVML_FIELDS, figures)}


@dataclass
class RunResult:
    """One child process: exit code (None: killed at its timeout), seconds, its log, and what a
    helper answered; ``nvml``: the sampler's figures (None where not sampled: the dry-run)."""

    rc: int | None
    elapsed_s: float
    log_path: Path
    output: str
    stats: dict = field(default_factory=dict)
    timeout_s: float = 0.0
    nvml: dict | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def failure(self) -> str:
        """The line that says what went wrong: the log's last exception or ``error:`` line."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        found = [x for x in lines if _ERROR_LINE.match(x) and not x.startswith("File ")]
        said = (found or lines or ["no output"])[-1][:600]
        if self.rc is None:
            return f"timed out after {self.timeout_s:.0f} s: {said}"
        return f"exit {self.rc}: {said}"


class OutOfTime(Exception):
    """The budget is spent: the check is skipped, not failed."""


class Context:
    """What every check needs: the plan, the work folder, the interpreters, the clock."""

    def __init__(self, plan: Plan, work: Path, budget_s: float) -> None:
        self.plan, self.work, self.budget_s = plan, work, budget_s
        self.deadline = time.monotonic() + budget_s
        self.python: dict[str, str | None] = {"torch": None, "paddle": None}
        self.env: dict[str, dict[str, str]] = {"torch": {}, "paddle": {}}
        self.setup_error: dict[str, str] = {}
        self.toolchain: dict = {}  # what torch.compile lacks here (setup.torch's probe)
        self.stopping = False  # interrupted: start nothing more
        self.publish = lambda: None  # writes the report so far (cli sets it)
        self.only: list[str] = []  # --only: the checks to run (fnmatch patterns)
        self.commands = train_commands(plan, work)
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        for sub in ("logs", "stats", "runs", "data"):
            (work / sub).mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        """Kill every child's process group (their own sessions: a Ctrl-C does not reach them)."""
        self.stopping = True
        with self._lock:
            running = list(self._running)
        for proc in running:
            self._kill(proc, wait=False)

    @staticmethod
    def _kill(proc: subprocess.Popen, wait: bool = True) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if wait:
            proc.wait()

    def spawn(self, name, cmd, env=None, timeout_s=None, reserve_s=20.0, sample_gpu=False):
        """Run ``cmd`` from the repository root, output to logs/NAME.log, killed with its process
        group past its timeout, which never reaches past the budget (then OutOfTime: the check
        was cut, not failed). ``sample_gpu``: the sampler beside it, in GPU mode."""
        left = self.deadline - time.monotonic()
        if self.stopping or left < reserve_s:
            spent = f"time budget spent ({self.budget_s:.0f} s, --budget-s)"
            raise OutOfTime("interrupted" if self.stopping else spent)
        own_timeout = timeout_s or self.plan.run_timeout_s
        timeout = min(own_timeout, left)
        log_path, csv = self.work / "logs" / f"{name}.log", self.work / "stats" / f"{name}.nvml.csv"
        child_env = {k: v for k, v in os.environ.items() if k not in CONTAINER_ROOTS}
        child_env.update({"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
        started, sampler, nvml = time.monotonic(), None, None
        quiet = {"stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
        with open(log_path, "w", encoding="utf-8") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=child_env, stdout=out, start_new_session=True, **quiet
            )
            smi = shutil.which("nvidia-smi") if sample_gpu and self.plan.gpu else None
            if smi is not None:  # the GPU the runs train on: CUDA_VISIBLE_DEVICES' first
                target = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
                query = ["--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
                with contextlib.suppress(OSError), open(csv, "w", encoding="utf-8") as samples:
                    where = ["-lms", "100", "-i", target or "0"]
                    sampler = subprocess.Popen([smi, *query, *where], stdout=samples, **quiet)
            with self._lock:
                self._running.add(proc)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None  # killed with its process group
                self._kill(proc)
            finally:
                with self._lock:
                    self._running.discard(proc)
                if sampler is not None:
                    sampler.kill()  # nvidia-smi writes whole lines; a cut last one is left out
                    sampler.wait()
                    nvml = summarize_samples(csv.read_text(encoding="utf-8", errors="replace"))
                elif sample_gpu and self.plan.gpu:
                    said = "nvidia-smi not found" if smi is None else "nvidia-smi did not start"
                    nvml = {**dict.fromkeys(NVML_FIELDS), "error": said}
        output = log_path.read_text(encoding="utf-8", errors="replace")
        if rc is None and timeout < own_timeout:
            raise OutOfTime(
                f"cut by the time budget ({self.budget_s:.0f} s, --budget-s) after "
                f"{time.monotonic() - started:.0f} s of {name}; log {log_path}"
            )
        return RunResult(rc, time.monotonic() - started, log_path, output, {}, timeout, nvml)

    def helper(self, name, framework, args, timeout_s=None, env=None, sample_gpu=False, ranks=0):
        """Helper command ``args[0]`` (helpers.py) with ``framework``'s interpreter (``ranks``:
        that many, under the framework's launcher); its answer (its stats file) in ``stats``."""
        python = self.python[framework]
        if python is None:
            raise RuntimeError(f"setup.{framework} failed: {self.setup_error.get(framework, '?')}")
        stats = self.work / "stats" / f"{name}.json"
        stats.unlink(missing_ok=True)  # a child killed before it wrote leaves none
        cmd = [python, "-m", MODULE, args[0], "--stats", str(stats), *args[1:]]
        if ranks:  # the rendezvous on a free port of this host
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                master = f"127.0.0.1:{sock.getsockname()[1]}"
            cmd = launch_command(framework, python, ranks, cmd[1:], master=master)
        env = {**self.env[framework], **(env or {})}
        result = self.spawn(name, cmd, env, timeout_s, sample_gpu=sample_gpu)
        result.stats = read_json(stats)
        return result

    def train(self, name: str, framework: str, env: dict[str, str] | None = None) -> RunResult:
        """Run ``name`` of the plan's training commands through ``_train``, the GPU sampled."""
        args = ["_train", "--", *self.commands[name]]
        return self.helper(name, framework, args, env=env, sample_gpu=True)
