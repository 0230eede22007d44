#!/usr/bin/env bash
# The first GPU run in one command, on the PyTorch the GPU host already has; what it measures and
# how to read it: docs/first_gpu_run.md.
#
#   bash scripts/gpu_check.sh --python "$(command -v python3)" --wheelhouse .cache/gpu-wheelhouse/py3.12
#                                 # a host with one NVIDIA GPU: at most 9 minutes, data included
#   bash scripts/gpu_check.sh --python PY --only 'amp.*,smoke.*'   # only these (a cut run's tail)
#   bash scripts/gpu_check.sh --dry-run   # the same code paths on the CPU with make setup's venvs
#
# Installs nothing from a network: --python's torch runs the torch checks, --paddle-python's Paddle
# (default: the same interpreter) the Paddle ones, which are skipped where no Paddle GPU build
# imports; --wheelhouse DIR (make gpu-wheelhouse PY=3.12) brings the few packages such a host
# lacks, installed with --no-index into OUT/site. Every check runs as a child process (a failing
# one is recorded and the next one runs). Prints ONE JSON object on stdout, then a short summary
# as the last lines, and writes the JSON with a Markdown table to OUT/gpu_check.{json,md} after
# every check (a budget cut keeps what was measured); progress goes to stderr, logs to OUT/logs/.
# Exit 0: every check ran (each one's status, ok or error, is in the JSON); 3: some were skipped
# (the budget, --only, no Paddle build, a missing compiler: each says why); 1: the script broke.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The orchestrator runs on --python's interpreter (standard library only), else python3.
PYTHON=python3
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --python) PYTHON="${args[i + 1]:-}" ;;
        --python=*) PYTHON="${args[i]#--python=}" ;;
    esac
done
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: $PYTHON not found; give the interpreter that has the host's torch:" \
         "--python /path/to/python3" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "gpu_check: $PYTHON is $("$PYTHON" --version 2>&1); it needs Python 3.10 or newer" >&2
    exit 2
fi
exec "$PYTHON" -m scripts.gpu_check "$@"  # the package scripts/gpu_check/, from the repository root
