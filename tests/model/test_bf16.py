"""bf16 where it is native (issue 34): the LM head sums and returns float32 in every dtype mode
(no bf16-rounded logits for greedy decoding to tie on), RMSNorm in bf16 and prefill attention
through torch's SDPA in bf16 each within a stated bound of float32, the fused decode layer
multiplying by the kernel plan's bf16 copy past the GEMV, and phase F's report of which parts
run in bf16. A one-layer model of SmolLM2's attention shapes (random weights, a smaller MLP and
vocabulary): each test takes about a second once the kernels are built."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.core.sampling_params import SamplingParams
from engine.model.attention import cpu_decode
from engine.model.kernels import cpu_layer, cpu_norm
from engine.model.kernels.cpu_gemv import dequantize
from engine.model.layers.kernel_routing import PAGED_PREFILL, PAGED_PREFILL_BF16
from engine.model.plan import attention_cells, kernel_plan
from engine.model.plan.candidates import mkldnn_bf16_pack_available
from engine.model.plan.choice import relative_error
from engine.model.plan.kernel_plan import ACCURACY_BOUND, ATTENTION, STEP_CLASSES, Cell, KernelPlan
from engine.model.runner import ModelRunner, ScheduledSeq

# bf16 keeps 8 significant bits: one rounding of an output is at most 2^-9 relative (RMS ~1.1e-3).
RMS_NORM_BOUND = 4e-3
GREEDY = SamplingParams(temperature=0.0)
MULTI_ROW = ",".join(sc.name for sc in STEP_CLASSES if sc.lo > 1)  # the classes of more than one row


def _small_runner(config, dtype: str, quantization: str | None = None, kv_cache_dtype: str = "auto") -> ModelRunner:
    small = dataclasses.replace(config, num_layers=1, vocab_size=2048, intermediate_size=512)
    runner = ModelRunner(small, dtype=dtype, quantization=quantization, load_format="dummy",
                         kv_cache_dtype=kv_cache_dtype)
    runner.load_weights()
    runner.allocate_kv_cache(96)
    return runner


def _bf16_representable(t: torch.Tensor) -> float:
    """The share of ``t``'s values that bf16 holds exactly (a bf16 GEMM's outputs: all of them)."""
    return float((t.bfloat16().float() == t).float().mean())


def _plan(choose: dict[str, str], fused_max_rows: int = 0) -> KernelPlan:
    """A plan choosing, per group, ``choose[group]`` past one row and the GEMV at one row."""
    cells = [Cell(group, sc.name, sc.rows, "test", chosen="gemv" if sc.lo == 1 and group != ATTENTION
                  else choose.get(group, "torch"))
             for sc in STEP_CLASSES for group in (*kernel_plan.GROUPS, ATTENTION)
             if not (group == ATTENTION and sc.lo == 1)]
    return KernelPlan(cells=cells, fused_max_rows=fused_max_rows, isa="test")


def test_the_lm_head_returns_float32_sums_under_bfloat16(smollm_config, cpu_gemv_kernel) -> None:
    """``--dtype bfloat16``: the logits are float32 and are the float32 sums of the bf16 hidden
    rows and weights (a bf16 GEMM would round every logit to bf16), or of the Q8_0 head's blocks
    where the GEMV runs, by the fallback constants (GEMV up to 16 rows, then the bf16 weight
    widened) and by kernel plan routes alike."""
    runner = _small_runner(smollm_config, "bfloat16", "int8")
    model = runner.model
    hidden = torch.randn(24, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    exact = F.linear(hidden.float(), model.head_weight.float())
    q = model.projections["head"].blocks  # the GEMV sums the Q8_0 blocks' values: exactly those, in float32
    blocks = F.linear(hidden.float(), dequantize(q.blocks, q.fmt))
    for plan in (None, _plan({"head": "torch"}), _plan({"head": "gemv"})):
        if plan is not None:
            model.routing.install_plan(plan)
        for rows in (1, 8, 24):
            logits = model.compute_logits(hidden[:rows])
            assert logits.dtype == torch.float32
            assert _bf16_representable(logits) < 0.2, "logits rounded to bf16"
            errors = [relative_error(logits, exact[:rows]), relative_error(logits, blocks[:rows])]
            assert min(errors) < 1e-5, errors
    assert model.routing.precision_report(runner.kv_cache_dtype)["lm_head"].startswith("float32 sums, float32 logits")


def test_fp32_linear_widens_bf16_weights_exactly() -> None:
    from engine.model.layers.projection_linear import fp32_linear

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 96, generator=generator).bfloat16()  # 1000 rows: several slices and a remainder
    x = torch.randn(5, 96, generator=generator)
    out = fp32_linear(x, weight)
    assert out.dtype == torch.float32 and torch.allclose(out, x @ weight.float().T, rtol=1e-6, atol=1e-6)


def test_bf16_rms_norm_matches_float32_within_its_rounding(cpu_norm_kernel) -> None:
    """RMSNorm on bf16 rows (the kernel, and torch's own without it) against float32 on the same
    values: within ``RMS_NORM_BOUND`` relative RMS (one bf16 rounding of each output)."""
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 576, generator=generator) * 3.0).bfloat16()
    weight = (1.0 + 0.1 * torch.randn(576, generator=generator)).bfloat16()
    reference = F.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    kernel = cpu_norm.rms_norm(x, weight, 1e-5)
    torch_own = F.rms_norm(x, (576,), weight, 1e-5)
    for out in (kernel, torch_own):
        assert out.dtype == torch.bfloat16
        assert relative_error(out, reference) < RMS_NORM_BOUND
    assert relative_error(kernel, reference) > 0  # it did run in bf16: rounded


def _prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    return runner.logits_for([ScheduledSeq("p", prompt, 0, blocks)])["p"]


def test_bf16_sdpa_prefill_matches_float32_within_the_plan_bound(smollm_config, cpu_decode_kernel) -> None:
    """A float32 model whose plan chose bf16 prefill attention: a 40-token prefill's logits
    within ``ACCURACY_BOUND`` of float32 SDPA's, and different from them (bf16 ran); the
    plan's own attention cells check the same bound on random q, K, V."""
    runner = _small_runner(smollm_config, "float32")
    assert runner.enable_cpu_decode_kernel() is None
    prompt = list(range(100, 140))
    runner.model.routing.install_plan(_plan({}))
    float32 = _prefill_logits(runner, prompt)
    runner.model.routing.install_plan(_plan({ATTENTION: "bf16"}))
    assert runner.backend.prefill_attention[-1] == (1 << 62, "bf16")
    bf16 = _prefill_logits(runner, prompt)
    assert not torch.equal(bf16, float32)
    assert relative_error(bf16, float32) < ACCURACY_BOUND
    report = runner.model.routing.precision_report(runner.kv_cache_dtype)
    assert report["prefill_attention"].startswith(f"torch SDPA in float32; bf16 for chunks of {MULTI_ROW}")
    candidates = attention_cells.attention_candidates(runner.model, bf16=True)
    assert candidates == ("torch", "bf16", "paged")  # the paged prefill kernel is built for head dim 64
    cells = attention_cells.attention_cells(runner.model, candidates, torch.Generator().manual_seed(0), float("inf"))
    assert ",".join(c.step for c in cells) == MULTI_ROW
    for cell in cells:
        assert set(cell.us) == set(candidates) and cell.error["torch"] == 0.0
        assert 0 < cell.error["bf16"] < ACCURACY_BOUND and cell.error["paged"] < 1e-5  # float32 sums
        assert cell.chosen in candidates


def test_the_bf16_prefill_kernel_is_a_candidate_over_a_bf16_cache_where_the_cpu_has_it(smollm_config,
                                                                                         cpu_decode_kernel) -> None:
    """``--dtype auto`` on a bf16-native CPU stores a bf16 cache: the plan times the vdpbf16ps
    prefill kernel beside the float32 one, over that cache (the float32 kernel then matches the
    reference exactly, the bf16 one within its rounding), and a 40-token prefill on it stays
    within the plan's bound. Without AVX512-BF16, or over a float32 cache, it is no candidate."""
    runner = _small_runner(smollm_config, "float32", kv_cache_dtype="bfloat16")
    assert runner.enable_cpu_decode_kernel() is None
    has_it = cpu_decode.bf16_prefill_available()
    assert ("paged_bf16" in runner.backend.prefill_kernels) == has_it
    candidates = attention_cells.attention_candidates(runner.model, bf16=True)
    assert candidates == ("torch", "bf16", "paged") + (("paged_bf16",) if has_it else ())
    assert "paged_bf16" not in attention_cells.attention_candidates(runner.model, bf16=False)  # --dtype float32
    float32_cache = _small_runner(smollm_config, "float32")
    float32_cache.enable_cpu_decode_kernel()
    assert "paged_bf16" not in float32_cache.backend.prefill_kernels
    if not has_it:
        return
    cells = attention_cells.attention_cells(runner.model, candidates, torch.Generator().manual_seed(0), float("inf"))
    for cell in cells:
        assert cell.error["paged"] < 1e-5 and 1e-4 < cell.error["paged_bf16"] < ACCURACY_BOUND
    prompt = list(range(100, 140))
    runner.model.routing.install_plan(_plan({ATTENTION: "paged"}))
    exact = _prefill_logits(runner, prompt)
    runner.model.routing.install_plan(_plan({ATTENTION: "paged_bf16"}))
    rounded = _prefill_logits(runner, prompt)
    assert not torch.equal(rounded, exact) and relative_error(rounded, exact) < ACCURACY_BOUND
    report = runner.model.routing.precision_report(runner.kv_cache_dtype)
    assert report["prefill_attention"] == PAGED_PREFILL_BF16


def _decode_step(runner: ModelRunner, rows: int, fused: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Prefill ``rows`` 5-token prompts, then one pure-decode step of ``rows`` sequences."""
    monkeypatch.setenv(cpu_layer.KERNEL_ENV, "1" if fused else "0")
    seqs = [ScheduledSeq(str(i), [10 + i, 11, 12, 13, 14], 0, list(range(i * 8, i * 8 + 8)), True, GREEDY)
            for i in range(rows)]
    runner.logits_for(seqs)
    for s in seqs:
        s.start_position, s.token_ids = 5, [20]
    out = runner.logits_for(seqs)
    return torch.stack([out[s.request_id] for s in seqs])


@pytest.mark.slow  # a quantized model and four decode steps of 12 sequences: ~2 s quiet, 8 s at load 11 on 2 cores
def test_the_fused_layer_runs_its_gemv_whatever_the_op_by_op_routes(smollm_config, cpu_layer_kernel,
                                                                    monkeypatch) -> None:
    """A plan with the GEMV at one row and bf16 GEMM above: the op-by-op decode step multiplies
    by the packed bf16 copies, while the fused decode layer keeps its GEMV at every size it
    serves (its dense fallback would reorder a bf16 weight on every call): no bf16 weight in its
    arguments, and its step within the plan bound of a float32 plan's (whose prefill wrote the cache
    in float32)."""
    runner = _small_runner(smollm_config, "float32", "int4")
    assert runner.enable_cpu_decode_kernel() is None
    groups = {"qkv": "bf16", "o": "bf16", "gate_up": "bf16", "down": "bf16"}
    model = runner.model
    model.routing.install_plan(_plan(groups, fused_max_rows=cpu_layer.MAX_ROWS))
    assert model.routing.fused_layers, model.routing.fused_decode_status(runner.kv_cache_dtype)
    before = model.routing.fused_layers[0][0]
    assert not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in before)
    fused = _decode_step(runner, 12, True, monkeypatch)
    op_by_op = _decode_step(runner, 12, False, monkeypatch)
    assert not torch.equal(fused, op_by_op)  # the op-by-op step ran the packed bf16 copies
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    if mkldnn_bf16_pack_available():
        assert all(getattr(model.layers[0], f"{n}_bf16_packed").is_mkldnn for n in projections)
    else:  # AVX2: oneDNN cannot pack bf16, the plan keeps a dense bf16 copy
        assert all(getattr(model.layers[0], f"{n}_bf16").dtype == torch.bfloat16 for n in projections)
    report = model.routing.precision_report(runner.kv_cache_dtype)
    assert report["fused_decode_layer"] == "float32 activations, the GEMV over the GGUF blocks"
    assert report["projections"] == "float32; bf16 GEMM (the kernel plan) for " + "; ".join(
        f"{g} {MULTI_ROW}" for g in groups)
    model.routing.install_plan(_plan({}, fused_max_rows=cpu_layer.MAX_ROWS))
    float32 = _decode_step(runner, 12, True, monkeypatch)  # the same fused decode over a float32 prefill's cache
    assert not torch.equal(fused, float32) and relative_error(fused, float32) < ACCURACY_BOUND


@pytest.mark.slow  # an engine start in bf16 (measuring its plan in a fresh cache) and a short answer: ~15 s quiet
def test_dtype_bfloat16_reports_its_bf16_parts_and_answers_with_float32_logits(tmp_path, monkeypatch) -> None:
    """``--dtype bfloat16`` end to end on the bundled model: phase F's ``precision`` names the
    parts in bf16 and the LM head's float32 sums, the logits are float32 (not bf16-rounded),
    and the README's question gets the README's answer."""
    from engine.events import EventBus, StartupPhase
    from engine.llm import LLM
    from engine.model.memory import profile_cache
    from tests.model.test_model_reference import WATER, WATER_ANSWER, WATER_TOKENS

    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    events: list[object] = []
    bus = EventBus()
    bus.subscribe(events.append)
    with LLM("smollm2-135m", bus=bus, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=16 * 2**20,
             max_num_seqs=4, stats_interval=0.0) as llm:
        phase_f = next(e.data for e in events if isinstance(e, StartupPhase) and e.phase == "F" and e.status == "end")
        precision = phase_f["precision"]
        assert precision["activations"] == "bfloat16" and precision["rms_norm"].startswith("bfloat16")
        paged = [c.chosen == "paged" for c in llm.engine.runner.kernel_plan.cells if c.group == ATTENTION]
        if all(paged):
            assert precision["prefill_attention"] == PAGED_PREFILL
        else:
            assert precision["prefill_attention"].startswith("torch SDPA in bfloat16")
        assert precision["lm_head"].startswith("float32 sums, float32 logits")
        runner = llm.engine.runner
        logits = runner.logits_for([ScheduledSeq("p", list(range(100, 140)), 0, [0, 1, 2])])["p"]
        assert logits.dtype == torch.float32 and _bf16_representable(logits) < 0.2
        assert llm.chat(WATER, SamplingParams(temperature=0.0, max_tokens=WATER_TOKENS))[0].text == WATER_ANSWER
