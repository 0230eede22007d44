"""datasets/ must never import a framework: both images share it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "torchvision", "paddle", "paddleocr", "ppocr")


def test_no_framework_import_statement():
    offenders = []
    for path in sorted((ROOT / "datasets").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FRAMEWORKS]
    assert offenders == []


def test_importing_every_module_loads_no_framework():
    modules = [p.stem for p in (ROOT / "datasets").glob("*.py") if p.stem != "__init__"]
    code = (
        "import sys\n"
        + "".join(f"import datasets.{m}\n" for m in modules)
        + f"bad = [m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}]\n"
        + "assert not bad, bad\nprint(len(sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
