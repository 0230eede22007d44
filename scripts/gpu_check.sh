#!/usr/bin/env bash
# The first GPU run in two commands; what they measure and how to read them:
# docs/first_gpu_run.md.
#
#   bash scripts/gpu_check.sh setup   # installs the venvs (.cache/gpu-check/), probes them on the
#                                     # GPU, writes the data: at most 5 minutes; a second call
#                                     # with everything in place returns in seconds
#   bash scripts/gpu_check.sh run     # the measurements, most important first: at most 7 minutes
#   bash scripts/gpu_check.sh run --only 'amp.*,smoke.*'   # only these checks (a cut run's tail)
#   bash scripts/gpu_check.sh         # both, one after the other (over 10 minutes on a cold host)
#   bash scripts/gpu_check.sh setup --dry-run && bash scripts/gpu_check.sh run --dry-run
#                                     # the same code paths on the CPU with the existing
#                                     # .venv-torch and .venv-paddle (make setup); no installs
#
# A host with one NVIDIA GPU, Python 3.10/3.11, pip and the package index; nothing else. Every
# check runs as a child process (a failing one is recorded and the next one runs). Each command
# prints ONE JSON object on stdout and writes it, with a short Markdown table, to
# runs/gpu-check/gpu_check.{setup,run}.{json,md} after every check (a budget cut keeps what was
# measured); progress goes to stderr, logs to runs/gpu-check/logs/.
# Exit 0: every check ran (each one's status, ok or error, is in the JSON); 3: some were skipped
# (the budget, or a missing compiler: each says why); 1: the script broke, or `run` found no
# setup.
# Environment: PYTHON (the interpreter that runs the check and makes the torch venv; default
# python3), GPU_CHECK_SETUP_BUDGET_S (default 290), GPU_CHECK_BUDGET_S (run, default 420),
# GPU_CHECK_PADDLE_BUILDS (e.g. cu118,cu120: the order in which Paddle builds are tried; default:
# by the GPU's compute capability), GPU_CHECK_PADDLE_CU12_INDEX (where the CUDA 12 build comes
# from).
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
exec "$PYTHON" -m scripts.gpu_check "$@"  # the package scripts/gpu_check/, from the repository root
