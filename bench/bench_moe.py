"""One Qwen3-30B-A3B MoE layer's experts on this CPU (128 experts of 768, hidden 2048, top-8, bf16
weights: 1.1 GiB), at 1, 16 and 256 tokens: kvscope's grouped experts (engine/model/layers/moe.py: sort by
expert, one matmul pair per active expert) against transformers' eager experts (a loop over active
experts with a one-hot mask) and a per-token loop (each token's k experts one by one), median of
interleaved rounds, with the experts each step touches and the GB/s of the expert weights read.

    .venv/bin/python -m bench.bench_moe [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from engine.model.layers.moe import grouped_experts, route

HIDDEN, EXPERTS, WIDTH, TOP_K = 2048, 128, 768, 8


def per_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """The naive loop the grouped path replaces: every token's k experts one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = F.linear(x[t:t + 1], w13[e])
            out[t] += weights[t, j] * F.linear(F.silu(gate_up[:, :WIDTH]) * gate_up[:, WIDTH:], w2[e])[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    dtype = torch.bfloat16
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K)
    config._experts_implementation = "eager"
    hf = Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.02)
        hf.down_proj.normal_(0, 0.02)
    router = torch.randn(EXPERTS, HIDDEN, dtype=dtype) * 0.02
    w13, w2 = hf.gate_up_proj.detach(), hf.down_proj.detach()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(f"threads {torch.get_num_threads()}, bf16 weights {EXPERTS * expert_bytes / 2**30:.2f} GiB\n")
    print("| tokens | experts touched | grouped ms | transformers eager ms | per-token loop ms | grouped GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tokens in (1, 16, 256):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        with torch.inference_mode():
            weights, ids = route(x, router, TOP_K, True)
            calls: dict[str, Callable[[], object]] = {
                "grouped": partial(grouped_experts, x, w13, w2, weights, ids),
                "hf": partial(hf, x, ids, weights),
            }
            if tokens <= 16:
                calls["loop"] = partial(per_token, x, w13, w2, weights, ids)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            ours, reference = grouped_experts(x, w13, w2, weights, ids)[0], hf(x, ids, weights)
            assert float((ours.float() - reference.float()).abs().max()) < 1e-2
        touched = int(torch.unique(ids).numel())
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        loop = f"{med['loop']:.1f}" if "loop" in med else "-"
        print(f"| {tokens} | {touched} | {med['grouped']:.1f} | {med['hf']:.1f} | {loop} | "
              f"{touched * expert_bytes / (med['grouped'] / 1e3) / 1e9:.1f} |")


if __name__ == "__main__":
    main()
