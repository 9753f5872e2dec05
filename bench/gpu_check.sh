#!/usr/bin/env bash
# The CUDA checks in one run, <= 8 minutes on one GPU (bench/gpu_check.py says what and why).
#   bash bench/gpu_check.sh OUTDIR              # exit 0: every goal met; 1: one missed; 69: no CUDA
#   bash bench/gpu_check.sh --dry-run OUTDIR    # the same plan on the CPU, tiny sizes (the suite runs it)
# PYTHON=... chooses the interpreter (default: the checkout's .venv, else python3).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" "$REPO/bench/gpu_check.py" "$@"
