"""The JSON report: its skeleton (every key and check present from the start, so a broken run
still prints the full schema), the host's facts (nvidia-smi) and the summary of the checks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from .checks import PREFETCH_NOTE
from .plan import SCHEMA, WORKER_COUNTS, Plan, check_names
from .setup import BUILD_FACTS, cu12_index


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


def summarize(report: dict) -> None:
    """``summary`` and ``ok`` from the checks (and ``vs_synthetic`` into each loader check)."""
    checks = report["checks"]
    synthetic = checks["throughput.synthetic"].get("images_per_s")
    loader = _loader_summary(checks, synthetic)
    on, off = checks["prefetcher.on"], checks["prefetcher.off"]
    gain = None
    if on.get("samples_per_s") and off.get("samples_per_s"):
        gain = round(on["samples_per_s"] / off["samples_per_s"], 3)
    statuses = {name: check["status"] for name, check in checks.items()}
    report["summary"] = {
        "images_per_s": {"synthetic": synthetic, "loader": loader},
        "prefetcher": {
            "knob": "loader.device_prefetch",
            "on": on.get("samples_per_s"),
            "off": off.get("samples_per_s"),
            "on_over_off": gain,
            "engaged": report["mode"] == "gpu",
            "note": PREFETCH_NOTE,
        },
        "compile": {
            name[len("compile.") :]: {
                k: checks[name].get(k) for k in ("compile_s", "step_off_over_on", "engaged")
            }
            for name in checks
            if name.startswith("compile.")
        },
        "peak_gpu_memory_mb": _peak_memory(checks),
        "paddle_build": report["paddle_build"].get("ran"),
        "failed": [n for n, s in statuses.items() if s == "error"],
        "skipped": [n for n, s in statuses.items() if s == "skipped"],
    }
    report["ok"] = all(s == "ok" for s in statuses.values())


def _loader_summary(checks: dict, synthetic: float | None) -> dict:
    """Each loader run by worker count; sets its ``vs_synthetic`` (samples/s over the synthetic
    ceiling) when both were measured."""
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
    return loader


def _peak_memory(checks: dict) -> dict:
    """The largest peak device memory per framework, and each check's."""
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
    return memory
