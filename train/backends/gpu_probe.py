"""What the GPUs are and what the framework build can do with them, without importing a framework.

Two views, gathered here and judged in train/backends/gpu_verdicts.py: NVML's (the driver's: every
GPU the container was given, its compute capability and the newest CUDA the driver supports), and
the framework build's own (its CUDA version, the architectures compiled in, the GPUs it can use and
a tiny op on each kind of GPU), asked in a subprocess of the current python so that this process
imports no framework, and a GPU op that aborts takes only the probe down.

The standard library only. :func:`nvml_gpus` and :func:`framework_probe_command` are the seams
the tests replace (monkeypatch this module's attributes).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from train.paths import strerror


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML (the driver) sees it, whatever the framework build can do with it."""

    index: int
    name: str
    capability: tuple[int, int] | None  # compute capability, e.g. (9, 0) for H100/H200
    driver: str = ""
    cuda_driver: str = ""  # the newest CUDA this driver supports, e.g. "12.4"

    @property
    def sm(self) -> str:
        return "sm_?" if self.capability is None else "sm_{}{}".format(*self.capability)

    def describe(self) -> str:
        return f"{self.name} ({self.sm}, driver {self.driver or '?'})"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_gpus() -> list[Gpu]:
    """The GPUs NVML sees; empty without nvidia-ml-py, libnvidia-ml or a GPU. The seam the
    tests replace."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            version = pynvml.nvmlSystemGetCudaDriverVersion()
            cuda_driver = f"{version // 1000}.{version % 1000 // 10}"
        except Exception:
            cuda_driver = ""
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                capability = (int(major), int(minor))
            except Exception:
                capability = None
            name = _text(pynvml.nvmlDeviceGetName(handle))
            gpus.append(Gpu(i, name, capability, driver, cuda_driver))
        return gpus
    except Exception:
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


# Run by the current python in a subprocess, so that the doctor imports no framework itself (and a
# GPU op that aborts the process takes only the probe down). One JSON line per fact, prefixed, so
# that whatever the framework prints and a crash halfway both leave the lines before it readable.
_PROBE_SOURCE = r"""
import json, sys, warnings

framework = sys.argv[1]


def out(**fields):
    print("DOCTOR-PROBE " + json.dumps(fields), flush=True)


def short(exc):
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = next((x for x in lines if "error" in x.lower()), lines[0] if lines else "")
    return f"{type(exc).__name__}: {line}"[:300]


try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if framework == "torch":
            import torch

            version, cuda = torch.__version__, torch.version.cuda
            compiled = cuda is not None
            count = torch.cuda.device_count() if compiled and torch.cuda.is_available() else 0
            archs = torch.cuda.get_arch_list() if count else []
        else:
            import paddle

            version = paddle.__version__
            compiled = bool(paddle.is_compiled_with_cuda())
            cuda = paddle.version.cuda() if compiled else None
            count = paddle.device.cuda.device_count() if compiled else 0
            archs = None  # Paddle does not list the architectures it was built for
except BaseException as exc:
    out(kind="error", error=short(exc))
    sys.exit(0)
said = "; ".join(dict.fromkeys(str(w.message).strip() for w in caught))[:500]
out(kind="build", version=version, cuda=cuda, compiled=compiled, count=count, archs=archs,
    warnings=said)
tried = set()
for i in range(count):
    try:
        if framework == "torch":
            name = torch.cuda.get_device_name(i)
            capability = list(torch.cuda.get_device_capability(i))
        else:
            name = paddle.device.cuda.get_device_name(i)
            capability = list(paddle.device.cuda.get_device_capability(i))
    except Exception as exc:
        out(kind="device", index=i, name="?", capability=None, op=short(exc))
        continue
    if tuple(capability) in tried:  # one op per kind of GPU
        out(kind="device", index=i, name=name, capability=capability, op=None)
        continue
    tried.add(tuple(capability))
    try:
        if framework == "torch":
            x = torch.arange(4.0, device=f"cuda:{i}")
        else:
            x = paddle.to_tensor([0.0, 1.0, 2.0, 3.0], place=paddle.CUDAPlace(i))
        value = float((x * 2).sum())  # float() waits for the kernel: its errors surface here
        op = "ok" if value == 12.0 else f"wrong result {value} (expected 12.0)"
    except Exception as exc:
        op = short(exc)
    out(kind="device", index=i, name=name, capability=capability, op=op)
"""
PROBE_TIMEOUT_S = 180.0  # importing the framework and one tiny op; a JIT-compiling build is slower


@dataclass
class FrameworkCuda:
    """What the framework build in this python says about CUDA (from :func:`ask_framework`)."""

    framework: str
    error: str | None = None  # could not ask: not importable, crashed before answering, timeout
    version: str = ""
    cuda: str | None = None  # CUDA version the build was compiled with; None: CPU build
    compiled: bool = False
    count: int = 0  # GPUs the framework can use (after CUDA_VISIBLE_DEVICES)
    archs: list[str] | None = None  # torch.cuda.get_arch_list(); None: not known (Paddle)
    warnings: str = ""
    devices: list[dict] = field(default_factory=list)  # index, name, capability, op
    crashed: str = ""  # the probe died after describing the build (during a GPU op)

    @property
    def usable(self) -> bool:
        return self.error is None and self.compiled and self.count > 0

    def describe(self) -> str:
        build = f"CUDA {self.cuda} build" if self.compiled else "CPU build"
        return f"{self.framework} {self.version} ({build})"


def framework_probe_command(framework: str) -> list[str]:
    """The command that asks ``framework`` about CUDA: the seam the tests replace."""
    return [sys.executable, "-c", _PROBE_SOURCE, framework]


def _run_probe(framework: str, timeout_s: float) -> tuple[str, str, int | None, bool]:
    """Run the probe: (stdout, stderr, exit code, timed out). OSError when it cannot start."""
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ logging: errors only
    proc = subprocess.Popen(
        framework_probe_command(framework),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return stdout, stderr, proc.returncode, True
    return stdout, stderr, proc.returncode, False


def _facts(stdout: str | None) -> list[dict]:
    """The probe's ``DOCTOR-PROBE {json}`` lines, whatever else the framework printed."""
    facts = []
    for line in (stdout or "").splitlines():
        if line.startswith("DOCTOR-PROBE "):
            try:
                facts.append(json.loads(line[len("DOCTOR-PROBE ") :]))
            except ValueError:
                continue
    return facts


def ask_framework(framework: str, timeout_s: float = PROBE_TIMEOUT_S) -> FrameworkCuda:
    found = FrameworkCuda(framework)
    try:
        stdout, stderr, returncode, timed_out = _run_probe(framework, timeout_s)
    except OSError as exc:
        found.error = f"cannot start {sys.executable}: {strerror(exc)}"
        return found
    facts = _facts(stdout)
    build = next((f for f in facts if f.get("kind") == "build"), None)
    error = next((f["error"] for f in facts if f.get("kind") == "error"), None)
    last_err = next((x for x in reversed((stderr or "").splitlines()) if x.strip()), "")
    ended = (
        f"timed out after {timeout_s:.0f} s"
        if timed_out
        else f"exit {returncode}" + (f": {last_err.strip()[:300]}" if last_err else "")
    )
    if build is None:
        found.error = error or f"the probe gave no answer ({ended})"
        return found
    found.version = str(build.get("version", ""))
    found.cuda = build.get("cuda") or None
    found.compiled = bool(build.get("compiled"))
    found.count = int(build.get("count") or 0)
    found.archs = build.get("archs")
    found.warnings = build.get("warnings") or ""
    found.devices = [f for f in facts if f.get("kind") == "device"]
    if timed_out or returncode != 0 or len(found.devices) < found.count:
        found.crashed = ended
    return found
