"""The doctor's GPU checks: what NVML sees against what the framework build can use.

The facts come from train/backends/gpu_probe.py (NVML, and the framework asked in a subprocess);
this module judges them: a GPU the build has no kernels for (compute capability against the CUDA
version or torch's arch list: a FAIL where the build cannot run, a WARN where it may not), a CPU
build or a hidden GPU while GPUs are there, a driver older than the build's CUDA, a tiny op that
failed. One line per verdict, with the fix.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from train.backends import gpu_probe
from train.backends.gpu_probe import FrameworkCuda, Gpu
from train.check import Check


def _version(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


# The first CUDA release that can build for a compute capability (newer ones: CUDA 12.8).
_MIN_CUDA = {
    (7, 0): (9, 0),
    (7, 5): (10, 0),
    (8, 0): (11, 0),
    (8, 6): (11, 1),
    (8, 7): (11, 4),
    (8, 9): (11, 8),
    (9, 0): (11, 8),
}
# Paddle 2.6's CUDA 12 release image, the same tag pattern as the default CUDA 11.8 base
# (compose.yaml, docker/paddle.Dockerfile): the base for Hopper, where the CUDA 11.x builds abort.
PADDLE_CUDA12_BASE = "paddlepaddle/paddle:2.6.1-gpu-cuda12.0-cudnn8.9-trt8.6"
PADDLE_CUDA12_FIX = (
    f"use the CUDA 12 Paddle base: PADDLE_BASE_IMAGE={PADDLE_CUDA12_BASE} "
    "docker compose build train-ocr"
)


class ArchProblem(NamedTuple):
    """Why a build may not run on a kind of GPU, and the fix. ``fatal``: it cannot, and the
    doctor FAILs (training stops at start where the facts it has in-process show it:
    unrunnable_gpu); otherwise the doctor warns."""

    reason: str
    fix: str
    fatal: bool = False


def arch_problem(fw: FrameworkCuda, capability: tuple[int, int]) -> ArchProblem | None:
    """Why this build may not (or cannot: ``fatal``) run on a GPU of ``capability``, or None.

    Fatal: a torch build with neither a cubin of the GPU's major version (not newer than it)
    nor PTX to JIT-compile (CUDA's "no kernel image is available"); and Paddle's CUDA 11.x
    builds on compute capability 9.0 and newer. Paddle 2.6 lists sm_90 for its CUDA 12 builds
    only, and a CUDA 11.8 build on an H100 passes paddle.utils.run_check() (and the doctor's
    tiny op) and then aborts in training: only the build's CUDA version can tell."""
    major, minor = capability
    sm = major * 10 + minor
    if fw.archs:  # torch: the architectures compiled in
        cubins = [int(m.group(1)) for a in fw.archs if (m := re.fullmatch(r"sm_(\d+)a?", a))]
        ptx = [int(m.group(1)) for a in fw.archs if (m := re.fullmatch(r"compute_(\d+)a?", a))]
        fix = (
            f"use a PyTorch build whose arch list has sm_{sm} (Blackwell needs a CUDA 12.8 "
            "build, torch >= 2.7): TORCH_BASE_IMAGE=pytorch/pytorch:<version>-cuda<12.x>-"
            "cudnn9-runtime docker compose build train-resnet50"
        )
        if any(c // 10 == major and c <= sm for c in cubins):
            return None  # a cubin of the same major, not newer, runs
        if any(p <= sm for p in ptx):
            return ArchProblem(
                f"no sm_{sm} kernels in {fw.describe()} (arch list {' '.join(fw.archs)}): "
                "the driver JIT-compiles PTX at start, slowly",
                fix,
            )
        has = f"{fw.describe()} has kernels for {' '.join(fw.archs)} only, not sm_{sm}"
        return ArchProblem(has, fix, fatal=True)
    built = _version(fw.cuda)
    if built is None:
        return None
    needed = _MIN_CUDA.get(capability, (12, 8) if major >= 10 else None)
    if fw.framework == "paddle" and major >= 10:
        fix = (
            "Paddle 2.6 has no CUDA 12.8 build for this GPU: train with framework: torch on a "
            "CUDA 12.8 PyTorch base, or a newer Paddle release built with CUDA >= 12.8"
        )
    elif fw.framework == "paddle":
        fix = PADDLE_CUDA12_FIX
    else:
        fix = f"use a {fw.framework} build with CUDA >= {needed[0]}.{needed[1]}" if needed else ""
    paddle_cuda11 = fw.framework == "paddle" and built[0] < 12 and major >= 9
    if needed is not None and built < needed:
        return ArchProblem(
            f"{fw.describe()} predates sm_{sm} (CUDA {needed[0]}.{needed[1]} or newer is needed "
            "to build for it)",
            fix,
            fatal=paddle_cuda11,
        )
    if paddle_cuda11:
        return ArchProblem(
            f"Paddle's CUDA {fw.cuda} build cannot run on Hopper and newer (sm_{sm}): Paddle 2.6 "
            "builds sm_90 kernels in its CUDA 12 builds only (a tiny op, even "
            "paddle.utils.run_check(), passes; training then aborts)",
            fix,
            fatal=True,
        )
    return None


def unrunnable_gpu(fw: FrameworkCuda, gpus: list[Gpu]) -> tuple[str, str] | None:
    """(why ``fw``'s build cannot run on one of the GPUs, the fix) when arch_problem says so
    for a GPU of ``gpus`` (NVML's) or of those the framework described, else None. Training
    stops at start on it (train/backends/common.py's choose_gpu), from the build facts the
    backend reads in-process: Paddle's CUDA version, not torch's arch list (torch then stops
    at its first kernel, "no kernel image is available")."""
    kinds = {g.capability: g.name for g in gpus if g.capability is not None}
    for d in fw.devices:
        if d.get("capability"):
            kinds.setdefault(tuple(d["capability"]), d.get("name", "?"))
    for capability, name in sorted(kinds.items()):
        problem = arch_problem(fw, capability)
        if problem is not None and problem.fatal:
            return f"{problem.reason}; GPU: {name}", problem.fix
    return None


def no_cuda_reason(fw: FrameworkCuda, gpus: list[Gpu]) -> tuple[str, str]:
    """Why a framework cannot use the GPUs NVML sees (``gpus``, maybe none): (reason, fix).
    The doctor's verdict, and training's when train.device asks for a GPU it cannot have."""
    runtime_fix = (
        "run the container with the NVIDIA runtime (compose.yaml's device reservation, "
        "docker run --gpus all) and check nvidia-smi inside it"
    )
    if not fw.compiled:
        package = "paddlepaddle-gpu" if fw.framework == "paddle" else "a CUDA build of torch"
        return (
            f"{fw.framework} {fw.version} is a CPU build",
            f"install {package} (the GPU images have it: docker compose build), or set "
            "train.device: cpu",
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return (
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
            "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use (CUDA_VISIBLE_DEVICES=0,1)",
        )
    built = _version(fw.cuda)
    drivers = {g.cuda_driver for g in gpus if g.cuda_driver}
    supported = max((_version(d) for d in drivers if _version(d)), default=None)
    if built is not None and supported is not None and built[0] > supported[0]:
        return (
            f"the driver ({gpus[0].driver}) supports CUDA up to {supported[0]}.{supported[1]}, "
            f"{fw.describe()} needs CUDA {fw.cuda}: driver too old",
            f"update the host's NVIDIA driver to one for CUDA {fw.cuda} (nvidia-smi shows "
            "'CUDA Version'), or use an image built for an older CUDA",
        )
    said = f" ({fw.warnings})" if fw.warnings else ""
    return (f"{fw.describe()} sees no GPU{said}", runtime_fix)


_NO_GPU_FIX = (
    "run the container with the NVIDIA runtime (compose.yaml's device reservation, "
    "docker run --gpus all) and check nvidia-smi on the host"
)


def _seen(gpus: list[Gpu]) -> str:
    return f"{len(gpus)} visible (NVML): {', '.join(g.describe() for g in gpus)}"


def _unasked(wanted: str, framework: str, gpus: list[Gpu], fw: FrameworkCuda) -> list[Check]:
    """The framework could not be asked: fall back on NVML alone, and say we could not ask."""
    note = f"could not ask {framework} about CUDA ({fw.error})"
    ask_fix = f"run the doctor with the python that trains (the one with {framework})"
    if gpus:
        return [Check("GPU", "WARN", f"{_seen(gpus)}; {note}", ask_fix)]
    if wanted == "gpu":
        detail = f"train.device is gpu but no GPU is visible (NVML); {note}"
        return [Check("GPU", "FAIL", detail, _NO_GPU_FIX)]
    detail = f"no GPU visible (NVML): training will run on the CPU; {note}"
    return [Check("GPU", "WARN", detail, _NO_GPU_FIX)]


def _unusable(wanted: str, framework: str, gpus: list[Gpu], fw: FrameworkCuda) -> list[Check]:
    """The framework build cannot use CUDA (a CPU build, no GPU it can see)."""
    if gpus:
        reason, fix = no_cuda_reason(fw, gpus)
        detail = f"{_seen(gpus)}, but {framework} cannot use CUDA: {reason}"
        if wanted == "auto":
            detail += "; train.device is auto: TRAINING WOULD RUN ON THE CPU, with the GPUs idle"
        else:
            detail += "; train.device is gpu: training would stop at start"
        return [Check("GPU", "FAIL" if wanted == "gpu" else "WARN", detail, fix)]
    detail = f"no GPU visible (NVML sees none; {fw.describe()} sees none)"
    if wanted == "gpu":
        return [Check("GPU", "FAIL", f"train.device is gpu but {detail}", _NO_GPU_FIX)]
    return [Check("GPU", "WARN", f"{detail}: training will run on the CPU", _NO_GPU_FIX)]


def _arch_check(framework: str, gpus: list[Gpu], fw: FrameworkCuda) -> Check | None:
    """One line for the build against each kind of GPU: NVML's view, else the framework's."""
    kinds: dict[tuple[int, int], str] = {}
    for g in gpus:
        if g.capability is not None:
            kinds.setdefault(g.capability, g.name)
    for d in fw.devices:
        if d.get("capability"):
            kinds.setdefault(tuple(d["capability"]), d.get("name", "?"))
    worst, lines, fixes = "PASS", [], []
    for capability, name in sorted(kinds.items()):
        sm = "sm_{}{}".format(*capability)
        ops = [
            d["op"]
            for d in fw.devices
            if d.get("op") and tuple(d.get("capability") or ()) == capability
        ]
        failed = next((op for op in ops if op != "ok"), None)
        problem = arch_problem(fw, capability)
        if failed is not None:
            worst = "FAIL"
            why = f"; {problem[0]}" if problem is not None else ""
            lines.append(f"{name} ({sm}): a tiny {framework} op failed: {failed.rstrip('.')}{why}")
        elif not ops and fw.crashed:
            worst = "FAIL"
            lines.append(f"{name} ({sm}): the {framework} probe did not finish ({fw.crashed})")
        elif problem is not None and problem.fatal:
            worst = "FAIL"
            lines.append(f"{name} ({sm}): {problem.reason}")
        elif problem is not None:
            worst = "WARN" if worst == "PASS" else worst
            ran = " (a tiny op ran; other kernels may be missing)" if ops else ""
            lines.append(f"{name} ({sm}): {problem.reason}{ran}")
        else:
            lines.append(f"{name} ({sm}): supported" + (", a tiny op ran" if ops else ""))
            continue
        if problem is not None and problem[1] not in fixes:
            fixes.append(problem[1])
    if not lines:
        return None
    fix = "; ".join(fixes) or (
        f"use a {framework} build for this GPU (the image's base, compose.yaml build args)"
    )
    return Check(f"GPU vs {framework}", worst, "; ".join(lines), fix)


def gpu_verdict(wanted: str, framework: str, gpus: list[Gpu], fw: FrameworkCuda) -> list[Check]:
    """The GPU checks from what NVML sees and what the framework build says."""
    if fw.error is not None:
        return _unasked(wanted, framework, gpus, fw)
    if not fw.usable:
        return _unusable(wanted, framework, gpus, fw)
    names = ", ".join(
        f"{d.get('name')} (sm_{''.join(map(str, d.get('capability') or ['?']))})"
        for d in fw.devices
    )
    uses = f"{fw.describe()} sees {fw.count}" + (f": {names}" if names else "")
    if gpus:
        checks = [Check("GPU", "PASS", f"{_seen(gpus)}; {uses}")]
    else:  # libnvidia-ml not injected into the container: no telemetry, training still works
        detail = f"NVML not available (no GPU utilisation in metrics.jsonl); {uses}"
        checks = [Check("GPU", "PASS", detail)]
    arch = _arch_check(framework, gpus, fw)
    return checks if arch is None else [*checks, arch]


def check_gpu(config) -> list[Check]:
    gpus = gpu_probe.nvml_gpus()
    wanted = config.train.device
    if wanted == "cpu":
        unused = f" ({len(gpus)} GPU(s) visible, unused)" if gpus else ""
        return [Check("GPU", "PASS", f"train.device is cpu{unused}")]
    return gpu_verdict(wanted, config.framework, gpus, gpu_probe.ask_framework(config.framework))
