#!/usr/bin/env bash
# `make gpu-check`: on a machine with an NVIDIA GPU, run bench/gpu_check.py (native
# kernel tests, a dummy-weights Llama-3.1-8B runner, the engine-startup hook, and a
# kernel benchmark against the torch backend) within ten minutes; results go to
# one JSON file (.bench/gpu_check.json unless --out is given). Without a GPU it
# says so and exits 0. Extra arguments are passed to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); nothing to run. On CPU the kernels are tested by 'make test-triton'."
    exit 0
fi
nvidia-smi -L
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: a GPU is present but $PYTHON's torch cannot use it (CPU-only build?); run 'make clean setup' to reinstall torch with CUDA." >&2
    exit 1
fi
unset TRITON_INTERPRET  # the point is to run the kernels natively
exec timeout --signal=INT --kill-after=20 600 "$PYTHON" -m bench.gpu_check "$@"
