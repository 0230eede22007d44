#!/usr/bin/env bash
# The first GPU run in one command, on the host's own PyTorch: docs/first_gpu_run.md.
#
#   bash scripts/gpu_check.sh --python "$(command -v python3)" --wheelhouse .cache/gpu-wheelhouse/py3.12
#   bash scripts/gpu_check.sh --python PY --only 'amp.*,smoke.*'   # only these (a cut run's tail)
#   bash scripts/gpu_check.sh --dry-run   # the same code paths on the CPU with make setup's venvs
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=python3  # the orchestrator runs on --python's interpreter (standard library only)
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
exec "$PYTHON" -m scripts.gpu_check "$@"  # the package scripts/gpu_check/, from the root
