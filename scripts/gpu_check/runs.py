"""Reading a training run's directory: metrics.jsonl records, the latest checkpoint, train.log
(the device it trained on, the step it resumed from) and throughput over the logging windows.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from .plan import Plan


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


RUN_LINE = re.compile(r"INFO train: run .*?: \w+ \w+ on (.+?), \d+ rank")
RESUMED = re.compile(r"resumed from (\S+) \(epoch (\d+), step (\d+)\)")
CPU_AMP_WARNING = "but the device is the CPU: training in float32"


def run_device(log: str) -> str | None:
    found = RUN_LINE.findall(log)
    return found[-1] if found else None


def on_expected_device(plan: Plan, device: str | None) -> bool:
    if device is None:
        return False
    return device.startswith("cpu") != plan.gpu


def window_stats(records: list[dict], warmup_steps: int) -> dict:
    """samples/s and data-wait share over the logging windows after the first ``warmup_steps``
    steps, weighted by each window's wall time, as the run's summary does; how many steps that
    is, and the epochs the run's windows fell in (one, when the data was sized right: a window
    across an epoch end would add the next epoch's start-up to the figure)."""
    used = [r for r in records if r["step"] > warmup_steps]
    wall = wait = samples = 0.0
    previous = warmup_steps
    for record in used:
        steps = max(1, record["step"] - previous)
        previous = record["step"]
        wall += record["batch_cost_s"] * steps
        wait += record["reader_cost_s"] * steps
        samples += record["samples_per_s"] * record["batch_cost_s"] * steps
    util = [r["gpu_util"] for r in used if r.get("gpu_util") is not None]  # null: NVML refused
    return {
        "samples_per_s": samples / wall if wall else None,
        "data_wait_fraction": min(1.0, wait / wall) if wall else None,
        "windows": len(used),
        "measured_steps": (used[-1]["step"] - warmup_steps) if used else 0,
        "warmup_steps": warmup_steps,
        "epochs": sorted({r.get("epoch") for r in records if r.get("epoch") is not None}),
        "gpu_util_mean": sum(util) / len(util) if util else None,
    }


def window_problems(stats: dict, measure_steps: int) -> list[str]:
    """Why a throughput figure cannot be trusted: too few measured steps, or an epoch end
    inside the run."""
    problems = []
    if not stats["samples_per_s"]:
        problems.append("no logging window to measure")
    elif stats["measured_steps"] < measure_steps:
        problems.append(
            f"measured over {stats['measured_steps']} steps, the plan says {measure_steps}"
        )
    if len(stats["epochs"]) > 1:
        problems.append(f"the run crossed an epoch end (epochs {stats['epochs']}): more data")
    return problems
