"""`engine export-hf` for every registered family: a tiny seeded random checkpoint built with
transformers (tests/model/tiny_hf.py, tiny_moe.py), exported from its HF folder and, where the
engine reads that family's GGUFs, from the same weights as llama.cpp writes them; transformers
loads the export as the family's own class, and its logits equal the source model's and the
engine's forward on the same tokens (teacher-forced past the sliding windows). Then the real
Gemma 3 270M GGUF (slow): exported, loaded as Gemma3ForCausalLM, against the engine in fp32."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.cli import main
from engine.errors import UserError
from engine.model.runner import ModelRunner
from engine.modelspec.config import ModelConfig, RopeScaling
from engine.modelspec.families import FAMILIES
from engine.modelspec.hf_export import HF_EXPORTS, hf_config, llama3_divisors
from engine.modelspec.readers import load_model_config
from tests.model.gemma3_fixtures import gemma3_gguf_or_skip, gemma3_runner, run_teacher_forced
from tests.model.tiny_gemma3 import build_tiny_gemma3, write_gemma3_gguf
from tests.model.tiny_hf import (
    TINY_SHAPES,
    redrawn,
    save_tiny_checkpoint,
    save_with_tokenizer,
    write_tiny_gguf,
)
from tests.model.tiny_moe import EAGER, save_tiny_moe, write_tiny_moe_gguf

# Same fp32 weights on both sides (a GGUF of F32 tensors; Gemma's norms pass through 1 + w and
# back): export vs source measured <= 5e-7, engine vs export <= 6.2e-6 (2 threads). 1e-4 is the
# family-agreement bound: room for another CPU's summation order, not for a lost field or norm
# (Gemma's norms written as 1 + w miss by 6.1).
MAX_LOGIT_DIFF = 1e-4
PROMPT_LEN, FORCED = 13, 9  # 22 positions: past the tiny windows (8 and 12)
BLOCK_SIZE = 4


def _build_llama(folder: Path) -> Any:
    """Llama 3.1's llama3 rope scaling, its trained context cut to 700 positions so that at
    head_dim 16 (base 10,000) two frequencies are blended: what a GGUF's rope_freqs of Llama
    3.1/3.2 holds, which the export must write back as transformers' llama3 parameters."""
    import transformers

    config = transformers.LlamaConfig(**TINY_SHAPES, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 700})
    torch.manual_seed(0)
    return save_with_tokenizer(redrawn(transformers.AutoModelForCausalLM.from_config(config), 0), folder)


# family -> (builds and saves the tiny checkpoint into a folder, writes its GGUF or None)
SOURCES: dict[str, tuple[Callable[[Path], Any], Callable[[Any, Path], Path] | None]] = {
    "llama": (_build_llama, write_tiny_gguf),
    "qwen2": (lambda f: save_tiny_checkpoint("qwen2-tied", f), write_tiny_gguf),
    "qwen3": (lambda f: save_tiny_checkpoint("qwen3-untied", f), write_tiny_gguf),
    "gemma3": (build_tiny_gemma3, write_gemma3_gguf),
    "mistral": (lambda f: save_tiny_checkpoint("mistral-sliding", f), None),
    "phi3": (lambda f: save_tiny_checkpoint("phi3-sliding", f), None),
    "qwen3_moe": (lambda f: save_tiny_moe("qwen3moe", f), write_tiny_moe_gguf),
    "qwen2_moe": (lambda f: save_tiny_moe("qwen2moe", f), None),
    "mixtral": (lambda f: save_tiny_moe("mixtral", f), None),
}
# The default suite runs Gemma 3 (both sources), Llama's GGUF (rope_freqs -> llama3) and the
# Qwen3-MoE GGUF (stacked experts); each case ~2-4 s on a quiet 2-core machine. The rest are slow.
DEFAULT_CASES = {("gemma3", "hf"), ("gemma3", "gguf"), ("llama", "gguf"), ("qwen3_moe", "gguf")}
CASES = [pytest.param(f, s, marks=() if (f, s) in DEFAULT_CASES else pytest.mark.slow, id=f"{f}-{s}")
         for f, (_, gguf) in SOURCES.items() for s in ("hf", "gguf") if s == "hf" or gguf is not None]


def test_every_registered_family_has_an_export_and_a_test() -> None:
    assert {f.name for f in FAMILIES} == set(HF_EXPORTS) == set(SOURCES)
    # the engine reads GGUFs of exactly the families tested here from a GGUF
    assert {f.name for f in FAMILIES if f.gguf_architectures} == {f for f, (_, g) in SOURCES.items() if g}


def _tokens(vocab: int) -> list[int]:
    return torch.randint(3, vocab, (PROMPT_LEN + FORCED,), generator=torch.Generator().manual_seed(5)).tolist()


def _engine_rows(config: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """The engine's logits for positions PROMPT_LEN - 1 .. end - 1: a chunked prefill, then decode steps."""
    runner = ModelRunner(config, dtype="float32", block_size=BLOCK_SIZE, attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(16)
    blocks = list(range(15, 7, -1))  # scattered, not in order
    return torch.stack(run_teacher_forced(runner, tokens[:PROMPT_LEN], tokens[PROMPT_LEN:], 5, blocks))


def _hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


_READ_BACK = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim",
              "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
              *(f for f in ModelConfig.FAMILY_FIELDS if f not in ("rope_scaling", "qk_norm")))


@pytest.mark.parametrize(("family", "source"), CASES)
def test_export_loads_in_transformers_with_the_sources_logits(family: str, source: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    build, write_gguf = SOURCES[family]
    hf_model = build(tmp_path / "src")
    model_path = tmp_path / "src" if source == "hf" else write_gguf(hf_model, tmp_path / "src.gguf")  # type: ignore[misc]
    out = tmp_path / "export"
    assert main(["export-hf", str(model_path), str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [HF_EXPORTS[family].architecture]
    assert written["model_type"] == hf_model.config.model_type
    config, exported_config = load_model_config(str(model_path)), load_model_config(str(out))
    for field in _READ_BACK:  # the engine reads its own export back as the model it ran
        assert getattr(exported_config, field) == getattr(config, field), field

    moe = {**EAGER} if "moe" in family or family == "mixtral" else {}
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **moe).eval()
    assert type(exported).__name__ == HF_EXPORTS[family].architecture
    tokens = _tokens(hf_model.config.vocab_size)
    theirs, ours_hf = _hf_logits(hf_model, tokens), _hf_logits(exported, tokens)
    engine = _engine_rows(config, tokens)
    vs_source = float((ours_hf - theirs).abs().max())
    vs_engine = float((ours_hf[PROMPT_LEN - 1 : -1] - engine).abs().max())
    print(f"\n{family} ({source}): export vs source {vs_source:.2g}, export vs engine {vs_engine:.2g}")
    assert vs_source < MAX_LOGIT_DIFF and vs_engine < MAX_LOGIT_DIFF


def test_rope_freqs_become_llama3_parameters_or_are_refused() -> None:
    """A Llama 3.1 8B GGUF's rope_freqs (base 500,000, head_dim 128, factor 8, original 8192) are
    written as transformers' llama3 parameters; divisors no llama3 scaling gives are refused."""
    published = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    divisors = tuple(llama3_divisors(500_000.0, 128, published))
    config = ModelConfig("llama-3.1-8b", 32, 4096, 14336, 128256, 32, 8, 128, 131072, rope_theta=500_000.0,
                         source="gguf", rope_scaling=RopeScaling(rope_type="freq_factors", freq_factors=divisors))
    rope = hf_config(config, "float32", [128009])["rope_parameters"]
    assert rope == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_theta": 500_000.0}
    bent = RopeScaling(rope_type="freq_factors", freq_factors=tuple(d * 1.01 for d in divisors))
    with pytest.raises(UserError, match="no llama3 rope scaling"):
        hf_config(dataclasses.replace(config, rope_scaling=bent), "float32", [128009])


# ---------------------------------------------------------------- the real Gemma 3 270M

GEMMA3_PROMPT = "The capital of France is"
GEMMA3_FORCED = 24
# Measured (fp32, 2 threads): top-1 24/24, max |logit diff| 2.6e-05. The engine reads the same
# dequantized values (its LM head through the Q8_0 GEMV kernel): only summation order differs.
GEMMA3_MIN_TOP1 = 0.95
GEMMA3_MAX_LOGIT_DIFF = 1e-3


@pytest.mark.slow  # dequantizing and writing 1 GB of fp32, then transformers' load: ~100 s on 2 shared cores
def test_real_gemma3_270m_export_matches_the_engine(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = gemma3_gguf_or_skip()
    out = tmp_path / "gemma3-hf"
    assert main(["export-hf", str(path), str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["sliding_window"], written["query_pre_attn_scalar"]) == (
        "gemma3_text", 512, 256)
    assert written["layer_types"].count("full_attention") == 3
    model = transformers.Gemma3ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    runner = gemma3_runner(blocks=8)
    from engine.model.loading.startup_cache import cached_tokenizer

    ids = cached_tokenizer(path).encode(GEMMA3_PROMPT, add_special_tokens=True)
    with torch.inference_mode():
        generated = model.generate(torch.tensor([ids]), max_new_tokens=GEMMA3_FORCED, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        reference = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1].float()
    ours = torch.stack(run_teacher_forced(runner, ids, generated, 4, list(range(8))))
    agree = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    worst = float((ours - reference).abs().max())
    print(f"\nGemma 3 270M export vs engine, fp32: top-1 {agree}/{len(generated)}, max |logit diff| {worst:.3g}")
    assert agree / len(generated) >= GEMMA3_MIN_TOP1 and worst < GEMMA3_MAX_LOGIT_DIFF
