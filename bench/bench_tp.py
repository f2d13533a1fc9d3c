"""Tensor parallelism on this CPU: TP=1 against TP=N on the same model and workload,
read from the engine's own events (printed, not asserted).

Replicas: the bundled SmolLM2 in float32 at TP=1 and TP=3 (9 query heads, 3 KV heads),
and a dummy-weight Llama whose heads divide by 2 at TP=1 and TP=2 (``--load-format
dummy``). Workload: ``--prompts`` requests of ``--input-len`` random tokens generating
``--output-len`` each (EOS ignored), all submitted at once.

Per replica: startup (launch of the engine to phase G on every rank; the slowest rank's
phases are the replica's), output tok/s over the run, the median step time of
pure-decode steps, the median time those steps spent in collectives (``collective_s``
of the step events: the all-reduces and the logits gather, rank 0's clock), and the
all-reduce count and bytes per step against the seed's statement that tensor
parallelism pays an all-reduce inside every layer (2 per layer here: after O and after
down, plus one for the vocab-parallel embedding). On a CPU the ranks share the same
cores and memory bandwidth, so TP>1 is slower: the point is the size of the tax.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.greedy_run import greedy_run
from bench.machine import header_lines
from engine.config import EngineConfig
from engine.events import StartupPhase, StepEvent
from engine.modelspec.readers import load_model_config

# Heads, KV heads and MLP columns divide by 2; ~120 M parameters, 490 MB in fp32.
DUMMY_LLAMA = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
               "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 49152,
               "max_position_embeddings": 2048, "torch_dtype": "float32", "tie_word_embeddings": True,
               "bos_token_id": 1, "eos_token_id": 2}


def run_replica(model: str, tp: int, load_format: str, prompts: list[list[int]], output_len: int,
                threads: int | None = None) -> dict[str, object]:
    config = EngineConfig(model=model, tensor_parallel_size=tp, dtype="float32", quantization="none",
                          load_format=load_format, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=64,
                          kv_cache_memory_bytes=256 << 20, stats_interval=0.0, num_threads=threads)
    run = greedy_run(config, prompts, output_len)
    events, generated, ran = run.events, run.generated, run.run_s
    steps = [e for e in events if isinstance(e, StepEvent) and e.scheduled]
    decodes = [s for s in steps if s.num_prefill_tokens == 0]
    phases = [e for e in events if isinstance(e, StartupPhase) and e.status == "end"]
    per_rank = {rank: round(sum(e.duration_s or 0.0 for e in phases if e.rank == rank), 2)
                for rank in sorted({e.rank for e in phases})}
    layers = load_model_config(model).num_layers
    median = statistics.median
    return {
        "model": Path(model).name, "tp": tp, "threads_per_rank": threads or max(1, (os.cpu_count() or 1) // tp), "startup_s": round(run.startup_s, 2), "phases_s_by_rank": per_rank,
        "output_tok_s": round(generated / ran, 1), "run_s": round(ran, 2), "steps": len(steps),
        "decode_step_ms": round(median(s.duration_s for s in decodes) * 1e3, 1) if decodes else None,
        "decode_collective_ms": round(median(s.collective_s for s in decodes) * 1e3, 1) if decodes else None,
        "collective_share": round(sum(s.collective_s for s in steps) / max(1e-9, sum(s.duration_s for s in steps)), 3),
        "all_reduces_per_step": (max(s.collective_calls for s in steps) - 1) if tp > 1 else 0,
        "seed_all_reduces_per_step": 2 * layers + 1 if tp > 1 else 0,
        "decode_collective_kib": round(median(s.collective_bytes for s in decodes) / 1024, 1) if decodes else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--only", choices=["smollm", "dummy"], default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: all cores at TP=1, cores / N per rank at TP=N)")
    args = parser.parse_args(argv)
    for line in header_lines():
        print(line)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (args.input_len,), generator=generator).tolist() for _ in range(args.prompts)]
    print(f"workload: {args.prompts} requests x {args.input_len} prompt tokens, {args.output_len} generated, "
          "greedy, all at once; float32, --quantization none")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        dummy = Path(folder) / "dummy-llama-12l"
        dummy.mkdir()
        (dummy / "config.json").write_text(json.dumps(DUMMY_LLAMA))
        replicas = []
        if args.only in (None, "smollm"):
            replicas += [("smollm2-135m", 1, "auto"), ("smollm2-135m", 3, "auto")]
        if args.only in (None, "dummy"):
            replicas += [(str(dummy), 1, "dummy"), (str(dummy), 2, "dummy")]
        for model, tp, load_format in replicas:
            row = run_replica(model, tp, load_format, prompts, args.output_len, args.threads)
            rows.append(row)
            print(json.dumps(row))
    print()
    print("| model | TP | startup s | output tok/s | decode step ms | of it in collectives ms | "
          "all-reduces/step (seed: 2 per layer + 1) | collective KiB per decode step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['startup_s']} | {r['output_tok_s']} | {r['decode_step_ms']} | "
              f"{r['decode_collective_ms']} | {r['all_reduces_per_step']} ({r['seed_all_reduces_per_step']}) | "
              f"{r['decode_collective_kib']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
