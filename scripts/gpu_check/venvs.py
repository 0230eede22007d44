"""Venvs, wheels and CUDA libraries for GPU mode: make a venv (virtualenv where ensurepip is
missing), pip-install requirements once (a stamp of their digest marks a venv as done) and put the
lib folders of NVIDIA's pip wheels on LD_LIBRARY_PATH, with the unversioned names Paddle dlopens.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from .context import Context, RunResult
from .plan import ROOT
from .util import error_text, say

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
        _virtualenv(ctx, name, base_python, venv, result)
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


def _virtualenv(
    ctx: Context, name: str, base_python: str, venv: Path, venv_result: RunResult
) -> None:
    """``python -m virtualenv VENV``, installing virtualenv for the user first when it is missing
    (``venv_result``: the failed ``python -m venv``, for the error)."""
    probe = ctx.spawn(f"{name}.virtualenv-check", [base_python, "-m", "virtualenv", "--version"])
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
            raise RuntimeError(f"cannot make a venv: {venv_result.failure()}; {got.failure()}")
    made = ctx.spawn(
        f"{name}.virtualenv", [base_python, "-m", "virtualenv", str(venv)], timeout_s=180
    )
    if not made.ok:
        raise RuntimeError(f"cannot make a venv: {made.failure()}")


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
