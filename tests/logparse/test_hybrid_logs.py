"""logparse reconciles a real vLLM Gemma 3 start's KV lines with kvscope's hybrid formula
(engine/budget/memory.py). The logs and their sources: tests/data/vllm-logs/index.tsv and README.md.

gemma-3-27b-it, max_model_len 4096, max_num_batched_tokens 8192 (printed), vLLM 0.11 on ROCm:
  Available KV cache memory: 109.86 GiB; "Add 8 padding layers"; GPU KV cache size: 205,696 tokens;
  Maximum concurrency for 4,096 tokens per request: 50.05x; num_gpu_blocks is: 89994.
By hand (Gemma 3 27B: 62 layers, 16 KV heads x 128, bf16, 52 sliding of window 1024 + 10 full):
  page 16 x 2 x 16 x 128 x 2 = 131,072 B; 7 groups (6 sliding padded to 10 layers, 1 full of 10):
  7 x 10 - 62 = 8 padding layers; 109.86 GiB / 131,072 // 10 = 89,997 blocks // 7 x 16 = 205,696
  tokens; per request 256 + 6 x 257 = 1,798 blocks; 89,994 / 1,798 = 50.05x (205,696 / 4,096 = 50.22
  would be the full-attention reading).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from logparse.cli import main
from tests.paths import DATA

CORPUS = DATA / "vllm-logs"
GEMMA27 = CORPUS / "v0.11.0rc2-gemma-3-27b-it-rocm-tp1-hybrid-kv-padding.log"
GEMMA4 = CORPUS / "v0.11.x-gemma-3-4b-it-a100-tp1-hybrid-kv-excerpt.log"


def explain_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    status = main(["explain", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def checks(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in out["checks"]}


def test_gemma3_27b_log_reconciles_with_the_hybrid_plan(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = explain_json(capsys, str(GEMMA27))
    by_id = checks(out)
    assert status == 0, [c for c in out["checks"] if c["ok"] is False]
    assert out["plan"]["model"] == "gemma-3-27b"  # from the served folder's name, /google/gemma-3-27b-it
    padding = by_id["hybrid_padding"]
    assert padding["ok"] is True and padding["expected"] == 8 and padding["actual"] == 8
    tokens = by_id["hybrid_kv_tokens"]
    assert tokens["ok"] is True and tokens["expected"] == 205_696 and tokens["actual"] == 205_696
    assert "89,997 blocks" in tokens["detail"]
    conc = by_id["hybrid_concurrency"]
    assert conc["ok"] is True and conc["expected"] == 50.05
    assert conc["actual"] == pytest.approx(89_994 / 1_798, abs=1e-4)
    assert "6 x 257 (window 1,024) + 256 (full)" in conc["detail"] and "50.22x" in conc["detail"]
    # the full-attention readings, which this log contradicts, are not applied to it
    assert "concurrency" not in by_id and "kv_tokens_x_bytes" not in by_id


def test_the_wrong_model_fails_the_reconciliation(capsys: pytest.CaptureFixture[str]) -> None:
    # gemma-3-4b: 29 sliding + 5 full -> 7 groups of 5, one padding layer, a 65,536 B page:
    # 109.86 x 2^30 / 65,536 = 1,799,946 pages // 5 = 359,989 blocks // 7 = 51,427 x 16 = 822,832 tokens,
    # not 205,696
    status, out = explain_json(capsys, str(GEMMA27), "--model", "gemma-3-4b")
    by_id = checks(out)
    assert status == 1
    assert by_id["hybrid_padding"]["ok"] is False and by_id["hybrid_padding"]["actual"] == 1
    assert by_id["hybrid_kv_tokens"]["ok"] is False and by_id["hybrid_kv_tokens"]["actual"] == 822_832


def test_gemma3_4b_excerpt_needs_the_model_and_then_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    # ovg-project/kvcached#215: 317,136 tokens, 102.78x at 3,072 tokens, "Add 1 padding layers".
    # Without --model nothing names the model: the padding line says the layout is hybrid, so
    # tokens / max-model-len (103.23x) is not held against the printed 102.78x; nothing is judged.
    status, out = explain_json(capsys, str(GEMMA4))
    by_id = checks(out)
    assert status == 0 and by_id["hybrid_layout"]["ok"] is None and "concurrency" not in by_id
    # With it: 317,136 / 16 = 19,821 = blocks // 7 -> 138,747..138,753 blocks; per request 192 (full)
    # + 6 x 193 (window) = 1,350; 102.776..102.780 -> 102.78x.
    status, out = explain_json(capsys, str(GEMMA4), "--model", "gemma-3-4b")
    by_id = checks(out)
    assert status == 0
    assert by_id["hybrid_padding"]["ok"] is True
    conc = by_id["hybrid_concurrency"]
    assert conc["ok"] is True and "138,747..138,753 blocks" in conc["detail"] and "1,350 blocks" in conc["detail"]
    assert conc["actual"] == pytest.approx((138_747 + 138_753) / 2 / 1_350, abs=1e-4)
