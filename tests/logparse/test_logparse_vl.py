"""logparse on the corpus's vision-language logs, with kvscope's plan for the same VL
model beside them, and the multimodal lines kvscope's own plan prints in vLLM's words."""

from __future__ import annotations

import json

import pytest

from engine.budget.vision import encoder_cache_line, multimodal_from_flags
from engine.modelspec.presets import MODEL_PRESETS
from logparse.cli import main
from logparse.parser import iter_records
from tests.paths import DATA

LLAMA_VISION_LOG = DATA / "vllm-logs" / "v0.6.6dev-llama3.2-11b-vision-h100-tp1-cuda-blocks.log"


def test_llama_vision_log_beside_kvscopes_plan(capsys: pytest.CaptureFixture[str]) -> None:
    main(["explain", str(LLAMA_VISION_LOG), "--model", "llama-3.2-11b-vision", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["ledger"]["weights_gib"] == 19.86 and out["ledger"]["peak_activation_gib"] == 36.63
    plan = out["plan"]["kvscope"]
    # the vision tower and the cross-attention adapter are in kvscope's weights: 19.87 GiB from the shapes
    # against the 19.86 GiB vLLM measured (text-only Llama-3.1-8B shapes would say 14.96)
    assert plan["weights_gib"] == pytest.approx(19.86, abs=0.02)
    assert plan["multimodal"]["vision_weights_bytes"] == 2 * 2_639_926_800
    rows = {r["item"]: r for r in out["plan"]["rows"]}
    assert rows["weights_gib"]["vllm"] == 19.86


@pytest.mark.parametrize("skip", [False, True])
def test_the_multimodal_profile_lines_kvscope_prints_read_back(skip: bool) -> None:
    mm = multimodal_from_flags(MODEL_PRESETS["qwen2.5-vl-7b"], max_num_batched_tokens=8192, max_num_seqs=256,
                               skip_mm_profiling=skip)
    assert mm is not None
    line = f"INFO 12-01 20:00:00 [gpu_model_runner.py:2494] {encoder_cache_line(mm)}\n"
    (record,) = list(iter_records([line]))
    if skip:
        assert record.pattern is not None and record.pattern.id == "skip_mm_profiling"
    else:
        assert record.pattern is not None and record.pattern.id == "encoder_cache_budget"
        assert record.fields["encoder_cache_tokens"] == 16384 and record.fields["encoder_profile_items"] == 1
