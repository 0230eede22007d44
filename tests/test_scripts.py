"""The data CLIs as a user runs them: --help, generation, validation exit codes, refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.corrupt import write_charset, write_corrupt_lmdb

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m scripts.NAME ARGS`` from the repository root, as the Makefile runs them."""
    return subprocess.run(
        [sys.executable, "-m", f"scripts.{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", ["make_synthetic", "convert", "validate_data"])
def test_help(script):
    result = run(script, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout


def test_generate_then_validate_clean(tmp_path):
    result = run(
        "make_synthetic",
        "ocr",
        "--out",
        str(tmp_path / "ocr"),
        "--num",
        "60",
        "--charset",
        "full",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 60 text lines" in result.stdout
    assert (tmp_path / "ocr" / "train" / "data.mdb").is_file()
    assert (tmp_path / "ocr" / "val" / "data.mdb").is_file()
    check = run(
        "validate_data",
        str(tmp_path / "ocr"),
        "--char-dict",
        str(tmp_path / "ocr" / "charset.txt"),
        "--quiet",
    )
    assert check.returncode == 0 and check.stdout.splitlines()[-1].startswith("0 bad of 60")
    h5 = run(
        "make_synthetic",
        "imagenet",
        "--out",
        str(tmp_path / "i.h5"),
        "--num",
        "8",
        "--classes",
        "2",
        "--quiet",
    )
    assert h5.returncode == 0 and "KB/image" in h5.stdout
    again = run(
        "make_synthetic",
        "imagenet",
        "--out",
        str(tmp_path / "i.h5"),
        "--num",
        "8",
        "--quiet",
    )
    assert (
        again.returncode == 2 and "already exists" in again.stderr and "--overwrite" in again.stderr
    )
    assert run("validate_data", str(tmp_path / "i.h5"), "--quiet").returncode == 0


def test_validate_reports_bad_keys_and_exits_nonzero(tmp_path):
    path, expected = write_corrupt_lmdb(tmp_path / "bad")
    charset = write_charset(tmp_path / "charset.txt")
    result = run(
        "validate_data",
        str(path),
        "--char-dict",
        str(charset),
        "--quiet",
        "--bad-keys-out",
        str(tmp_path / "bad.tsv"),
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[-1] == f"9 bad of 12 records in {path}"
    kinds = sorted(line.split("\t")[1] for line in lines[:-1])
    assert kinds == sorted(k for k, n in expected.items() for _ in range(n))
    assert (tmp_path / "bad.tsv").read_text().count("\n") == 9


def test_validate_wrong_path_is_one_clear_line(tmp_path):
    result = run("validate_data", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: dataset path does not exist")
    assert "Traceback" not in result.stderr


def test_every_project_import_in_the_scripts_resolves_from_the_root():
    """The scripts run as modules (``python -m scripts.NAME``), so a script imports a sibling as
    ``scripts.NAME``: a bare ``import NAME`` worked only while the script's own folder was first
    on sys.path. Imports inside functions count too (a --help run never reaches them)."""
    import ast

    project = {"train", "datasets", "bench", "scripts"}
    siblings = {path.stem for path in (ROOT / "scripts").rglob("*.py")}
    wrong = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                if top in siblings and top not in project:
                    wrong.append(f"{where} (a sibling: import it as scripts.{name})")
                elif top in project and not _module_file(name).exists():
                    wrong.append(f"{where} (not found from the repository root)")
    assert wrong == [], wrong


def _module_file(dotted: str) -> Path:
    """Where ``dotted`` lives under the repository root (its module file or its package's
    __init__.py), found without importing it (a backend's package imports its framework)."""
    path = ROOT.joinpath(*dotted.split("."))
    package = path / "__init__.py"
    return package if package.exists() else path.with_suffix(".py")
