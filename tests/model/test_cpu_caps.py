"""CPU capability detection and the ISA -> dtype decision, with /proc/cpuinfo texts injected
(one per CPU family the project's machines and users have)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.cpu_caps import choose_cpu_dtype, detect, parse_cpuinfo
from engine.modelspec.readers import load_model_config
from engine.startup.resolve import resolve_config, resolve_dtype


def cpuinfo(model: str, flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
            f"processor\t: 1\nmodel name\t: {model}\nflags\t\t: {flags}\n")


BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx"
ZEN3 = cpuinfo("AMD EPYC 7B13", f"{BASE} fma f16c avx2")
ZEN4 = cpuinfo("AMD EPYC 9B14", f"{BASE} fma f16c avx2 avx512f avx512bw avx512_vnni avx512_bf16")
SKYLAKE_X = cpuinfo("Intel Xeon Gold 6148", f"{BASE} fma f16c avx2 avx512f avx512bw")
SAPPHIRE_RAPIDS = cpuinfo("Intel Xeon Platinum 8480+",
                          f"{BASE} fma avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8")
OLD = cpuinfo("Intel Core 2", "fpu sse sse2 ssse3")


@pytest.mark.parametrize(("text", "isa", "dtype"), [
    (ZEN3, "avx2", "float32"),
    (ZEN4, "avx512_bf16", "bfloat16"),
    (SKYLAKE_X, "avx512", "float32"),  # AVX-512 without BF16: bf16 is still emulated
    (SAPPHIRE_RAPIDS, "amx", "bfloat16"),
    (OLD, "baseline", "float32"),
])
def test_isa_decides_the_auto_dtype(text: str, isa: str, dtype: str) -> None:
    caps = detect(text, torch_capability="AVX2")
    choice = choose_cpu_dtype(caps)
    assert (caps.isa, choice.dtype) == (isa, dtype)
    assert isa in choice.reason or "BF16" in choice.reason  # the reason names what decided it
    assert caps.summary()["isa"] == isa and caps.line().startswith(caps.model_name)


def test_kernel_key_separates_cpus_a_native_build_cannot_share() -> None:
    zen3, zen4 = detect(ZEN3, "AVX2"), detect(ZEN4, "AVX512")
    assert zen3.kernel_key != zen4.kernel_key
    assert detect(ZEN3, "AVX2").kernel_key == zen3.kernel_key


def test_parse_cpuinfo_reads_the_first_processor() -> None:
    model, flags = parse_cpuinfo(ZEN4)
    assert model == "AMD EPYC 9B14" and "avx512_bf16" in flags and "amx_tile" not in flags
    assert parse_cpuinfo("") == ("unknown CPU", frozenset())


def test_this_machine_is_described() -> None:
    caps = detect()
    assert caps.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert caps.isa in ("amx", "avx512_bf16", "avx512", "avx2", "baseline")


def test_startup_resolves_auto_by_isa_and_leaves_the_callers_config_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model.plan import setting

    model = load_model_config("smollm2-135m")
    config = EngineConfig(dtype="auto")
    cpu = torch.device("cpu")
    # the kernel plan on (the default): float32 activations, its cells pick bf16 weights where they win
    for caps in (detect(ZEN3, "AVX2"), detect(ZEN4, "AVX512")):
        choice = resolve_dtype(config, model, cpu, caps)
        assert choice.dtype == "float32" and "kernel plan" in choice.reason
    monkeypatch.setenv(setting.PLAN_ENV, "off")  # the fallback: the ISA rule
    assert resolve_dtype(config, model, cpu, detect(ZEN3, "AVX2")).dtype == "float32"
    assert resolve_dtype(config, model, cpu, detect(ZEN4, "AVX512")).dtype == "bfloat16"
    explicit = EngineConfig(dtype="bfloat16")
    assert resolve_dtype(explicit, model, cpu, detect(ZEN3, "AVX2")).dtype == "bfloat16"
    resolution = resolve_config(config, model, cpu)
    resolved = resolution.config
    assert resolved.dtype == choose_cpu_dtype(detect()).dtype
    assert resolved.max_num_batched_tokens == 512 and resolved.max_model_len == model.max_position_embeddings
    assert "CPU default 512" in resolution.batched_tokens_reason
    assert (config.dtype, config.max_model_len, config.max_num_batched_tokens) == ("auto", None, 8192)


@pytest.mark.parametrize(("text", "kv"), [(ZEN3, "auto"), (ZEN4, "bfloat16"), (SKYLAKE_X, "auto"),
                                          (SAPPHIRE_RAPIDS, "bfloat16")])
def test_the_kv_cache_is_bf16_where_bf16_is_native_under_the_plans_auto_dtype(text: str, kv: str) -> None:
    """--kv-cache-dtype auto under the kernel plan's --dtype auto (float32 activations): bf16 storage
    on AVX512-BF16/AMX (decode attention is bound by the bytes it reads), the model dtype's elsewhere;
    an explicit --kv-cache-dtype or --dtype is kept as given."""
    model, cpu, caps = load_model_config("smollm2-135m"), torch.device("cpu"), detect(text, "AVX512")
    resolution = resolve_config(EngineConfig(dtype="auto"), model, cpu, caps)
    assert resolution.config.kv_cache_dtype == kv
    assert ("bf16" in resolution.kv_cache_dtype_reason) == (kv == "bfloat16")
    assert resolve_config(EngineConfig(dtype="auto", kv_cache_dtype="float32"), model, cpu,
                          caps).config.kv_cache_dtype == "float32"
    assert resolve_config(EngineConfig(dtype="float32"), model, cpu, caps).config.kv_cache_dtype == "auto"


def test_capability_read_from_flags_is_torchs_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from engine.model.cpu_caps import inferred_torch_capability

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    _, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    assert inferred_torch_capability(flags) == str(torch.backends.cpu.get_cpu_capability())


@pytest.mark.parametrize(
    ("flags", "capability"),
    [
        ("avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16", "AVX512"),  # Zen 4
        ("avx2 fma avx512f", "AVX2"),  # AVX-512 foundation alone is not ATen's AVX512 set
        ("avx2 fma f16c", "AVX2"),  # Zen 3
        ("avx2", "DEFAULT"),  # no FMA: ATen's AVX2 kernels need it
        ("sse4_2", "DEFAULT"),
    ],
)
def test_capability_from_flags_follows_atens_rule(flags: str, capability: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model.cpu_caps import inferred_torch_capability

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert inferred_torch_capability(frozenset(flags.split())) == capability
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert inferred_torch_capability(frozenset(flags.split())) == "DEFAULT"
