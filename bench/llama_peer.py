"""The llama.cpp peer, run by ``.bench/llama-venv/bin/python`` (``make bench-peers``)
as a subprocess of bench/bench_engine.py; it imports only llama_cpp and the standard library.

Usage: ``llama_peer.py '{"model": PATH, "threads": 2, "extra_bufts": true}'``. It loads
the GGUF, prints one JSON line ``{"ready_s", "version", "system_info", "extra_bufts"}``, then
answers each request
line ``{"prompt": [token ids], "max_tokens": N}`` on stdin with
``{"stamps": [seconds after the request began at which token i was sampled]}``.
Greedy (temperature 0, top-k 1), no EOS stop, and a fresh context every request
(no prefix reuse). llama.cpp's own prints go to stderr, so stdout stays the protocol.

``"extra_bufts": false`` turns off llama.cpp's extra buffer types (the CPU repack and
AMX buffers): llama-cpp-python 0.3.36 built on an AMX Xeon segfaults on its first decode
with them for Q4_1 (issue 34), and its ``Llama()`` has no keyword for the model parameter
``use_extra_bufts``, so the default parameters are patched before the load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO


def protocol_stream() -> TextIO:
    """A private copy of stdout for the JSON lines; fd 1 itself then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def load(model: str, threads: int, extra_bufts: bool = True) -> Any:
    import llama_cpp
    from llama_cpp import Llama

    if not extra_bufts:
        default_params = llama_cpp.llama_model_default_params

        def without_extra_bufts() -> Any:
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = without_extra_bufts
    return Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                 seed=0, verbose=False)


def generate(llm: Any, prompt: list[int], max_tokens: int) -> list[float]:
    """Times at which each of ``max_tokens`` tokens was sampled: ``stamps[0]`` is the
    prefill; each later gap is one decode step (the previous token's eval plus sampling)."""
    llm.reset()
    stamps: list[float] = []
    start = time.perf_counter()
    for _token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter() - start)
        if len(stamps) >= max_tokens:
            break
    return stamps


def main() -> int:
    args = json.loads(sys.argv[1])
    out = protocol_stream()
    import llama_cpp

    start = time.perf_counter()
    extra_bufts = bool(args.get("extra_bufts", True))
    llm = load(args["model"], int(args["threads"]), extra_bufts)
    info = llama_cpp.llama_print_system_info()
    out.write(json.dumps({"ready_s": time.perf_counter() - start, "version": llama_cpp.__version__,
                          "system_info": info.decode() if isinstance(info, bytes) else str(info),
                          "extra_bufts": extra_bufts}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        out.write(json.dumps({"stamps": generate(llm, request["prompt"], int(request["max_tokens"]))}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
