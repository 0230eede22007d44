"""Parent side: one child process per pipeline, trials interleaved (A B C, C B A, ...), medians.

A child that dies (a segfault in a peer, say) is reported with its signal and the tail of its
log, restarted for the next trial, and never takes the benchmark down with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The libraries a result depends on: their versions are written into every result.
PACKAGES = (
    "numpy",
    "pillow",
    "simplejpeg",
    "isal",
    "opencv-python",
    "opencv-python-headless",
    "h5py",
    "lmdb",
    "psutil",
    "torch",
    "torchvision",
    "paddlepaddle",
    "paddleocr",
)


def package_versions() -> dict[str, str]:
    """{name: version} of the PACKAGES installed in this venv."""
    import importlib.metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


class ChildCrashed(RuntimeError):
    pass


class Child:
    """A long-lived ``python -m bench.child`` for one pipeline."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name, self.workdir = name, workdir
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.count = 0

    def _start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")  # one process per core is the loader's job
        log = open(self.log_path, "a")  # noqa: SIM115  (owned by the child process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.child"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run(self, spec: dict, timeout_s: float = 300.0) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.count += 1
        result_file = self.workdir / f"{self.name}-{self.count}.json"
        self.proc.stdin.write(json.dumps({**spec, "result_file": str(result_file)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while not result_file.exists():
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise ChildCrashed(self._describe(code))
            if time.monotonic() > deadline:
                self.close()
                raise ChildCrashed(f"no result after {timeout_s:.0f}s (killed)")
            time.sleep(0.02)
        return json.loads(result_file.read_text())

    def _describe(self, code: int) -> str:
        what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        tail = self.log_path.read_text(errors="replace")[-1500:]
        return f"{self.name} child died with {what}; log tail:\n{tail}"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


class Runner:
    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-"))
        self.children: dict[str, Child] = {}

    def trial(self, pipeline: str, spec: dict) -> dict:
        child = self.children.setdefault(pipeline, Child(pipeline.replace(".", "_"), self.workdir))
        try:
            return child.run({**spec, "pipeline": pipeline})
        except ChildCrashed as exc:
            return {"ok": False, "crashed": True, "error": str(exc)}

    def close(self) -> None:
        for child in self.children.values():
            child.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def interleaved(runner: Runner, arms: list[tuple[str, str, dict]], reps: int, log) -> dict:
    """Run every arm (label, pipeline, spec) ``reps`` times, alternating the order each round
    so slow drifts of a shared host hit every arm alike. Returns {label: [results]}."""
    results: dict[str, list[dict]] = {label: [] for label, _, _ in arms}
    for rep in range(reps):
        order = arms if rep % 2 == 0 else arms[::-1]
        for label, pipeline, spec in order:
            result = runner.trial(pipeline, spec)
            results[label].append(result)
            speed = result.get("samples_per_s", result.get("error", "")[:80])
            log(f"  rep {rep} {label}: {speed}")
    return results


def median_of(trials: list[dict], key: str):
    values = [t[key] for t in trials if t.get("ok") and key in t]
    return round(statistics.median(values), 4) if values else None


def aggregate(trials: list[dict]) -> dict:
    """Medians of the numeric figures over the successful trials, plus every raw speed."""
    good = [t for t in trials if t.get("ok")]
    out = {"trials_ok": len(good), "trials": len(trials)}
    if len(good) < len(trials):
        out["errors"] = sorted({t.get("error", "")[:300] for t in trials if not t.get("ok")})
    for key in (
        "samples_per_s",
        "cpu_us_per_sample",
        "faults_per_batch",
        "wait_fraction",
        "batch_bytes",
        "peak_worker_rss_mb",
        "peak_worker_uss_mb",
        "worker_uss_growth_mb",
        "main_rss_mb",
        "shm_peak_delta_bytes",
        "build_s",
        "copies_per_batch",
        "handover_ms",
        "handover_share",
    ):
        out[key] = median_of(good, key)
    out["samples_per_s_all"] = [t.get("samples_per_s") for t in good]
    if good:
        out["image_dtype"] = good[0]["image_dtype"]
        for key in ("first_batch_s", "epoch_s"):
            columns = list(zip(*[t[key] for t in good]))
            out[key] = [round(statistics.median(c), 4) for c in columns]
    return out


def write_results(stem: Path, results: dict, markdown: str) -> None:
    """``stem``.json and ``stem``.md (the folder made if need be), and the Markdown printed: how
    each benchmark command leaves its figures in bench/results/."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
