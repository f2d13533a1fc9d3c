"""Qwen2/Qwen2.5 (Q/K/V bias; tied and untied LM head), Qwen3 (QK-norm, no bias), Gemma 3
(a sliding and a full layer; plain, and with the larger models' linear rope scaling), Llama 3.1's llama3 rope scaling, Mistral (every layer sliding)
and Phi-3 (fused qkv/gate_up, sliding) from tiny random-weight checkpoints built here with
transformers (tests/model/tiny_hf.py), from HF folders and (Qwen) GGUFs,
through kvscope's real path (the HF-folder config and safetensors loader, the registry's
model class, the paged KV cache on scattered blocks, chunked prefill batched with other
sequences' decodes, a preemption that frees a sequence's blocks and recomputes it into
others) against transformers' own model in float32: every logit row within
MAX_LOGIT_DIFF and the greedy tokens equal, 3 prompts x 16 tokens. The runner is driven
with token ids; the whole-engine test (LLM, scheduler preemption) reads the tiny byte-level
BPE tokenizer tests/model/tiny_hf.py trains into each folder."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.errors import UserError
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config
from tests.model.tiny_hf import VARIANTS, save_tiny_checkpoint, write_tiny_gguf

# Measured (fp32, Zen 4, 2 threads): max |logit diff| 3.2e-06 (Qwen), 5.8e-06 (Gemma 3); 1e-4 leaves room
# for another CPU's summation order, not for a missing bias or norm (those move logits by > 0.1).
MAX_LOGIT_DIFF = 1e-4
NEW_TOKENS = 16
PREEMPT_AFTER = 8  # sequence "p0" loses its blocks after this many tokens and is recomputed
CHUNK = 7  # prefill (and recompute) chunk: prompts of 9, 23 and 37 tokens take 2, 4 and 6 steps
BLOCK_SIZE = 4
NUM_BLOCKS = 64
# Variants also run from a GGUF written as llama.cpp writes it (Llama 3.1's scaling as its
# rope_freqs tensor; Gemma 3's GGUF path: the real 270M file, test_gemma3_reference.py;
# Mistral's window is dropped by llama.cpp's converter, Phi-3's GGUF is not registered).
GGUF_VARIANTS = tuple(v for v in VARIANTS if v.startswith(("qwen", "llama3")))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """variant -> (HF folder, transformers model), built once per test session; the folder
    also holds the same weights as llama.cpp writes them, ``tiny.gguf``."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny-hf")
    out = {}
    for variant in VARIANTS:
        model = save_tiny_checkpoint(variant, root / variant)
        if variant in GGUF_VARIANTS:
            write_tiny_gguf(model, root / f"{variant}.gguf")
        out[variant] = (root / variant, model)
    return out


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (9, 23, 37)]


def reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logit row that chose each."""
    ids = list(prompt)
    rows = []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            rows.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt):], torch.stack(rows)


def run_kvscope(runner: ModelRunner, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-generate NEW_TOKENS for every prompt in shared steps: chunked prefills batched
    together, then decode steps; after PREEMPT_AFTER tokens "p0" is preempted (its blocks go
    to the free pool, reversed) and recomputed, prompt and generated tokens, in CHUNK-sized
    prefill steps beside the others' decodes. Returns tokens and logit rows per prompt."""
    names = [f"p{i}" for i in range(len(prompt_ids))]
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    per_seq = NUM_BLOCKS // len(names)
    blocks = {n: order[i * per_seq : (i + 1) * per_seq] for i, n in enumerate(names)}  # scattered, not in order
    tokens = {n: list(p) for n, p in zip(names, prompt_ids, strict=True)}
    computed = dict.fromkeys(names, 0)  # tokens whose K/V are in the cache
    generated: dict[str, list[int]] = {n: [] for n in names}
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    preempted = False
    while any(len(generated[n]) < NEW_TOKENS for n in names):
        if not preempted and len(generated["p0"]) == PREEMPT_AFTER:
            preempted = True
            blocks["p0"] = blocks["p0"][::-1]  # its old pages, stale K/V in them, in another order
            computed["p0"] = 0
        step = []
        for n in names:
            if len(generated[n]) >= NEW_TOKENS:
                continue
            # the last token is computed with the step that samples after it
            start = computed[n]
            end = min(start + CHUNK, len(tokens[n]))
            step.append(ScheduledSeq(n, tokens[n][start:end], start, blocks[n], needs_sample=end == len(tokens[n])))
        out = runner.logits_for(step)
        for seq in step:
            computed[seq.request_id] += len(seq.token_ids)
            if seq.needs_sample:
                row = out[seq.request_id]
                rows[seq.request_id].append(row)
                generated[seq.request_id].append(int(row.argmax()))
                tokens[seq.request_id].append(generated[seq.request_id][-1])
    return [generated[n] for n in names], [torch.stack(rows[n]) for n in names]


@pytest.mark.parametrize(("variant", "source"), [(v, s) for v in VARIANTS for s in ("hf", "gguf")
                                                  if s == "hf" or v in GGUF_VARIANTS])
def test_agrees_with_transformers_through_paging_and_preemption(variant: str, source: str, tiny_checkpoints) -> None:
    """``source`` gguf: the same weights as llama.cpp's converter writes them (Q/K rows in HF's
    order for Qwen), through the GGUF loader and the dequantized-weights cache (its entries,
    keyed by the seeded file's content, are the same every session: ~100 KB each)."""
    folder, hf_model = tiny_checkpoints[variant]
    config = load_model_config(str(folder) if source == "hf" else f"{folder}.gguf")
    family, tied = VARIANTS[variant][0].removesuffix("Config").lower(), VARIANTS[variant][1]
    if family == "gemma3text":
        family = "gemma3_text"
        assert config.layer_types == ("sliding_attention", "full_attention") and config.sliding_window == 8
    if family in ("mistral", "phi3"):  # every layer slides (window 8 / 12: the prompts outgrow it)
        assert config.layer_types == ("sliding_attention",) * 2 and config.sliding_window == VARIANTS[variant][2][
            "sliding_window"]
    assert (config.rope_scaling is not None) == (variant in ("llama3-scaled", "gemma3-linear"))
    if variant == "gemma3-linear":  # the full layer's scaling only: the sliding layer's local base stays plain
        assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 8.0)
    assert (config.architecture, config.source, config.tie_word_embeddings) == (family, source, tied)
    assert config.attention_bias == (family == "qwen2") and bool(config.qk_norm) == (family == "qwen3")
    runner = ModelRunner(config, dtype="float32", block_size=BLOCK_SIZE, attention_backend="torch")
    info = runner.load_weights()
    assert info.load_format == {"hf": "safetensors", "gguf": "gguf"}[source]
    runner.allocate_kv_cache(NUM_BLOCKS)
    runner.enable_cpu_decode_kernel()  # as phase F does (pure-decode steps), when it builds; else the torch path
    assert_agrees(runner, hf_model, f"{variant} ({source})")


def assert_agrees(runner: ModelRunner, hf_model, label: str) -> None:
    """The 3 prompts through :func:`run_kvscope` give transformers' greedy tokens, every logit row
    within MAX_LOGIT_DIFF of its reference (the largest diff printed under ``label``)."""
    prompt_ids = prompts(runner.model_config.vocab_size)
    ours_tokens, ours_rows = run_kvscope(runner, prompt_ids)
    worst = 0.0
    margin = float("inf")
    for prompt, tokens, rows in zip(prompt_ids, ours_tokens, ours_rows, strict=True):
        ref_tokens, ref_rows = reference(hf_model, prompt)
        assert tokens == ref_tokens
        worst = max(worst, float((rows - ref_rows).abs().max()))
        top2 = ref_rows.topk(2, dim=-1).values
        margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    print(f"\n{label}: 3 prompts x {NEW_TOKENS} greedy tokens equal; max |logit diff| {worst:.2e}; "
          f"smallest top-1 margin {margin:.2e}")
    assert worst < MAX_LOGIT_DIFF
    assert margin > 100 * worst  # the greedy equality is not a coin toss between near-ties


def test_a_missing_bias_or_norm_is_caught(tiny_checkpoints) -> None:
    """The comparison above can fail: the same Qwen2 checkpoint run as plain Llama (no
    Q/K/V bias), Qwen3 without its QK-norm, Llama 3.1 without its rope scaling and Mistral
    without its window move the logits far past the tolerance."""
    import dataclasses

    for variant, change in (("qwen2-untied", {"attention_bias": False}), ("qwen3-untied", {"qk_norm": None}),
                            ("llama3-scaled", {"rope_scaling": None}),
                            ("mistral-sliding", {"layer_types": None, "sliding_window": None})):
        folder, hf_model = tiny_checkpoints[variant]
        config = dataclasses.replace(load_model_config(str(folder)), **change)
        if variant.startswith("qwen3"):
            config = dataclasses.replace(config, architecture="llama")  # Llama's layers: no QK-norm
        assert last_row_diff(config, hf_model) > 1000 * MAX_LOGIT_DIFF


def last_row_diff(config: ModelConfig, hf_model) -> float:
    """The largest |logit diff| of the last prefill row of one prompt, kvscope's runner on
    ``config`` against transformers' model."""
    runner = ModelRunner(config, dtype="float32", block_size=BLOCK_SIZE, attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(NUM_BLOCKS)
    prompt = prompts(config.vocab_size)[1]
    ours = runner.logits_for([ScheduledSeq("x", prompt, 0, list(range(16)))])["x"]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    return float((ours - ref).abs().max())


def test_exact_parameter_count_matches_transformers(tiny_checkpoints) -> None:
    for variant, (folder, hf_model) in tiny_checkpoints.items():
        expected = sum(p.numel() for p in hf_model.parameters())  # a tied head is one parameter
        assert load_model_config(str(folder)).num_parameters == expected, variant


def test_engine_plan_reports_the_exact_count(tiny_checkpoints) -> None:
    folder, hf_model = tiny_checkpoints["qwen3-tied"]
    out = subprocess.run([sys.executable, "-m", "engine.cli", "plan", "--model", str(folder), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_parameters"] == sum(p.numel() for p in hf_model.parameters())


def test_an_architecture_outside_the_registry_is_refused_naming_the_families(tmp_path: Path) -> None:
    cfg = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 320}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as info:
        load_model_config(str(tmp_path))
    message = str(info.value)
    assert "MambaForCausalLM" in message and "not in kvscope's model registry" in message
    for name in ("llama (LlamaForCausalLM", "qwen2 (Qwen2ForCausalLM", "qwen3 (Qwen3ForCausalLM", "gemma3 (Gemma3ForCausalLM"):
        assert name in message


ENGINE_PROMPTS = ["the quick brown fox", "hello world, how are you today? the lazy dog jumps over",
                  "how are you"]


@pytest.mark.parametrize("variant", ["qwen2-untied", "qwen3-tied", "gemma3-tied", "mistral-sliding"])
def test_the_engine_generates_what_transformers_does_with_preemption(variant: str, tiny_checkpoints) -> None:
    """The whole engine (LLM: phases A-G, the scheduler, the tiny tokenizer of the HF folder;
    Gemma 3 on the hybrid KV cache manager) on a pool too small for the 3 requests at once:
    the scheduler preempts and recomputes, and each request's 16 greedy tokens are still
    transformers' own."""
    from engine.core.sampling_params import SamplingParams
    from engine.events import EventBus
    from engine.llm import LLM
    from engine.model.loading.tokenizer import Tokenizer

    folder, hf_model = tiny_checkpoints[variant]
    bus = EventBus()
    preempted: list[str] = []
    bus.subscribe(lambda e: preempted.append(e.request_id) if e.type == "request.preempted" else None)
    configs: list[dict] = []
    bus.subscribe(lambda e: configs.append(e.config) if e.type == "engine.config" else None)
    block_bytes = 16 * 2 * 2 * 2 * 16 * 4  # tokens x (K, V) x layers x KV heads x head_dim x fp32
    with LLM(str(folder), bus=bus, dtype="float32", kv_cache_memory_bytes=5 * block_bytes, max_model_len=64,
             max_num_seqs=3, stats_interval=0.0) as llm:
        outputs = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                              ignore_eos=True))
    tokenizer = Tokenizer.from_hf_folder(folder)
    for prompt, output in zip(ENGINE_PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        assert output.token_ids == reference(hf_model, ids)[0]
    print(f"\n{variant}: engine greedy tokens equal transformers' for 3 prompts x {NEW_TOKENS}; preemptions {len(preempted)}")
    assert preempted, "the 5-block pool should have forced a preemption"
    # Gemma 3 runs on the hybrid KV cache (a group for the sliding layer, one for the full),
    # Mistral on one sliding group (its blocks freed as they leave the window)
    assert ("kv_cache_groups" in configs[0]) == variant.startswith(("gemma3", "mistral"))


@pytest.mark.parametrize(("architecture", "extra", "needle"), [
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ("Phi3ForCausalLM", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope scaling type 'longrope'"),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ("MistralForCausalLM", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
])
def test_what_a_family_cannot_run_is_refused_naming_it(architecture: str, extra: dict, needle: str) -> None:
    from engine.modelspec.readers import model_config_from_hf_dict

    cfg = {"architectures": [architecture], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, **extra}
    with pytest.raises(UserError, match=re.escape(needle)):
        model_config_from_hf_dict(cfg, "tiny")
