"""`engine export-hf`: the exported folder loads in HF transformers (and in our own
safetensors loader) and gives the GGUF-loaded model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cli import main
from engine.model.loading.tokenizer import Tokenizer
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.readers import load_model_config

pytestmark = pytest.mark.slow  # a full HF export and a transformers load: ~15 s on 2 cores (make test-slow)

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, smollm_config) -> Path:
    out = tmp_path_factory.mktemp("export") / "smollm2-hf"
    assert main(["export-hf", "smollm2-135m", str(out)]) == 0
    return out


def test_folder_has_the_hf_files(exported: Path) -> None:
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names


def test_transformers_loads_it_and_matches_our_gguf_logits(exported: Path, smollm_runner_fp32, smollm_tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ids = smollm_tokenizer.apply_chat_template(PROMPT, tokenize=True)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert hf_tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == (
        smollm_tokenizer.apply_chat_template(PROMPT)
    )
    assert hf_tokenizer.encode("price 12345 über 🤗", add_special_tokens=False) == smollm_tokenizer.encode(
        "price 12345 über 🤗"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0, -1]
    ours = smollm_runner_fp32.logits_for([ScheduledSeq("r", ids, 0, [0, 1, 2])])["r"]
    assert (ours - theirs).abs().max().item() < 1e-3


def test_our_safetensors_loader_reads_the_export(exported: Path, smollm_runner_fp32) -> None:
    config = load_model_config(str(exported))
    assert config.source == "hf" and config.tie_word_embeddings and config.num_layers == 30
    runner = ModelRunner(config, dtype="float32")
    assert runner.load_weights().load_format == "safetensors"
    runner.allocate_kv_cache(4)
    batch = [ScheduledSeq("r", [1, 9690, 198, 2683, 359], 0, [0])]
    ours_gguf = smollm_runner_fp32.logits_for([ScheduledSeq("r", batch[0].token_ids, 0, [5])])["r"]
    got = runner.logits_for(batch)["r"]
    # The same weights through the same code: bit-equal on AVX2 Zen 3; on AVX-512 Zen 4 the
    # GEMMs round differently for the two loads' tensors (max |diff| 5.7e-6 on logits ~10).
    assert float((got - ours_gguf).abs().max()) < 1e-4 and int(got.argmax()) == int(ours_gguf.argmax())
    assert Tokenizer.for_model(config).encode("hello world") == [28120, 905]


def test_export_refuses_a_non_empty_folder(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export-hf", "smollm2-135m", str(exported)]) == 2
    assert "not empty" in capsys.readouterr().err
