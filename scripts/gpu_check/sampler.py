"""The GPU sampler beside every training run (GPU mode): ``nvidia-smi`` in loop mode at 10 Hz
(``-lms 100``) writes the GPU's busy share (NVML's utilization.gpu: the share of the last sample
period in which a kernel ran) and its used memory to a CSV file; ``stop`` reads it back as a
median and a maximum. A separate process, so sampling costs the run nothing (no thread in the
training process, no GIL). Standard library only: it runs in the orchestrator.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
from pathlib import Path

HZ = 10
FIELDS = ("busy_pct_median", "busy_pct_max", "mem_mib_median", "mem_mib_max", "samples")


def nvml_target() -> str:
    """The GPU the runs train on, as nvidia-smi's -i takes it: the first entry of
    CUDA_VISIBLE_DEVICES (an index or a UUID), else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class GpuSampler:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._proc: subprocess.Popen | None = None
        self._out = None
        self._error: str | None = None
        self._started = False

    def start(self) -> None:
        self._started = True
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self._error = "nvidia-smi not found"
            return
        cmd = [
            smi,
            "--query-gpu=utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
            "-lms",
            str(1000 // HZ),
            "-i",
            nvml_target(),
        ]
        self._out = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed in stop)
        try:
            self._proc = subprocess.Popen(
                cmd, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        except OSError as error:
            self._error = f"nvidia-smi did not start: {error}"

    def stop(self) -> dict | None:
        """The figures; None when the sampler never started (the dry-run)."""
        if not self._started:
            return None
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        if self._out is not None:
            self._out.close()
        if self._error:
            return {**dict.fromkeys(FIELDS), "error": self._error}
        return summarize_samples(self.path.read_text(encoding="utf-8", errors="replace"))


def summarize_samples(text: str) -> dict:
    """Median and maximum of the busy share and the memory, over the samples from the first to
    the last one with the GPU busy (a run's imports and start-up, before its first kernel, and
    its exit are left out); all samples when it never was."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        with contextlib.suppress(ValueError):
            if len(parts) == 2:
                rows.append((float(parts[0]), float(parts[1])))
    if not rows:
        return {**dict.fromkeys(FIELDS), "samples": 0, "error": text.strip()[-300:] or "none"}
    busy = [i for i, (util, _) in enumerate(rows) if util > 0]
    if busy:
        rows = rows[busy[0] : busy[-1] + 1]
    util = [u for u, _ in rows]
    mem = [m for _, m in rows]
    return {
        "busy_pct_median": round(statistics.median(util), 1),
        "busy_pct_max": max(util),
        "mem_mib_median": round(statistics.median(mem), 1),
        "mem_mib_max": max(mem),
        "samples": len(rows),
    }
