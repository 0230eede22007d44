"""paddle.distributed.launch needs a writable --log_dir.

The launcher writes its workers' logs (workerlog.N, envlog.N) to ./log unless told otherwise. In
the images the working directory, /workspace, is root-owned and the trainer runs as uid 1000, so
the launcher dies before any worker starts (FileNotFoundError: 'log/workerlog.0', after
"Permission denied: 'log'"). The runtime test reproduces that from an unwritable working
directory and shows that --log_dir fixes it; the static test checks that every launcher command
in the manifests, configs, code and docs passes a log directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from train.launch import launch_command

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = "paddle.distributed.launch"
# Files that may show or run the launcher (tests build their commands with train/launch.py and
# pass its log_dir themselves: tests/test_distributed.py, tests/test_backend_paddle.py).
SCANNED = [
    "README.md",
    "docs/**/*.md",
    "configs/**/*.yaml",
    "train/**/*.py",
    "scripts/**/*",
    "docker/*",
    "compose*.yaml",
    "Makefile",
]
# A launcher invocation in prose, a shell line, a comment or a docstring.
INVOCATION = re.compile(r"-m\s+paddle\.distributed\.launch(?=\s|$)")
# Commands that run inside an image, where only the volumes are writable.
IN_CONTAINER = re.compile(r"docker (compose )?run|podman|kubectl")
DEFAULT_LOG_DIRS = {"", "log", "./log", "log/", "./log/"}


# ---------------------------------------------------------------- static: every invocation


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) with backslash continuations joined; a continuation line's
    leading comment marker is dropped (commands shown in YAML or shell comments)."""
    out, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if pending:
            line = re.sub(r"^\s*#?\s*", "", line)
        else:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def launcher_options(words: list[str]) -> list[str] | None:
    """The launcher's own options: the words between the module and the training script
    (everything after the script is the script's). None without a script (not a run)."""
    for i, word in enumerate(words):
        if word.endswith(".py"):
            return words[:i]
    return None


def log_dir_of(options: list[str]) -> str | None:
    for i, word in enumerate(options):
        if word == "--log_dir":
            return options[i + 1] if i + 1 < len(options) else ""
        if word.startswith("--log_dir="):
            return word.split("=", 1)[1]
    return None


def text_invocations() -> list[tuple[str, str, list[str]]]:
    """(where, whole command, launcher options) for each launcher run shown in SCANNED."""
    found = []
    files = sorted({p for pattern in SCANNED for p in ROOT.glob(pattern) if p.is_file()})
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in logical_lines(text):
            for match in INVOCATION.finditer(line):
                rest = line[match.end() :].split("`")[0]  # inline code in Markdown ends there
                options = launcher_options(rest.split())
                if options is not None:
                    where = f"{path.relative_to(ROOT)}:{number}"
                    found.append((where, line.strip(), options))
    return found


def test_every_launch_command_in_docs_and_code_passes_a_log_dir():
    found = text_invocations()
    assert found, f"no `python -m {LAUNCH} ... script.py` found in {SCANNED}: update this test"
    problems = []
    for where, command, options in found:
        log_dir = log_dir_of(options)
        if log_dir is None:
            problems.append(f"{where}: no --log_dir (the launcher writes ./log): {command}")
        elif log_dir in DEFAULT_LOG_DIRS:
            problems.append(f"{where}: --log_dir {log_dir!r} is the default ./log: {command}")
        elif IN_CONTAINER.search(command) and not log_dir.startswith(("/runs/", "/cache/")):
            problems.append(
                f"{where}: in a container only the volumes are writable; put --log_dir under "
                f"/runs/ (not {log_dir!r}): {command}"
            )
    assert not problems, "\n".join(problems)


def k8s_launch_containers():
    for path in sorted((ROOT / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for key, replicas in (doc or {}).get("spec", {}).items():
                if not key.endswith("ReplicaSpecs"):
                    continue
                for role, replica in replicas.items():
                    spec = replica["template"]["spec"]
                    for container in spec.get("initContainers", []) + spec["containers"]:
                        words = [str(w) for w in container.get("command", [])]
                        words += [str(w) for w in container.get("args", [])]
                        if LAUNCH in words:
                            yield f"{path.name} {doc['kind']} {role}", container, words


def test_k8s_launcher_logs_go_to_a_writable_volume():
    """--log_dir (or PADDLE_LOG_DIR, which overrides it) under a read-write volume mount; a
    $(VAR) in it is defined in the container's env; never inside a run directory that
    --overwrite would delete under the running launcher."""
    found = list(k8s_launch_containers())
    assert any("PaddleJob" in where for where, _, _ in found), "the PaddleJob runs the launcher"
    for where, container, words in found:
        env = {e["name"]: e for e in container.get("env", [])}
        options = launcher_options(words[words.index(LAUNCH) + 1 :])
        assert options is not None, f"{where}: no training script after the launcher"
        log_dir = env["PADDLE_LOG_DIR"].get("value") if "PADDLE_LOG_DIR" in env else None
        log_dir = log_dir or log_dir_of(options)
        assert log_dir not in (None, *DEFAULT_LOG_DIRS), f"{where}: pass --log_dir: {words}"
        assert log_dir.startswith("/"), f"{where}: --log_dir {log_dir} must be absolute"
        for var in re.findall(r"\$\((\w+)\)", log_dir):
            assert var in env, f"{where}: --log_dir uses $({var}), not in the container's env"
        writable = [
            m["mountPath"].rstrip("/") + "/"
            for m in container.get("volumeMounts", [])
            if not m.get("readOnly")
        ]
        assert any(log_dir.startswith(m) for m in writable), (
            f"{where}: --log_dir {log_dir} is on no read-write volume ({writable}); the rest "
            "of the image is read-only for uid 1000"
        )
        script_args = words[words.index(LAUNCH) + 1 + len(options) :]
        if "--output-dir" in script_args:
            run_dir = script_args[script_args.index("--output-dir") + 1].rstrip("/") + "/"
            assert not (
                log_dir.startswith(run_dir) and "--overwrite" in script_args
            ), f"{where}: --overwrite deletes {run_dir} with the launcher's logs in it"


# ---------------------------------------------------------------- runtime: the failure and fix

INIT_SCRIPT = """\
import paddle.distributed as dist

dist.init_parallel_env()
print(f"LAUNCH-OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
"""


def unwritable_for_children() -> list[str]:
    """A command prefix under which a mode-0555 directory really is unwritable. Root ignores
    permission bits through CAP_DAC_OVERRIDE, so as root the children run without it (and
    without CAP_DAC_READ_SEARCH): they stay uid 0, and the interpreter under /root, mode 0700,
    stays readable to them as its owner, which a switch to nobody would lose."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): cannot deny root writes")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


def launch(prefix: list[str], log_dir: Path | None, script: Path, cwd: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}
    command = [*prefix, *launch_command("paddle", sys.executable, 2, [script], log_dir=log_dir)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.paddle
def test_launch_from_an_unwritable_directory_needs_log_dir(tmp_path):
    """As in the images: cwd not writable. Without --log_dir the launcher dies before starting a
    worker; with --log_dir (nested, not yet existing, as on a fresh /runs volume) both ranks run
    and their logs land there. Two CPU ranks over gloo, about 10 s."""
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("GPUs present: paddle.distributed.launch would place ranks on them")
    script = tmp_path / "init_parallel.py"
    script.write_text(INIT_SCRIPT, encoding="utf-8")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    workspace.chmod(0o555)
    prefix = unwritable_for_children()
    try:
        probe = subprocess.run(
            [*prefix, sys.executable, "-c", "open('probe', 'w')"],
            cwd=workspace,
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            pytest.skip("cannot make a directory unwritable for this user (capabilities?)")
        assert "PermissionError" in probe.stderr, probe.stderr

        failed = launch(prefix, None, script, workspace)
        output = failed.stdout + failed.stderr
        assert failed.returncode != 0, output[-4000:]
        assert "Permission denied: 'log'" in output and "log/workerlog.0" in output, output[-4000:]
        assert "LAUNCH-OK" not in output  # no worker ran

        logs = tmp_path / "runs" / "ocr-paddlejob" / "launch-logs" / "worker-0"
        done = launch(prefix, logs, script, workspace)
        worker_logs = {p.name: p.read_text(errors="replace") for p in logs.glob("workerlog.*")}
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + str(worker_logs)
        assert "LAUNCH-OK rank 0 of 2" in worker_logs.get("workerlog.0", ""), worker_logs
        assert "LAUNCH-OK rank 1 of 2" in worker_logs.get("workerlog.1", ""), worker_logs
        assert list(workspace.iterdir()) == []
    finally:
        workspace.chmod(0o755)
