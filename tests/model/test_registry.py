"""The model registry (engine/modelspec/families.py): each family's entry resolves to its model
class and config parsing, and an architecture outside it is refused before phase C, fast,
naming the families."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.modelspec.config import ModelConfig
from engine.modelspec.families import FAMILIES, HF_ARCHITECTURES, check_config_supported, model_class_for
from engine.modelspec.readers import model_config_from_hf_dict

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320}


def test_every_family_names_a_model_class_that_builds_from_its_config() -> None:
    from engine.model.attention.torch_backend import TorchAttentionBackend
    from engine.model.families.llama import LlamaForCausalLM

    for family in FAMILIES:
        for architecture in family.hf_architectures:
            moe = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
            config = model_config_from_hf_dict({**TINY, **moe, "architectures": [architecture]}, "tiny")
            model = model_class_for(config)(config, TorchAttentionBackend(), device="cpu")
            assert isinstance(model, LlamaForCausalLM)
            assert type(model).__name__ == family.model_class.split(":")[1]
    assert HF_ARCHITECTURES["Qwen2ForCausalLM"].name == "qwen2" and HF_ARCHITECTURES["Qwen3ForCausalLM"].name == "qwen3"


def test_each_family_parses_its_own_fields() -> None:
    llama = model_config_from_hf_dict({**TINY, "architectures": ["LlamaForCausalLM"]}, "l")
    qwen2 = model_config_from_hf_dict({**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "q2")
    qwen3 = model_config_from_hf_dict({**TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "q3")
    assert (llama.attention_bias, llama.qk_norm) == (False, None)
    assert "qk_norm" not in llama.summary()  # a Llama run's recorded config is what it was
    assert (qwen2.attention_bias, qwen2.qk_norm) == (True, None)
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.rope_theta) == (False, True, 1e6)
    # Qwen3's norms: 2 x head_dim per layer over the same shapes without them
    assert qwen3.num_parameters - dataclasses.replace(qwen3, qk_norm=None).num_parameters == 2 * 2 * 16
    with pytest.raises(UserError, match="use_sliding_window"):
        model_config_from_hf_dict({**TINY, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "w")


def test_unregistered_model_type_and_tensor_parallel_refused_before_phase_a() -> None:
    base = ModelConfig("m", 2, 64, 128, 320, 4, 2, 16, 256)
    with pytest.raises(UserError, match=r"'mamba' is not in kvscope's model registry.*qwen3 \(Qwen3ForCausalLM"):
        check_config_supported(dataclasses.replace(base, architecture="mamba", source="hf"), 1)
    with pytest.raises(UserError, match="run qwen3 on one rank"):
        check_config_supported(dataclasses.replace(base, architecture="qwen3", source="hf", qk_norm=True), 2)
    check_config_supported(dataclasses.replace(base, architecture="qwen2", source="hf"), 2)
    check_config_supported(dataclasses.replace(base, architecture="mllama"), 1)  # a shape preset runs as Llama


def test_engine_generate_refuses_an_unknown_architecture_within_seconds(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["MambaForCausalLM"],
                                                      "model_type": "mamba"}))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", str(tmp_path), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert out.returncode == 2, out.stderr
    assert "['MambaForCausalLM'] is not in kvscope's model registry" in out.stderr
    assert "qwen2 (Qwen2ForCausalLM" in out.stderr and "llama (LlamaForCausalLM" in out.stderr
    assert elapsed < 15  # the interpreter and the CLI's imports; no weights, no phase C (2.5 s measured)
