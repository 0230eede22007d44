"""Entry point: ``python -m scripts.gpu_check ARGS`` from the repository root (what
scripts/gpu_check.sh runs). A first argument starting with "_" is a helper command (helpers.py),
run by the orchestrator with a framework's interpreter; anything else is the check itself
(cli.py).

The project is not installed on a borrowed host: running as a module from the repository root is
what makes ``scripts`` (and, in the helpers, ``train`` and ``datasets``) importable.
"""

from __future__ import annotations

import sys

if not __package__:
    sys.exit(
        "scripts/gpu_check is a package: run `bash scripts/gpu_check.sh` or, from the "
        "repository root, `python -m scripts.gpu_check`"
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        from .helpers import helper_main

        return helper_main(sys.argv[1:])
    from .cli import main as check_main

    return check_main()


if __name__ == "__main__":
    sys.exit(main())
