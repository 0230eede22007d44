"""Running children: ``Context`` (the plan, the work folder, the interpreters, the clock) starts
every child process in its own session, with a log and a timeout that never reaches past the
budget; ``RunResult`` is what one child left; ``OutOfTime`` skips a check past the budget.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .plan import ROOT, Plan
from .sampler import GpuSampler
from .util import error_text, marked, read_json

# The helpers run as `python -m scripts.gpu_check _NAME ...` from the repository root (every
# child starts there), which puts the root, and so `train` and `datasets`, on their sys.path.
MODULE = __package__
# The scenario files' container roots: a child gets none of them, its paths are explicit here.
CONTAINER_ROOTS = ("OCR_DATA_DIR", "RESNET50_DATA_DIR", "RUNS_ROOT", "CACHE_ROOT")


@dataclass
class RunResult:
    """One child process: exit code, seconds, its log, and the stats file a helper wrote."""

    rc: int | None  # None: timed out (killed)
    elapsed_s: float
    log_path: Path
    output: str
    stats: dict = field(default_factory=dict)
    timeout_s: float = 0.0
    nvml: dict | None = None  # the 10 Hz GPU sampler's figures (sampler.py); None: not sampled

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
    """What every check needs: the plan, the work folder, the interpreters, the clock."""

    def __init__(self, plan: Plan, work: Path, budget_s: float) -> None:
        self.plan = plan
        self.work = work
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.python: dict[str, str | None] = {"torch": None, "paddle": None}
        self.env: dict[str, dict[str, str]] = {"torch": {}, "paddle": {}}
        self.setup_error: dict[str, str] = {}
        self.stopping = False  # interrupted: start nothing more
        self.publish = lambda: None  # writes the report so far (orchestrate sets it)
        self.only: list[str] = []  # `run --only`: the checks to run (fnmatch patterns)
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
        sample_gpu: bool = False,
    ) -> RunResult:
        """Run ``cmd`` from the repository root, output to logs/NAME.log; kill it (and its
        process group) past its timeout, which never reaches past the budget. ``sample_gpu``:
        the GPU's busy share and memory at 10 Hz while it runs (GPU mode; None in the dry-run)."""
        if self.stopping:
            raise OutOfTime("interrupted")
        left = self.remaining()
        if left < reserve_s:
            raise OutOfTime(f"time budget spent ({self.budget_s:.0f} s, --budget-s)")
        own_timeout = timeout_s or self.plan.run_timeout_s
        timeout = min(own_timeout, left)
        log_path = self.work / "logs" / f"{name}.log"
        started = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=child_env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            sampler = GpuSampler(self.work / "stats" / f"{name}.nvml.csv") if sample_gpu else None
            if sampler is not None and self.plan.gpu:
                sampler.start()
            try:
                rc = self._wait(proc, timeout)
            finally:
                nvml = sampler.stop() if sampler is not None else None
        output = log_path.read_text(encoding="utf-8", errors="replace")
        if rc is None and timeout < own_timeout:
            # Killed at the budget's end, not at its own timeout: the check did not fail, it
            # was cut (skipped, and the command's exit code says so).
            raise OutOfTime(
                f"cut by the time budget ({self.budget_s:.0f} s, --budget-s) after "
                f"{time.monotonic() - started:.0f} s of {name}; log {log_path}"
            )
        result = RunResult(rc, time.monotonic() - started, log_path, output, timeout_s=timeout)
        result.nvml = nvml
        return result

    def _wait(self, proc: subprocess.Popen, timeout: float) -> int | None:
        """The child's exit code; None when it ran past ``timeout`` (then its process group is
        killed). While it runs, ``stop`` can kill it."""
        with self._lock:
            self._running.add(proc)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        finally:
            with self._lock:
                self._running.discard(proc)

    def helper(
        self,
        name: str,
        framework: str,
        args: list[str],
        timeout_s: float | None = None,
        stats: bool = False,
        env: dict[str, str] | None = None,
        sample_gpu: bool = False,
    ) -> RunResult:
        """Run a helper command of this package (helpers.py) with ``framework``'s interpreter
        (plus ``env``)."""
        python = self.python[framework]
        if python is None:
            raise RuntimeError(f"setup.{framework} failed: {self.setup_error.get(framework, '?')}")
        stats_path = self.work / "stats" / f"{name}.json"
        stats_path.unlink(missing_ok=True)  # a child killed before it wrote leaves none
        extra = ["--stats", str(stats_path)] if stats else []
        cmd = [python, "-m", MODULE, args[0], *extra, *args[1:]]
        result = self.spawn(
            name, cmd, {**self.env[framework], **(env or {})}, timeout_s, sample_gpu=sample_gpu
        )
        result.stats = read_json(stats_path) if stats else marked(result.output)
        return result

    def train(
        self, name: str, framework: str, train_args: list[str], env: dict[str, str] | None = None
    ) -> RunResult:
        """``python -m train TRAIN_ARGS`` with the framework's interpreter, through ``_train``,
        with the GPU sampled."""
        args = ["_train", "--", *train_args]
        return self.helper(name, framework, args, stats=True, env=env, sample_gpu=True)


def child_env(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment without the container roots, unbuffered, plus ``env``."""
    full_env = dict(os.environ)
    for key in CONTAINER_ROOTS:
        full_env.pop(key, None)
    full_env.update({"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    return full_env
