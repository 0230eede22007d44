"""setup.torch and setup.paddle: which venv each framework runs in, and a probe of its build on
the device. GPU mode reuses .venv-torch when it runs on the GPU, else installs its own; Paddle
tries its builds in the order the GPU's compute capability picks (``paddle_order``): from 9.0
(Hopper) the CUDA 12.0 build from Paddle's own index first, since Paddle 2.6 ships sm_90 kernels
only in its CUDA 12 builds; below it the CUDA 11.8 build from the default index (the image's)
first. GPU_CHECK_PADDLE_BUILDS overrides the order. The dry-run uses make setup's venvs as they
are.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys

from .context import Context, RunResult
from .plan import ROOT
from .util import say
from .venvs import InstallError, cuda_lib_env, ensure_installed

CACHE = ROOT / ".cache" / "gpu-check"  # GPU mode's venvs (ignored by git and the images)
# Paddle 2.6's CUDA 12 build (2.6.2.post120) is published only on Paddle's own package index.
PADDLE_CU12_INDEX = "https://www.paddlepaddle.org.cn/packages/stable/cu120/"
PADDLE_BUILDS = {
    # build: (requirements file, extra index, what it is)
    "cu118": ("requirements/paddle-gpu-cu118.txt", None, "paddlepaddle-gpu 2.6.2, CUDA 11.8"),
    "cu120": (
        "requirements/paddle-gpu-cu120.txt",
        "cu12",
        "paddlepaddle-gpu 2.6.2.post120, CUDA 12.0",
    ),
}


def probe(ctx: Context, name: str, framework: str) -> tuple[RunResult, dict]:
    result = ctx.helper(
        name,
        framework,
        ["_probe", "--framework", framework, "--device", ctx.plan.device],
        timeout_s=240,
    )
    return result, result.stats


def probe_failure(result: RunResult, facts: dict) -> str | None:
    if not facts:
        return f"the probe gave no answer ({result.failure()})"
    if not facts.get("ok"):
        return facts.get("error") or "an op failed"
    return None


def setup_torch(ctx: Context) -> dict:
    plan = ctx.plan
    info: dict = {}
    existing = ROOT / ".venv-torch" / "bin" / "python"
    if not plan.gpu:
        if not existing.exists():
            raise RuntimeError(".venv-torch/bin/python is missing: run `make setup` first")
        ctx.python["torch"] = str(existing)
        info.update(venv=".venv-torch", installed="existing (dry-run installs nothing)")
    else:
        # make setup's .venv-torch holds the same torch (PyPI's torch 2.6.0 is the CUDA 12.4
        # build): reuse it when it works on this GPU, else a venv of our own.
        if existing.exists():
            ctx.python["torch"] = str(existing)
            result, facts = probe(ctx, "setup.torch.existing", "torch")
            if probe_failure(result, facts) is None:
                info.update(venv=".venv-torch", installed="existing")
                return _setup_result(info, facts, result)
            failure = probe_failure(result, facts)
            say(f"setup.torch: .venv-torch does not run on this GPU ({failure})")
        reqs = ["requirements/torch.txt", "requirements/remote.txt"]
        try:
            python, got = ensure_installed(
                ctx, "setup.torch", sys.executable, CACHE / "venv-torch", reqs
            )
        except InstallError as error:
            raise SetupError(str(error), {**info, **error.info}) from None
        info.update(got)
        ctx.python["torch"] = python
    result, facts = probe(ctx, "setup.torch", "torch")
    failure = probe_failure(result, facts)
    if failure:
        raise SetupError(
            failure, {**info, **{k: v for k, v in facts.items() if k not in ("ok", "error")}}
        )
    return _setup_result(info, facts, result)


class SetupError(RuntimeError):
    """A set-up failed; ``info`` says how far it got (venv, install time, the probe's facts)."""

    def __init__(self, message: str, info: dict) -> None:
        super().__init__(message)
        self.info = info


def _setup_result(info: dict, facts: dict, result: RunResult) -> dict:
    return {
        "status": "ok",
        **info,
        **{k: v for k, v in facts.items() if k != "ok"},
        "elapsed_s": round(result.elapsed_s, 1),
    }


def paddle_python() -> str:
    """Python 3.10 when the host has one that runs (the Paddle image's), else this interpreter.
    pyenv's shims exist for versions that are not selected, so each candidate is tried."""
    candidates = [shutil.which("python3.10")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10.*/bin/python3.10")))
    for candidate in filter(None, candidates):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            found = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if found.stdout.strip() == "True":
                return candidate
    return sys.executable


def cu12_note(output: str) -> str | None:
    markers = (
        "NameResolutionError",
        "Failed to resolve",
        "Connection refused",
        "No matching distribution",
        "Could not find a version",
        "Could not fetch URL",
        "Failed to establish",
        "Name or service not known",
        "Temporary failure in name",
        "timed out",
        "ProxyError",
        "SSLError",
        "Network is unreachable",
    )
    hit = next((m for m in markers if m in output), None)
    if hit is None:
        return None
    return (
        f"Paddle 2.6's CUDA 12 build (paddlepaddle-gpu==2.6.2.post120) is published only on "
        f"Paddle's own package index ({cu12_index()}), not on the default index, and this "
        f"machine could not get it from there ({hit}). Point GPU_CHECK_PADDLE_CU12_INDEX at a "
        "mirror, or use the CUDA 12 image (README: PADDLE_BASE_IMAGE)."
    )


def cu12_index() -> str:
    return os.environ.get("GPU_CHECK_PADDLE_CU12_INDEX", PADDLE_CU12_INDEX)


HOPPER = (9, 0)


def paddle_order(capability: str | None) -> tuple[list[str], str]:
    """The Paddle builds to try, in order, and why: GPU_CHECK_PADDLE_BUILDS when set, else by
    the GPU's compute capability (nvidia-smi's, e.g. "9.0")."""
    given = os.environ.get("GPU_CHECK_PADDLE_BUILDS")
    if given:
        return [b.strip() for b in given.split(",") if b.strip()], "GPU_CHECK_PADDLE_BUILDS"
    try:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
    except ValueError:
        return ["cu118", "cu120"], (
            f"compute capability unknown ({capability!r}): the image's CUDA 11.8 build first"
        )
    if (major, minor) >= HOPPER:
        return ["cu120", "cu118"], (
            f"compute capability {major}.{minor} >= 9.0: Paddle 2.6 ships sm_90 kernels only in "
            "its CUDA 12 builds (the 11.8 build passes run_check() on Hopper, then aborts in "
            "training), so the CUDA 12.0 build first"
        )
    return ["cu118", "cu120"], (
        f"compute capability {major}.{minor} < 9.0: the CUDA 11.8 build (the image's) has its "
        "kernels, so it first"
    )


def setup_paddle(ctx: Context, build_info: dict, capability: str | None = None) -> dict:
    """Dry-run: .venv-paddle (the CPU build). GPU: the builds in ``paddle_order``; the first
    whose probe runs on this GPU is the one."""
    if not ctx.plan.gpu:
        build_info["order"], build_info["chosen_by"] = [], "dry-run: make setup's CPU build"
        return _setup_paddle_dry(ctx, build_info)
    order, why = paddle_order(capability)
    build_info["order"], build_info["chosen_by"] = order, why
    failures: list[str] = []
    for build in order:
        if build not in PADDLE_BUILDS:
            failures.append(
                f"{build}: unknown (GPU_CHECK_PADDLE_BUILDS takes {list(PADDLE_BUILDS)})"
            )
            continue
        result = _try_paddle_build(ctx, build, build_info, failures)
        if result is not None:
            return result
    ctx.python["paddle"] = None
    raise RuntimeError("no Paddle build ran a GPU op here: " + "; ".join(failures))


def _setup_paddle_dry(ctx: Context, build_info: dict) -> dict:
    """The dry-run's Paddle: make setup's .venv-paddle (the CPU build), probed on the CPU."""
    existing = ROOT / ".venv-paddle" / "bin" / "python"
    if not existing.exists():
        raise RuntimeError(".venv-paddle/bin/python is missing: run `make setup` first")
    ctx.python["paddle"] = str(existing)
    # The GPU mode's library links, made here from the torch venv's NVIDIA wheels into the
    # work folder, so that code runs too (the CPU build loads none of them).
    env, linked = cuda_lib_env(ROOT / ".venv-torch", ctx.work / "cuda-libs")
    ctx.env["paddle"] = {k: v for k, v in env.items() if k == "CUDA_MODULE_LOADING"}
    result, facts = probe(ctx, "setup.paddle", "paddle")
    attempt = {
        "build": "existing .venv-paddle",
        "status": "ok",
        "cuda_libs_linked": len(linked),
    }
    failure = probe_failure(result, facts)
    if failure:
        attempt.update(status="error", error=failure)
    build_info["attempts"].append(attempt)
    if failure:
        raise RuntimeError(failure)
    build_info.update(
        ran=f"paddlepaddle {facts.get('version')} (CPU build, dry-run)", **_build_facts(facts)
    )
    return _setup_result({"venv": ".venv-paddle", "installed": "existing (dry-run)"}, facts, result)


def _try_paddle_build(
    ctx: Context, build: str, build_info: dict, failures: list[str]
) -> dict | None:
    """Install one Paddle build (GPU mode) and probe it: its setup result when the probe's ops
    ran, else None, with the attempt in ``build_info`` and the reason added to ``failures``."""
    requirements, index_kind, label = PADDLE_BUILDS[build]
    attempt: dict = {
        "build": build,
        "package": label,
        "source": cu12_index() if index_kind else "default package index",
    }
    build_info["attempts"].append(attempt)
    venv = CACHE / f"venv-paddle-{build}"
    name = f"setup.paddle.{build}"
    try:
        python, got = ensure_installed(
            ctx,
            name,
            paddle_python(),
            venv,
            [requirements, "requirements/remote.txt"],
            cu12_index() if index_kind else None,
        )
    except InstallError as error:
        attempt.update(status="error", error=str(error), **error.info)
        note = cu12_note(error.output) if index_kind else None
        if note:
            attempt["note"] = note
            build_info["note"] = note
        failures.append(f"{build}: install failed: {error}")
        return None
    attempt.update(got)
    env, linked = cuda_lib_env(venv, venv / "cuda-libs")
    attempt["cuda_libs_linked"] = len(linked)
    ctx.python["paddle"], ctx.env["paddle"] = python, env
    result, facts = probe(ctx, name, "paddle")
    failure = probe_failure(result, facts)
    attempt.update({k: facts[k] for k in ("version", "cuda", "cudnn", "ops") if k in facts})
    if failure is None:
        attempt["status"] = "ok"
        build_info.update(ran=f"{label} ({build})", **_build_facts(facts))
        if failures:
            build_info["note"] = f"fell back to the {build} build: " + "; ".join(failures)
        return _setup_result(dict(got), facts, result)
    attempt.update(status="error", error=failure)
    failures.append(f"{build}: {failure}")
    say(f"{name}: cannot run GPU ops ({failure})")
    return None


BUILD_FACTS = (
    "version",
    "compiled_with_cuda",
    "cuda",
    "cudnn",
    "cudnn_runtime",
    "device_name",
    "capability",
)


def _build_facts(facts: dict) -> dict:
    return {k: facts.get(k) for k in BUILD_FACTS}
