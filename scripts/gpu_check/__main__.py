"""Entry point: ``python scripts/gpu_check ARGS`` (what scripts/gpu_check.sh runs; from the
repository root ``python -m scripts.gpu_check ARGS`` works too). A first argument starting with
"_" is a helper command (helpers.py), run by the orchestrator in a framework's venv; anything
else is the check itself (cli.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def _package() -> str:
    """This package's import name. Run as a folder, there is none yet: the scripts/ folder takes
    this folder's place on sys.path (as when the check was scripts/gpu_check.py), so that it
    imports as ``gpu_check`` and its module names (plan, setup, ...) shadow nothing."""
    if __package__:
        return __package__
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    sys.path.insert(0, str(here.parent))
    return here.name


def main() -> int:
    package = _package()
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        return importlib.import_module(f"{package}.helpers").helper_main(sys.argv[1:])
    return importlib.import_module(f"{package}.cli").main()


if __name__ == "__main__":
    sys.exit(main())
