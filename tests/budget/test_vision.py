"""Vision-language models in the budget (background part 7): tokens per item, the
vision presets' weights, the encoder budget and ``engine plan`` for the VL presets."""

from __future__ import annotations

import json

import pytest

from engine.budget.memory import GiB, MiB, bytes_per_kv_token
from engine.budget.vision import (
    VISION_PRESETS,
    ItemSize,
    item_tokens,
    multimodal_from_flags,
    parse_limit_mm_per_prompt,
    qwen_resized,
    vision_parameters,
)
from engine.cli.main import main
from engine.errors import UserError
from engine.modelspec.presets import MODEL_PRESETS
from engine.modelspec.readers import load_model_config

QWEN_VL = VISION_PRESETS["qwen2.5-vl-7b"]
MLLAMA = VISION_PRESETS["llama-3.2-11b-vision"]


def test_part7_figures() -> None:
    # a 1280x720 image: Qwen's smart_resize rounds each side to 28 px (1288x728), 46 x 26 merged
    # patches = 1,196 tokens, the background's "about 1 170"
    assert qwen_resized(QWEN_VL, 1280, 720) == (1288, 728)
    tokens = item_tokens(QWEN_VL, ItemSize(1280, 720))
    assert tokens == 46 * 26 == 1196 and abs(tokens - 1170) / 1170 < 0.03
    # image tokens cost KV like text: 1,170 x 128 KiB = 146 MiB on Llama-3.1-8B
    per_token = bytes_per_kv_token(MODEL_PRESETS["llama-3.1-8b"])
    assert per_token == 128 * 1024
    assert round(1170 * per_token / MiB) == 146 and round(tokens * per_token / MiB, 1) == 149.5
    # a 16-frame video: frames go 2 at a time through the temporal patch, so 16 frames of
    # 840x560 (30 x 20 = 600 tokens a pair) are 8 x 600 = 4,800 tokens; 16 frames of ~300-token
    # frames (640x360: 23 x 13 = 299) are half that, 2,392
    assert item_tokens(QWEN_VL, ItemSize(840, 560, 16)) == 4800
    assert item_tokens(QWEN_VL, ItemSize(640, 360, 16)) == 8 * 23 * 13
    # Llama-3.2-Vision cuts 1280x720 into its 2x2 canvas: 4 tiles of 40x40 patches + 1 class token
    assert item_tokens(MLLAMA, ItemSize(1280, 720)) == 4 * 1601
    assert item_tokens(MLLAMA, ItemSize(560, 560)) == 1601


def test_vision_presets_weigh_what_the_models_do() -> None:
    qwen_llm, llama_llm = MODEL_PRESETS["qwen2.5-vl-7b"], MODEL_PRESETS["llama-3.2-11b-vision"]
    # Qwen2.5-VL-7B: a ~675 M-parameter tower; 8.29 B in all
    assert vision_parameters(QWEN_VL, qwen_llm) == 676_550_144
    assert qwen_llm.num_parameters + vision_parameters(QWEN_VL, qwen_llm) == 8_292_166_656
    # Llama-3.2-11B-Vision: the tower, its projector and 8 cross-attention layers, 10.67 B in all;
    # in bf16 19.87 GiB, where vLLM logged "model weights take 19.86GiB" (tests/data/vllm-logs)
    total = llama_llm.num_parameters + vision_parameters(MLLAMA, llama_llm)
    assert total == 10_670_188_048
    assert round(total * 2 / GiB, 2) == 19.87
    assert load_model_config("Qwen/Qwen2.5-VL-7B-Instruct").name == "qwen2.5-vl-7b"


def test_limit_mm_per_prompt_reads_both_of_vllms_spellings() -> None:
    assert parse_limit_mm_per_prompt("image=2,video=1") == ({"image": 2, "video": 1}, {})
    assert parse_limit_mm_per_prompt('{"image": 2}') == ({"image": 2}, {})
    counts, sizes = parse_limit_mm_per_prompt('{"video": {"count": 1, "width": 840, "height": 560, "num_frames": 16}}')
    assert counts == {"video": 1} and sizes == {"video": ItemSize(840, 560, 16)}
    for bad, needle in (("image:2", "MODALITY=N"), ('{"image": 2', "not valid JSON"), ("audio=1", "unknown modality"),
                        ("image=two", "whole number")):
        with pytest.raises(UserError, match=needle):
            parse_limit_mm_per_prompt(bad)
    model = MODEL_PRESETS["llama-3.2-11b-vision"]
    with pytest.raises(UserError, match="images only"):
        multimodal_from_flags(model, limit_mm_per_prompt="video=1", max_num_batched_tokens=8192, max_num_seqs=256)
    with pytest.raises(UserError, match="text model"):
        multimodal_from_flags(MODEL_PRESETS["llama-3.1-8b"], limit_mm_per_prompt="image=1",
                              max_num_batched_tokens=8192, max_num_seqs=256)


def test_encoder_budget_is_the_min_of_compute_and_cache_as_vllm() -> None:
    model = MODEL_PRESETS["qwen2.5-vl-7b"]
    # the largest image (max_pixels: 16,384 tokens) outgrows 8,192 batched tokens: both budgets
    # grow to one item, and one item is profiled (vLLM's log for Qwen VL models)
    mm = multimodal_from_flags(model, max_num_batched_tokens=8192, max_num_seqs=256)
    assert mm is not None
    assert (mm.encoder_budget_tokens, mm.items_profiled, mm.modality) == (16384, 1, "image")
    assert mm.encoder_cache_bytes == 16384 * 3584 * 2
    # 1280x720 images, 2 a prompt: 8,192 // 1,196 = 6 items at once, capped by max-num-seqs x 2
    mm = multimodal_from_flags(model, limit_mm_per_prompt="image=2", image_size=(1280, 720),
                               max_num_batched_tokens=8192, max_num_seqs=256)
    assert mm is not None and (mm.encoder_budget_tokens, mm.items_profiled, mm.tokens_per_prompt) == (8192, 6, 2392)
    mm = multimodal_from_flags(model, limit_mm_per_prompt="image=2", image_size=(1280, 720),
                               max_num_batched_tokens=8192, max_num_seqs=2)
    assert mm is not None and mm.items_profiled == 4


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


VL_PLAN = ("--model", "qwen2.5-vl-7b", "--gpu", "h100-80gb", "--max-model-len", "32768",
           "--limit-mm-per-prompt", '{"image": 2}', "--mm-image-size", "1280x720")


def test_plan_for_the_vl_presets_with_and_without_mm_profiling(capsys: pytest.CaptureFixture[str]) -> None:
    text = plan_json(capsys, "--model", "qwen2.5-7b", "--gpu", "h100-80gb", "--max-model-len", "32768")
    vl = plan_json(capsys, *VL_PLAN)
    skip = plan_json(capsys, *VL_PLAN, "--skip-mm-profiling")
    mm = vl["multimodal"]
    assert "multimodal" not in text
    assert (mm["tokens_per_item"], mm["encoder_cache_tokens"], mm["items_profiled"]) == (1196, 8192, 6)
    # the vision weights load with the LLM's; the profile adds the encoder's share on top of the text step
    assert vl["weights_gib"] * GiB == pytest.approx(text["weights_gib"] * GiB + mm["vision_weights_bytes"], abs=2)
    assert vl["peak_activation_gib"] * GiB == pytest.approx(
        max(mm["encoder_activation_peak_bytes"], mm["encoder_cache_bytes"] + mm["llm_activation_peak_bytes"]), abs=2)
    assert vl["estimated"] == ["activation_peak", "non_torch"]
    # less pool and concurrency than the text model; skipping the profile gives back the encoder's share only
    assert text["kv_cache_gib"] > skip["kv_cache_gib"] > vl["kv_cache_gib"]
    assert text["max_concurrency"] > skip["max_concurrency"] > vl["max_concurrency"]
    assert skip["peak_activation_gib"] * GiB == pytest.approx(skip["multimodal"]["llm_activation_peak_bytes"], abs=2)
    assert text["weights_gib"] < skip["weights_gib"] == vl["weights_gib"]
    llama = plan_json(capsys, "--model", "llama-3.2-11b-vision", "--max-model-len", "65536", "--max-num-seqs", "128")
    assert llama["multimodal"]["tokens_per_item"] == 6404 and not llama["multimodal"]["image_tokens_in_kv"]
    assert llama["bytes_per_token"] == 131_072  # the 32 self-attention layers only


def test_plan_text_shows_the_encoder_rows_and_vllms_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *VL_PLAN]) == 0
    out = capsys.readouterr().out
    assert "vision weights" in out and "encoder activation peak" in out and "estimated from shapes" in out
    assert ("Encoder cache will be initialized with a budget of 8192 tokens, and profiled with 6 image items "
            "of the maximum feature size.") in out
    assert "2,392 image tokens = 130.8 MiB of KV" in out and "versus the text model alone" in out
    assert main(["plan", *VL_PLAN, "--skip-mm-profiling"]) == 0
    out = capsys.readouterr().out
    assert "Skipping memory profiling for multimodal encoder and encoder cache." in out and "NOT budgeted" in out
