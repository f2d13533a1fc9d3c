"""Command-line flags under vLLM's names, defined once and shared by every
``engine`` subcommand that builds or plans an engine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from engine.budget.config import BUNDLED_MODEL_NAME, EngineConfig, parse_dtype
from engine.budget.memory import parse_bytes, parse_gib, parse_kv_cache_dtype
from engine.core.policy import POLICIES
from engine.errors import UserError


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(str(text).replace(",", "").replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: must be a whole number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: must be positive")
        return value

    return parse


def _utilization(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-memory-utilization {text!r}: must be a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"--gpu-memory-utilization {text!r}: must be in (0, 1], the fraction of device memory kvscope may use"
        )
    return value


def _user_error_as_argparse(parse: Callable[[str, str], Any], flag: str) -> Callable[[str], Any]:
    """An argparse ``type=`` for one of the memory module's parsers, so its one-line
    UserError becomes argparse's usage error (exit code 2) naming the flag."""

    def convert(text: str) -> Any:
        try:
            return parse(text, flag)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def gib_type(flag: str) -> Callable[[str], float]:
    return _user_error_as_argparse(parse_gib, flag)


def bytes_type(flag: str) -> Callable[[str], int]:
    return _user_error_as_argparse(parse_bytes, flag)


def add_model_flags(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model preset, .gguf file or HF folder")
    p.add_argument("--model", default=None, help=f"model preset, .gguf file or HF folder (default {BUNDLED_MODEL_NAME})")
    p.add_argument("--dtype", default="auto", help="weights/activation dtype: auto, bfloat16, float16, float32")
    p.add_argument("--kv-cache-dtype", default="auto", type=_user_error_as_argparse(parse_kv_cache_dtype, "--kv-cache-dtype"),
                   help="auto (= --dtype), bfloat16, float16, float32, fp8 (= fp8_e4m3), fp8_e5m2 (vLLM's, scale 1.0), "
                        "or int8 (per-token-and-head scales; CPU/torch backend): 1-byte KV holds 2-4x the tokens")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int("--tensor-parallel-size"), default=1)


def add_budget_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory-utilization", type=_utilization, default=0.9,
                   help="fraction of device memory kvscope may use (default 0.9)")
    p.add_argument("--kv-cache-memory-bytes", type=bytes_type("--kv-cache-memory-bytes"), default=None,
                   help="KV pool size in bytes (suffixes Ki/Mi/Gi allowed); overrides the utilization arithmetic")
    p.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None,
                   help="longest prompt + output per request (default: the model's maximum)")
    p.add_argument("--block-size", type=_positive_int("--block-size"), default=16)


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"), default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"), default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--scheduling-policy", choices=list(POLICIES), default="fcfs",
                   help="waiting-queue order and preemption victim (engine/core/policy.py)")


def add_engine_flags(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """All flags of a real engine (generate, serve, run-workload)."""
    add_model_flags(p, positional=positional_model)
    add_budget_flags(p)
    add_scheduler_flags(p)
    p.add_argument("--load-format", choices=["auto", "gguf", "safetensors", "dummy"], default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--device-memory", type=gib_type("--device-memory"), default=None, metavar="GiB",
                   help="CPU: the memory budget's total (default: available system memory)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--compile", action="store_true", help="CPU: torch.compile the decode step in phase F")
    p.add_argument("-q", "--quantization", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="CPU: weight-only copies in 32-weight blocks (int8: Q8_0; int4: Q4_1, a GGUF's own "
                        "blocks as they are) for decode-sized steps, through kvscope's GEMV kernels; auto "
                        "(default) uses a GGUF's own Q4_1/Q8_0 blocks (the same weights), none keeps floats only")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: skip CUDA-graph capture in phase F")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats-interval", type=float, default=10.0, help="seconds between stats lines/events")
    p.add_argument("--log-prompts", action="store_true", help="put prompt and output text in events and logs")
    p.add_argument("--events", dest="events_path", default=None, metavar="PATH", help="record every event to JSONL")
    p.add_argument("--log-format", choices=["auto", "console", "json"], default="auto")
    p.add_argument("--threads", dest="num_threads", type=_positive_int("--threads"), default=None,
                   help="CPU threads for torch (default: all cores)")


def model_from_args(args: argparse.Namespace) -> str:
    return getattr(args, "model_pos", None) or args.model or BUNDLED_MODEL_NAME


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    cfg = EngineConfig(model=model_from_args(args))
    cfg.dtype = parse_dtype(args.dtype)
    for name in (
        "kv_cache_dtype", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
        "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
        "enable_prefix_caching", "scheduling_policy", "load_format", "device", "attention_backend", "compile",
        "enforce_eager", "seed", "stats_interval", "log_prompts", "events_path", "num_threads", "quantization",
    ):
        if hasattr(args, name):
            setattr(cfg, name, getattr(args, name))
    if getattr(args, "device_memory", None) is not None:
        cfg.device_memory_gib = args.device_memory
    if getattr(args, "served_model_name", None):
        cfg.served_model_name = args.served_model_name
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg
