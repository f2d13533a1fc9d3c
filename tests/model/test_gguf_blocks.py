"""A K-quant GGUF read as it is (engine/model/loading/gguf_blocks.py): Gemma 3 270M's Q4_K_M file, whose
projections mix Q4_K, Q5_0, Q6_K and Q8_0, held as the file's blocks mapped from the file (no float
copy of a projection or of the embedding), nothing written to the weights cache, the embedding's
rows dequantized on lookup, and the logits of the int8-activation block kernels close to the
float32 path's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.layers.projection_linear import holds_nothing
from engine.model.loading import weight_blocks
from engine.model.loading.gguf_blocks import map_file, native_quantization, read_gguf_blocks
from engine.model.loading.weight_blocks import PROJECTIONS
from engine.model.runner import ModelRunner, ScheduledSeq
from tests.model.gemma3_fixtures import gemma3_config, gemma3_gguf_or_skip, run_teacher_forced


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvscope-cache")


@pytest.fixture(scope="module")
def block_runner(cache_dir) -> ModelRunner:
    config = gemma3_config()  # found in the real cache's models folder, before the cache moves
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSCOPE_CACHE_DIR", str(cache_dir))
        runner = ModelRunner(config, dtype="float32", block_size=16, attention_backend="torch",
                             quantization="native")
        runner.info = runner.load_weights()
    runner.allocate_kv_cache(64)
    return runner


def test_auto_reads_the_k_quant_mix_as_blocks() -> None:
    method, reason = native_quantization(gemma3_config())
    assert method == "native"
    assert "Q4_K" in reason and "Q6_K" in reason and "Q5_0" in reason


def test_weights_held_are_the_files_blocks_mapped_and_nothing_is_cached(block_runner, cache_dir) -> None:
    runner = block_runner
    info, model = runner.info, runner.model
    assert info.cache == "mapped"
    size = gemma3_gguf_or_skip().stat().st_size  # tensors plus the header (the 262k-token vocabulary: ~6 MB)
    assert 0.95 * size < info.file_tensor_bytes < size
    # at most 1.2x the file's tensor bytes (the bound); measured: 1.00x (the norms are float32 in the file)
    assert model.weights_bytes() <= 1.2 * info.file_tensor_bytes
    assert holds_nothing(model.embed_tokens)
    for layer in model.layers:
        assert all(holds_nothing(getattr(layer, name)) for name in PROJECTIONS)
    # every block part is a view of one mapping of the file (no row of Gemma's moves at load)
    storages = {p.blocks.untyped_storage().data_ptr() for q in weight_blocks.quantized_linears(model) for p in q.parts}
    assert len(storages) == 1
    assert not any(cache_dir.rglob("*.safetensors")), "a weights-cache entry was written for a mapped model"
    formats = {f for q in weight_blocks.quantized_linears(model) for f in q.formats}
    assert formats == {"q4_k", "q5_0", "q6_k", "q8_0"}
    mixed = [q for layer in model.layers for p in layer.projections.values() if (q := p.blocks) and len(q.parts) > 1]
    assert mixed, "Gemma 3's QKV mixes Q5_0 and Q8_0 on half its layers"


def test_embedding_rows_are_the_files_values(block_runner) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    model = block_runner.model
    ids = torch.tensor([[2, 105, 262143], [7, 7, 40000]])
    got = model.embed(ids)
    raw = read_gguf_blocks(gemma3_config(), mapped=map_file(gemma3_gguf_or_skip()))["model.embed_tokens.weight"][1]
    rows = dequantize(raw[ids.reshape(-1)].numpy(), GGMLQuantizationType.Q8_0).reshape(6, -1)
    expected = torch.from_numpy(np.ascontiguousarray(rows)).reshape(2, 3, -1) * model.embed_scale
    assert torch.equal(got, expected.to(got.dtype))


NEAR_TIE_LOGITS = 0.5


def test_block_logits_follow_the_float32_path(block_runner) -> None:
    """Teacher-forced along the float32 path's greedy tokens (prefill in chunks of 7, then decode
    steps): measured (AVX-512 VNNI Zen 4) 23/24 top-1, min logit cosine 0.9993; the int8
    activations round each projection's input per 32 values, as llama.cpp's do."""
    from tests.model.gemma3_fixtures import gemma3_runner

    floats = gemma3_runner(blocks=64)
    prompt = [2, 818, 5279, 529, 7001, 563]  # "<bos>The capital of France is"
    blocks = list(range(8))
    ref = run_teacher_forced(floats, prompt, [0] * 1, 7, blocks)[0]
    forced = [int(ref.argmax())]
    pos = len(prompt)
    for _ in range(23):
        out = floats.logits_for([ScheduledSeq("g", [forced[-1]], pos, blocks)])["g"]
        forced.append(int(out.argmax()))
        pos += 1
    ours = torch.stack(run_teacher_forced(block_runner, prompt, forced, 7, blocks))
    theirs = torch.stack(run_teacher_forced(floats, prompt, forced, 7, blocks))
    swapped = ours.argmax(-1) != theirs.argmax(-1)
    gaps = theirs.topk(2, dim=-1).values.diff(dim=-1).abs().squeeze(-1)
    cosine = torch.nn.functional.cosine_similarity(ours.float(), theirs.float(), dim=-1).min()
    print(f"\nGemma 3 blocks vs float32: top-1 {len(forced) - int(swapped.sum())}/{len(forced)}, swapped where the "
          f"float32 top two are {[round(float(g), 3) for g in gaps[swapped]]} apart; min cosine {float(cosine):.5f}")
    # a swap only where float32's top two logits are within the int8 rounding's reach (near-ties)
    assert not bool((swapped & (gaps > NEAR_TIE_LOGITS)).any())
    assert int(swapped.sum()) <= 0.05 * len(forced) + 1
    assert cosine > 0.99


@pytest.mark.slow  # two Gemma 3 engine starts, the first measuring its kernel plan: ~30-60 s on 2 cores
def test_phase_c_reports_the_blocks_held_and_the_plans_copies_apart(tmp_path, monkeypatch) -> None:
    """The weights held after phase C are the file's blocks (at most 1.2x its tensor bytes) plus
    the copies the kernel plan chose, reported apart; float weights the load never held are not
    counted as the plan's drops (they once inflated the copies by the ~1 GiB they would have taken)."""
    from engine.events import EventBus, StartupPhase
    from engine.llm import LLM
    from engine.model.memory import profile_cache

    gemma3_gguf_or_skip()
    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    events: list = []
    bus = EventBus()
    bus.subscribe(events.append)
    flags = dict(max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=4, stats_interval=0.0)
    LLM("gemma-3-270m", bus=bus, **flags).close()
    c = next(e.data for e in events if isinstance(e, StartupPhase) and e.phase == "C" and e.status == "end")
    assert c["kernel_plan_dropped_bytes"] == 0  # nothing was held as floats to drop
    held_blocks = c["weights_bytes"] - c["kernel_plan_bytes"]
    assert c["block_bytes"] <= held_blocks <= 1.2 * c["file_tensor_bytes"], c
    # Gemma 3's hybrid layout profiles the whole step: a smaller budget next time reuses that peak
    d = next(e.data for e in events if isinstance(e, StartupPhase) and e.phase == "D" and e.status == "end")
    events.clear()
    LLM("gemma-3-270m", bus=bus, **flags, max_num_batched_tokens=d["max_num_batched_tokens"] - 64).close()
    again = next(e.data for e in events if isinstance(e, StartupPhase) and e.phase == "D" and e.status == "end")
    assert again["cached"] is True and again["activation_peak_bytes"] == d["activation_peak_bytes"]
    assert "an upper bound" in again["method"]
