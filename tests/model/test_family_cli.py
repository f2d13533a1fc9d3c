"""Every registered dense family runs where Llama does, from a tiny HF folder built here with
transformers (tests/model/tiny_hf.py): ``engine plan --model DIR`` counts its parameters as
transformers does (default suite, in-process), and ``engine generate`` prints transformers'
greedy text, ``engine serve`` answers /v1/completions with it, and ``engine run-workload``
finishes its requests (slow: three engine starts per family); Mistral, Phi-3 and Qwen2 run
on two tensor-parallel ranks (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench.bench_server import free_port, start_server, stop_server
from engine.cli import main
from engine.events import read_events
from tests.model.tiny_hf import save_tiny_checkpoint, tiny_config
from tests.paths import ROOT

# one variant per family the registry serves from an HF folder (Llama via its llama3 scaling)
FAMILY_VARIANTS = ("qwen2-untied", "qwen3-tied", "gemma3-tied", "llama3-scaled", "mistral-sliding", "phi3-sliding")
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny-families")
    return {v: (root / v, save_tiny_checkpoint(v, root / v)) for v in FAMILY_VARIANTS}


def greedy_text(folder: Path, model: Any) -> str:
    """transformers' greedy continuation of PROMPT, decoded by the folder's tokenizer."""
    from engine.model.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_folder(folder)
    ids = list(tokenizer.encode(PROMPT))
    start = len(ids)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tokenizer.decode(ids[start:])


def test_plan_counts_every_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``engine plan`` reads config.json alone: each family's folder holds just that, and
    transformers' model of it is built on the meta device (no weights)."""
    pytest.importorskip("transformers")
    import transformers

    for variant in FAMILY_VARIANTS:
        config = tiny_config(variant)
        config.save_pretrained(str(tmp_path / variant))
        with torch.device("meta"):
            expected = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        assert main(["plan", "--model", str(tmp_path / variant), "--json"]) == 0, variant
        assert json.loads(capsys.readouterr().out)["num_parameters"] == expected, variant


def run_engine(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_generate_serve_and_run_workload_run_every_family(variant: str, folders: dict[str, tuple[Path, Any]],
                                                          tmp_path: Path) -> None:
    folder, model = folders[variant]
    expected = greedy_text(folder, model)
    common = ("--model", str(folder), "--dtype", "float32", "--max-model-len", "128")

    done = run_engine("generate", *common, "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS), "--temperature", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip("\n") == expected

    events = tmp_path / "run.jsonl"
    done = run_engine("run-workload", *common, "--num-prompts", "6", "--random-input-len", "8:24",
                      "--random-output-len", "4:12", "--events", str(events))
    assert done.returncode == 0, done.stderr[-3000:]
    finished = [e for e in read_events(events).events if e.type == "request.finished"]
    assert len(finished) == 6

    port = free_port()
    server = start_server(port, *common, log_path=tmp_path / "serve.log")
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": str(folder), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})
    finally:
        assert stop_server(server) == 0
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen2-untied", "mistral-sliding", "phi3-sliding"])
def test_tensor_parallel_generates_transformers_text(variant: str, folders: dict[str, tuple[Path, Any]]) -> None:
    """Two ranks (parallel_llama: Phi-3's fused tensors split at load before they are sharded,
    Mistral's window on each rank's KV heads) print transformers' greedy text; Qwen3 and Gemma 3
    are refused (their layers have no tensor-parallel version)."""
    folder, model = folders[variant]
    done = run_engine("generate", "--model", str(folder), "--dtype", "float32", "--max-model-len", "128",
                      "--quantization", "none", "--tensor-parallel-size", "2", "--prompt", PROMPT,
                      "--max-tokens", str(NEW_TOKENS), "--temperature", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip("\n") == greedy_text(folder, model)
