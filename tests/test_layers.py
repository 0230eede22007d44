"""The product stands on its own: nothing in datasets/, train/, bench/ or scripts/ imports a test
module or runs a file under tests/ (a user's checkout, or an image, may leave tests out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("datasets", "train", "bench", "scripts")


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def uses_of_tests(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            found.append(node.module)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("tests/")
            and node.value.endswith(".py")
        ):
            found.append(node.value)  # a path to a test file, built to be run
    return found


def test_no_product_module_imports_or_runs_the_tests():
    modules = product_modules()
    assert len(modules) > 50, "the product packages were not found"
    offenders = {
        str(path.relative_to(ROOT)): uses for path in modules if (uses := uses_of_tests(path))
    }
    assert offenders == {}
