"""What the check runs on: the interpreters it is given, nothing installed from a network.

``--python`` is the host's own PyTorch (a GPU host's preinstalled stack, or make setup's
.venv-torch in the dry-run); ``--wheelhouse DIR`` adds the few packages such a host lacks
(make gpu-wheelhouse), installed with --no-index into a scratch folder of the work folder that
goes first on the children's PYTHONPATH. ``--paddle-python`` (default: the same interpreter) runs
the Paddle checks only where a Paddle build imports there, and in GPU mode only a CUDA build that
can run on this GPU: otherwise they are skipped, saying why.
"""

from __future__ import annotations

import os
from pathlib import Path

from .context import Context, RunResult

# The torch side's imports that a preinstalled GPU host may lack (requirements/gpu-wheelhouse.txt)
# besides the ones every such stack has; the probe names each one it cannot import.
WHEELHOUSE_HINT = (
    "bring them: `make gpu-wheelhouse PY=<the host's Python, e.g. 3.12>` on a machine with a "
    "package index, carry .cache/gpu-wheelhouse/py<PY>/ along, and pass --wheelhouse DIR"
)


class SetupError(RuntimeError):
    """A set-up failed; ``info`` says how far it got (the probe's facts)."""

    def __init__(self, message: str, info: dict) -> None:
        super().__init__(message)
        self.info = info


class NotHere(Exception):
    """What a check needs is not on this host (no Paddle build): skipped, not failed."""


def install_wheelhouse(ctx: Context, python: str, wheelhouse: Path) -> dict:
    """The wheels of ``wheelhouse`` into WORK/site with pip's --no-index (nothing from a
    network), for ``python``'s children; what was installed."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise SetupError(f"no *.whl in the wheelhouse {wheelhouse}: {WHEELHOUSE_HINT}", {})
    target = ctx.work / "site"
    cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--disable-pip-version-check", "--no-input", "--upgrade", "--target", str(target)]
    result = ctx.spawn("setup.wheelhouse", [*cmd, *map(str, wheels)], timeout_s=120)
    if not result.ok:
        raise SetupError(f"installing the wheelhouse failed: {result.failure()}", {})
    pythonpath = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    for framework in ctx.python:
        if ctx.python[framework] == python:
            ctx.env[framework]["PYTHONPATH"] = pythonpath
    return {
        "dir": str(wheelhouse),
        "wheels": [w.name for w in wheels],
        "bytes": sum(w.stat().st_size for w in wheels),
        "target": str(target),
        "elapsed_s": round(result.elapsed_s, 1),
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


def _result(facts: dict, result: RunResult) -> dict:
    return {
        "status": "ok",
        "python": None,
        **{k: v for k, v in facts.items() if k != "ok"},
        "elapsed_s": round(result.elapsed_s, 1),
    }


def setup_torch(ctx: Context) -> dict:
    """The given interpreter's torch, probed on the device (its ops and a training step) and
    asked for the project's other imports."""
    result, facts = probe(ctx, "setup.torch", "torch")
    if facts.get("missing_imports"):
        missing = ", ".join(facts["missing_imports"])
        raise SetupError(f"{ctx.python['torch']} cannot import {missing}: {WHEELHOUSE_HINT}", facts)
    failure = probe_failure(result, facts)
    if failure:
        raise SetupError(failure, {k: v for k, v in facts.items() if k not in ("ok", "error")})
    return {**_result(facts, result), "python": ctx.python["torch"]}


def setup_paddle(ctx: Context) -> dict:
    """The Paddle build of --paddle-python, when there is one that can train here: NotHere (its
    checks skipped) where Paddle does not import or, on a GPU, is the CPU build; SetupError where
    the build cannot run on this GPU (a CUDA 11.x build on Hopper and newer), naming the fix."""
    result, facts = probe(ctx, "setup.paddle", "paddle")
    python = ctx.python["paddle"]
    if facts.get("import_error"):
        raise NotHere(
            f"no Paddle in {python} ({facts['import_error']}): the Paddle checks need a Paddle "
            "GPU build; give its interpreter with --paddle-python (Paddle's GPU wheels are too "
            "large to carry to a host without a package index)"
        )
    if ctx.plan.gpu and facts.get("compiled_with_cuda") is False:
        raise NotHere(f"{python} has Paddle's CPU build ({facts.get('version')}): no GPU to check")
    blocker = facts.get("arch_problem")
    if blocker and blocker.get("fatal"):
        raise SetupError(f"{blocker['reason']}; fix: {blocker['fix']}", _info(facts))
    failure = probe_failure(result, facts)
    if failure:
        raise SetupError(failure, _info(facts))
    return {**_result(facts, result), "python": python}


def _info(facts: dict) -> dict:
    return {k: v for k, v in facts.items() if k not in ("ok", "error")}


BUILD_FACTS = (
    "version",
    "compiled_with_cuda",
    "cuda",
    "cudnn",
    "cudnn_runtime",
    "device_name",
    "capability",
)


def build_facts(check: dict) -> dict:
    return {k: check.get(k) for k in BUILD_FACTS}
