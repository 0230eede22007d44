#!/usr/bin/env bash
# The first GPU run in one command; what it measures and how to read it: docs/first_gpu_run.md.
#
#   bash scripts/gpu_check.sh > gpu_check.json   # a host with one NVIDIA GPU, Python 3.10/3.11,
#                                                # pip and the package index; nothing else
#   bash scripts/gpu_check.sh --dry-run          # the same code paths on the CPU with tiny step
#                                                # counts and the existing .venv-torch and
#                                                # .venv-paddle (make setup); no installs
#
# It installs its venvs under .cache/gpu-check/ (reused by later runs), runs every check as a
# child process (a failing check is recorded and the next one runs) and prints ONE JSON object on
# stdout; progress goes to stderr, logs to runs/gpu-check/logs/.
# Exit 0: every check ran (each one's status, ok or error, is in the JSON); 3: the time budget
# (GPU_CHECK_BUDGET_S, default 470 s) left some checks skipped; 1: the script itself broke.
# Environment: PYTHON (the interpreter that runs the check and makes the torch venv; default
# python3), GPU_CHECK_BUDGET_S, GPU_CHECK_PADDLE_BUILDS (default cu118,cu120: the order in which
# Paddle builds are tried), GPU_CHECK_PADDLE_CU12_INDEX (where the CUDA 12 build comes from).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: $PYTHON not found; set PYTHON=/path/to/python3.10 (or 3.11)" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "gpu_check: $PYTHON is $("$PYTHON" --version 2>&1); it needs Python 3.10 or newer" >&2
    exit 1
fi
exec "$PYTHON" scripts/gpu_check "$@"  # the package scripts/gpu_check/, run by its __main__.py
