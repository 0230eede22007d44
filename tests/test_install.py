"""The project installs: ``pip install --no-deps -e .`` into a fresh venv, then the packages
import, and ``python -m train`` runs, from another directory; a `datasets` that is not the
project's fails at import with the fix.

The install is of a copy of the packages and pyproject.toml, so that setuptools' egg-info is
written there rather than into the checkout (both halves of the suite run this test at once).
The fresh venv sees the running environment's site-packages through a .pth file, added after the
install, for the requirements (numpy, PyYAML, ...), which `--no-deps` leaves out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("train", "datasets", "bench", "scripts")


def _env() -> dict[str, str]:
    """This environment without PYTHONPATH: the venv must find the project by its install."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(args: list, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _can_build_offline(python: Path, cwd: Path) -> bool:
    """setuptools >= 64 builds editable wheels; before 70.1 it needs the `wheel` package too."""
    probe = (
        "import setuptools as s; v = tuple(int(p) for p in s.__version__.split('.')[:2]); "
        "import importlib.util as u; "
        "raise SystemExit(not (v >= (70, 1) or (v >= (64, 0) and u.find_spec('wheel'))))"
    )
    return _run([python, "-c", probe], cwd).returncode == 0


def _site_packages(python: Path, cwd: Path) -> Path:
    found = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd)
    assert found.returncode == 0, found.stderr
    return Path(found.stdout.strip())


def test_editable_install_runs_from_another_directory(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", project)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "data", "results")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, project / package, ignore=ignore)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    made = _run([sys.executable, "-m", "venv", tmp_path / "venv"], elsewhere)
    assert made.returncode == 0, made.stderr
    python = tmp_path / "venv" / "bin" / "python"
    install = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    if _can_build_offline(python, elsewhere):
        install += ["--no-build-isolation", "--no-index"]
    # else setuptools comes from the configured package index, in pip's isolated build env
    installed = _run([*install, "-e", project], elsewhere, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    # The requirements, from the environment running this test (after the install, so that pip
    # saw only the fresh venv's distributions).
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (_site_packages(python, elsewhere) / "zz_test_requirements.pth").write_text(
        "".join(f"{path}\n" for path in sorted(outer))
    )

    where = _run(
        [
            python,
            "-c",
            f"import {', '.join(PACKAGES)}, scripts.gpu_check, train.config; "
            f"print('\\n'.join(m.__file__ for m in ({', '.join(PACKAGES)})))",
        ],
        elsewhere,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.split() == [str(project / p / "__init__.py") for p in PACKAGES]

    help_text = _run([python, "-m", "train", "--help"], elsewhere)
    assert help_text.returncode == 0, help_text.stderr
    assert "usage: python -m train" in help_text.stdout
    # Paddle's launcher runs train/__main__.py as a file; scripts run as files too
    for script in (project / "train" / "__main__.py", project / "scripts" / "validate_data.py"):
        by_path = _run([python, script, "--help"], elsewhere)
        assert by_path.returncode == 0, f"{script}: {by_path.stderr}"
        assert "usage:" in by_path.stdout


def test_a_foreign_datasets_package_fails_at_import(tmp_path):
    foreign = tmp_path / "site" / "datasets"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("# stands in for Hugging Face's datasets\n")
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", "import train"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: `datasets` resolves to " + str(foreign)), message
    assert "HINT" in message
