"""The JSON report: its skeleton (every key and check present from the start, so a broken run
still prints the full schema), the host's facts (nvidia-smi), the summary of the checks, and the
short Markdown table written beside the JSON.
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
from .plan import LOADER_WORKERS, RING_LEGS, SCHEMA, Plan
from .setup import BUILD_FACTS

NOT_REACHED = {"status": "skipped", "reason": "not reached"}


def skeleton(plan: Plan, work: Path, names: list[str]) -> dict:
    build = {"python": None, **dict.fromkeys(BUILD_FACTS)}
    return {
        "schema": SCHEMA,
        "mode": "gpu" if plan.gpu else "dry-run",
        "ok": False,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": None,
        "budget_s": None,
        "work_dir": str(work),
        "report_md": None,
        "host": {},
        "wheelhouse": None,
        "torch_build": dict(build),
        "paddle_build": dict(build),
        "checks": {name: dict(NOT_REACHED) for name in names},
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


def _get(checks: dict, name: str) -> dict:
    return checks.get(name) or {}


def summarize(report: dict) -> None:
    """``summary`` and ``ok`` from the checks (and ``vs_synthetic`` into the loader checks)."""
    checks = report["checks"]
    statuses = {name: check["status"] for name, check in checks.items()}
    summary: dict = {}
    if "throughput.synthetic" in checks:
        synthetic = _get(checks, "throughput.synthetic").get("images_per_s")
        loader = {}
        for name in (f"throughput.loader.w{LOADER_WORKERS}", "prefetcher.off"):
            check = checks[name]
            rate = check.get("samples_per_s")
            if synthetic and rate:
                check["vs_synthetic"] = round(rate / synthetic, 3)
            loader[name] = {
                k: check.get(k)
                for k in ("samples_per_s", "data_wait_fraction", "vs_synthetic", "status")
            }
        on = checks[f"throughput.loader.w{LOADER_WORKERS}"].get("samples_per_s")
        off = checks["prefetcher.off"].get("samples_per_s")
        ring = {leg: checks[f"throughput.paddle.ocr.ring_{leg}"] for leg in RING_LEGS}
        ring_on, ring_off = (ring[leg].get("samples_per_s") for leg in RING_LEGS)
        summary.update(
            images_per_s={"synthetic": synthetic, "loader": loader},
            prefetcher={
                "knob": "loader.device_prefetch",
                "on": on,
                "off": off,
                "on_over_off": round(on / off, 3) if on and off else None,
                "engaged": report["mode"] == "gpu",
                "note": PREFETCH_NOTE,
            },
            batch_ring={
                "knob": "loader.batch_ring",
                "on": ring_on,
                "off": ring_off,
                "on_over_off": round(ring_on / ring_off, 3) if ring_on and ring_off else None,
                "data_wait_on": ring["on"].get("data_wait_fraction"),
                "data_wait_off": ring["off"].get("data_wait_fraction"),
            },
            compile={
                name[len("compile.") :]: {
                    k: checks[name].get(k)
                    for k in ("compile_s", "step_off_over_on", "engaged", "status", "reason")
                }
                for name in checks
                if name.startswith("compile.")
            },
            loss_scale={
                name: checks[name].get("loss_scale")
                for name in checks
                if name.startswith("amp.") and name.endswith(".fp16")
            },
            resume_loss={
                name: checks[name].get("resume_loss")
                for name in checks
                if name.startswith("smoke.")
            },
            gpu_busy_pct_median={
                name: (check.get("nvml") or {}).get("busy_pct_median")
                for name, check in checks.items()
                if "nvml" in check
            },
        )
    summary.update(
        peak_gpu_memory_mb=_peak_memory(checks),
        torch_build=_build_line(report["torch_build"]),
        paddle_build=_build_line(report["paddle_build"])
        or (report["checks"].get("setup.paddle") or {}).get("reason"),
        failed=[n for n, s in statuses.items() if s == "error"],
        skipped=[n for n, s in statuses.items() if s == "skipped"],
    )
    report["summary"] = summary
    report["ok"] = all(s == "ok" for s in statuses.values())


def _build_line(build: dict) -> str | None:
    """The framework build that ran ("2.11.0 (CUDA 13.0) in PYTHON"), or None."""
    if not build.get("version"):
        return None
    cuda = f"CUDA {build['cuda']}" if build.get("cuda") else "CPU build"
    return f"{build['version']} ({cuda}) in {build.get('python')}"


def _peak_memory(checks: dict) -> dict:
    """The largest peak device memory per framework, and each check's."""
    memory: dict = {"torch": None, "paddle": None, "by_check": {}}
    for name, check in checks.items():
        value = check.get("peak_mem_mb")
        if isinstance(value, (int, float)):
            memory["by_check"][name] = value
            framework = (
                "torch"
                if ".torch." in name
                or name.startswith(("throughput.synthetic", "throughput.loader", "prefetch"))
                else "paddle"
                if ".paddle." in name
                else None
            )
            if framework and (memory[framework] is None or value > memory[framework]):
                memory[framework] = value
    return memory


def _num(value, digits: int = 1) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"
    return str(value)


def headline(name: str, check: dict) -> str:
    """The one figure of a check that says most, for the Markdown table."""
    nvml = check.get("nvml") or {}
    busy = f", GPU busy {_num(nvml.get('busy_pct_median'), 0)}%" if nvml else ""
    if name == "throughput.synthetic":
        return f"{_num(check.get('images_per_s'))} images/s{busy}"
    if name.startswith(("throughput.", "prefetcher.")):
        vs = (
            f", {_num(check.get('vs_synthetic'), 2)} of synthetic"
            if "vs_synthetic" in check
            else ""
        )
        return (
            f"{_num(check.get('samples_per_s'))} samples/s over {_num(check.get('measured_steps'))}"
            f" steps, data wait {_num(check.get('data_wait_fraction'), 3)}{vs}{busy}"
        )
    if name.startswith("compile."):
        return (
            f"compile {_num(check.get('compile_s'))} s, step off/on "
            f"{_num(check.get('step_off_over_on'), 2)}"
        )
    if name.startswith("amp."):
        losses = check.get("losses") or []
        scale = check.get("loss_scale") or {}
        final = f", loss scale {_num(scale.get('final'), 0)}" if scale.get("final") else ""
        last = _num(losses[-1] if losses else None, 4)
        return f"loss {last}, active {check.get('amp_active')}{final}"
    if name.startswith("smoke."):
        resume = check.get("resume_loss") or {}
        return (
            f"loss {_num(check.get('loss_first'), 3)} -> {_num(check.get('loss_last'), 3)}, "
            f"resumed vs straight {_num(resume.get('abs_diff'), 6)}"
        )
    if name.startswith("finetune."):
        return f"{_num(check.get('steps'))} steps, export {check.get('export_ok')}"
    if name.startswith("dist."):
        return (
            f"param diff {_num(check.get('param_max_diff'), 6)}, loss fell {check.get('loss_fell')}"
        )
    if name.startswith("setup."):
        where = check.get("device_name") or "cpu"
        return f"{check.get('version')} CUDA {check.get('cuda')} on {where}"
    if name == "configs":
        return f"{_num(check.get('validated'))} command lines"
    if name == "data":
        images, lines = _num(check.get("images_train")), _num(check.get("ocr_lines"))
        return f"{images} images, {lines} lines ({check.get('written')})"
    return ""


def markdown(report: dict) -> str:
    """The short table beside the JSON: one row per check, its status and headline figure."""
    host, summary = report.get("host") or {}, report.get("summary") or {}
    lines = [
        f"# gpu_check ({report['mode']})",
        "",
        f"- ok: **{report['ok']}**, {report.get('elapsed_s')} s "
        f"(budget {report.get('budget_s')} s)",
        f"- GPU: {host.get('gpu')} (compute capability {host.get('compute_capability')}, "
        f"driver {host.get('driver')}, CUDA {host.get('cuda_driver')})",
        f"- torch: {summary.get('torch_build')}",
        f"- Paddle: {summary.get('paddle_build')}",
        f"- failed: {summary.get('failed')}; skipped: {summary.get('skipped')}",
        "",
        "| check | status | figure | note |",
        "|---|---|---|---|",
    ]
    for name, check in report["checks"].items():
        note = check.get("error") or check.get("reason") or ""
        note = note.replace("|", "/").replace("\n", " ")[:160]
        figure = headline(name, check) if check["status"] != "skipped" else ""
        lines.append(f"| {name} | {check['status']} | {figure.replace('|', '/')} | {note} |")
    if report.get("script_error"):
        lines += ["", "script_error:", "", "```", report["script_error"][-2000:], "```"]
    return "\n".join(lines) + "\n"
