"""``python -m scripts.gpu_check ARGS`` from the repository root (scripts/gpu_check.sh), which
makes ``scripts``, ``train`` and ``datasets`` importable where the project is not installed; a
first argument starting with "_" is a helper command."""

import sys

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        from .helpers import helper_main as main
    else:
        from .cli import main
    sys.exit(main(sys.argv[1:]))
