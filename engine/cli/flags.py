"""Command-line flags under vLLM's names, defined once and shared by every
``engine`` subcommand that builds, plans or loads an engine: the engine's own
flags (``vllm serve``'s names) and the workload flags of ``run-workload``,
``demo`` and ``simulate`` (``vllm bench serve``'s names where kvscope means the
same thing). A flag that was spelled differently before keeps its old spelling
as an alias of the same argument (:data:`RETIRED_SPELLINGS`); ``--help`` shows
only the current one."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from engine.budget.memory import parse_bytes, parse_gib, parse_kv_cache_dtype
from engine.budget.vision import parse_item_size
from engine.config import PARSE, EngineConfig, cli_dest
from engine.core.policy import POLICIES
from engine.errors import UserError
from engine.events.exporters.kv_events_config import parse_kv_events_config
from engine.modelspec.presets import BUNDLED_MODEL_NAME
from engine.sim.workload import ARRIVAL_UNITS, ARRIVALS, WorkloadSpec, parse_range

# Old spelling -> the flag it is now an alias of (tests/cli/test_cli_flags.py holds every
# subcommand to this: an old spelling is never an argument of its own).
RETIRED_SPELLINGS: dict[str, str] = {
    "--num-requests": "--num-prompts",
    "--prompt-len": "--random-input-len",
    "--prompt-tokens": "--random-input-len",
    "--output-len": "--random-output-len",
    "--output-tokens": "--random-output-len",
    "--rate": "--request-rate",
    "--shared-prefix-tokens": "--shared-prefix-len",
}


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


def add_model_flags(p: argparse.ArgumentParser, positional: bool = False,
                    default_model: str = BUNDLED_MODEL_NAME) -> None:
    """``default_model`` only words the help: the command resolves a missing ``--model`` itself."""
    if positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model preset, .gguf file or HF folder")
    p.add_argument("--model", default=None, help=f"model preset, .gguf file or HF folder (default {default_model})")
    p.add_argument("--dtype", default="auto", help="weights/activation dtype: auto, bfloat16, float16, float32")
    p.add_argument("--kv-cache-dtype", default="auto", type=_user_error_as_argparse(parse_kv_cache_dtype, "--kv-cache-dtype"),
                   help="auto (= --dtype), bfloat16, float16, float32, fp8 (= fp8_e4m3), fp8_e5m2 (vLLM's, scale 1.0), "
                        "or int8 (per-token-and-head scales; CPU/torch backend): 1-byte KV holds 2-4x the tokens")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int("--tensor-parallel-size"), default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int("--pipeline-parallel-size"), default=None,
                   help="contiguous layer stages, one rank each (vLLM's flag); T x P ranks with -tp T")


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
    p.add_argument("--max-decode-step-tokens", type=_positive_int("--max-decode-step-tokens"), default=None,
                   help="kvscope's: the token budget of a step in which a request decodes, so a long prompt "
                        "stalls the decodes beside it for one bounded step (a step of prompts only may take "
                        "--max-num-batched-tokens); default off: fewer, longer prefill steps slow fewer gaps between "
                        "tokens, so set it where the largest gap matters more than the p99")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes already computed (default on)")
    p.add_argument("--scheduling-policy", choices=list(POLICIES), default="fcfs",
                   help="waiting-queue order and preemption victim (engine/core/policy.py)")


def add_multimodal_flags(p: argparse.ArgumentParser) -> None:
    """A vision-language preset's items (engine/budget/vision.py): vLLM's
    --limit-mm-per-prompt and --skip-mm-profiling, and the largest item's size."""
    g = p.add_argument_group("multimodal (vision-language presets: qwen2.5-vl-7b, llama-3.2-11b-vision)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="SPEC",
                   help="items per prompt: image=N[,video=M] or vLLM's JSON '{\"image\": 2}' (an item may be "
                        "{\"count\": N, \"width\": W, \"height\": H, \"num_frames\": F}); default 1 of each modality")
    g.add_argument("--skip-mm-profiling", action="store_true",
                   help="leave the encoder and its cache out of the profile run (a larger KV pool, unbudgeted encoder)")
    g.add_argument("--mm-image-size", type=_user_error_as_argparse(parse_item_size, "--mm-image-size"), default=None,
                   metavar="WxH", help="largest image in pixels (default: the processor's maximum)")
    g.add_argument("--mm-video-size", type=_user_error_as_argparse(parse_item_size, "--mm-video-size"), default=None,
                   metavar="WxH", help="a video frame's size in pixels")
    g.add_argument("--mm-video-frames", type=_positive_int("--mm-video-frames"), default=None, metavar="N",
                   help="frames per video (Qwen2.5-VL groups 2 per temporal patch)")


def multimodal_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The multimodal flags as :func:`engine.budget.vision.multimodal_from_flags` takes them."""
    return {"limit_mm_per_prompt": getattr(args, "limit_mm_per_prompt", None),
            "image_size": getattr(args, "mm_image_size", None), "video_size": getattr(args, "mm_video_size", None),
            "video_frames": getattr(args, "mm_video_frames", None),
            "skip_mm_profiling": bool(getattr(args, "skip_mm_profiling", False))}


def add_kv_events_flag(p: argparse.ArgumentParser) -> None:
    """vLLM's --kv-events-config (engine/events/exporters/kv_events_config.py), checked as it parses."""
    p.add_argument("--kv-events-config", type=_user_error_as_argparse(parse_kv_events_config, "--kv-events-config"),
                   default=None, metavar="JSON",
                   help="vLLM's KVEventsConfig as JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}': "
                        "publish BlockStored/BlockRemoved over ZMQ as vLLM does (publisher null: only record them)")


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
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=None,
                   help="vLLM's flag: a model with sliding-window layers (Gemma 3) keeps every layer on one "
                        "full-attention block table, the window masked in attention (default: one table per KV "
                        "cache group, sliding groups freeing what leaves their window)")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's sampling (temperature > 0)")
    p.add_argument("--stats-interval", type=float, default=10.0, help="seconds between stats lines/events")
    p.add_argument("--log-prompts", action="store_true", help="put prompt and output text in events and logs")
    p.add_argument("--events", dest="events_path", default=None, metavar="PATH", help="record every event to JSONL")
    add_kv_events_flag(p)
    p.add_argument("--log-format", choices=["auto", "text", "console", "json"], default="auto",
                   help="text: vLLM's line format, INFO MM-DD HH:MM:SS [file.py:line] message (default, on a "
                        "terminal and a pipe alike; console is another name for it); json: one object per line")
    p.add_argument("--threads", dest="num_threads", type=_positive_int("--threads"), default=None, metavar="N",
                   help="CPU threads for torch (default: all cores; with --tensor-parallel-size N, cores / N per rank)")
    p.add_argument("--data-parallel-size", "-dp", type=_positive_int("--data-parallel-size"), default=None,
                   help="D engine cores (each its own process, scheduler and KV pool) behind one server, "
                        "requests to the least loaded (vLLM's flag and rule: 4 x waiting + running)")
    hosts = p.add_argument_group("across hosts", "pipeline stages on several hosts, one launch command per host "
                                 "(torch.distributed's rendezvous; torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT "
                                 "are read when these are not given)")
    hosts.add_argument("--nnodes", type=_positive_int("--nnodes"), default=None, help="hosts in the replica")
    hosts.add_argument("--node-rank", type=int, default=None, help="this host's rank (0 serves; others run stages)")
    hosts.add_argument("--master-addr", default=None, help="host 0's address every host reaches (default 127.0.0.1)")
    hosts.add_argument("--master-port", type=int, default=None, help="host 0's rendezvous port (default 29500)")
    hosts.add_argument("--rendezvous-timeout", dest="rendezvous_timeout_s", type=float, default=None, metavar="S",
                       help="how long host 0 waits for every host before naming the missing ones (default 300)")
    p.add_argument("--distributed-executor-backend", choices=["mp"], default="mp",
                   help="how --tensor-parallel-size > 1 runs its ranks: mp (the only one), one process per rank "
                        "started by torch.multiprocessing, rank 0 in this process (engine/workers.py)")


def add_aliased(p: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, **kwargs: Any) -> argparse.Action:
    """``name`` plus its retired spellings as one argument (one ``dest``). Only
    ``name`` stays in the action's option strings, so ``--help``, the usage line
    and argparse's errors show one spelling; the old ones still parse."""
    old = [o for o, new in RETIRED_SPELLINGS.items() if new == name]
    action = p.add_argument(name, *old, **kwargs)
    action.option_strings = [name]
    return action


RANGE_HELP = ("Lengths are token counts: LO:HI draws each uniformly from LO to HI-1\n"
              "(HI exclusive, like a Python slice); one number N means exactly N.")


def add_workload_flags(
    p: argparse.ArgumentParser,
    *,
    num_prompts: int | None,
    input_len: str,
    output_len: str,
    request_rate: float,
    shared_prefix_fraction: float = 0.0,
    shared_prefix_len: int = 0,
    simulated: bool = False,
    num_prompts_help: str | None = None,
) -> argparse._ArgumentGroup:
    """The workload flags of ``run-workload``, ``demo`` and ``simulate``, in one
    "workload" group, with each command's defaults. ``simulated`` adds the
    arrival patterns only the simulator runs (uniform, by step, closed loop,
    traces); the real engine's arrivals are Poisson in seconds at --request-rate."""
    w = p.add_argument_group("workload", RANGE_HELP)
    add_aliased(w, "--num-prompts", type=_positive_int("--num-prompts"), default=num_prompts, metavar="N",
                 help=num_prompts_help or f"requests in the workload (default {num_prompts})")
    add_aliased(w, "--random-input-len", default=input_len, metavar="LO:HI",
                 help=f"prompt tokens per request (default {input_len})")
    add_aliased(w, "--random-output-len", default=output_len, metavar="LO:HI",
                 help=f"tokens generated per request, EOS ignored (default {output_len})")
    if simulated:
        w.add_argument("--arrival", choices=ARRIVALS, default="at-once",
                       help="at-once, uniform over --arrival-window, or poisson at --request-rate (default at-once)")
        w.add_argument("--arrival-unit", choices=ARRIVAL_UNITS, default="step",
                       help="arrivals by scheduler step or by simulated second (default step)")
        w.add_argument("--arrival-window", type=float, default=0.0, metavar="T",
                       help="uniform arrivals: the window, in steps or seconds as --arrival-unit says")
    rate_help = ("poisson arrivals: requests per --arrival-unit" if simulated else
                 f"requests per second, Poisson arrivals; inf sends them all at once (default {request_rate:g})")
    add_aliased(w, "--request-rate", type=float, default=request_rate, metavar="R", help=rate_help)
    w.add_argument("--shared-prefix-fraction", type=float, default=shared_prefix_fraction, metavar="F",
                   help=f"fraction of requests that start with one shared prefix (default {shared_prefix_fraction:g})")
    add_aliased(w, "--shared-prefix-len", type=int, default=shared_prefix_len, metavar="N",
                 help=f"tokens in that shared prefix, at most a prompt's length minus one (default {shared_prefix_len})")
    if simulated:
        w.add_argument("--concurrency", type=_positive_int("--concurrency"), default=None, metavar="N",
                       help="closed loop: N requests in flight, the next sent when one finishes (arrivals ignored)")
        w.add_argument("--trace", default=None, metavar="PATH",
                       help="JSONL trace instead of the draws: arrival_time (s) or arrival_step, prompt_tokens, "
                            "output_tokens per line")
    w.add_argument("--workload-seed", type=int, default=0, metavar="S",
                   help="seed of the workload's draws (default 0)")
    return w


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The :class:`~engine.sim.workload.WorkloadSpec` the workload flags describe.
    Without ``--arrival`` (the real engine's commands) arrivals are Poisson in
    seconds at ``--request-rate``, or all at once when it is inf."""
    rate = args.request_rate
    arrival = getattr(args, "arrival", None)
    if arrival is None:
        if not rate > 0:
            raise UserError(f"--request-rate {rate:g}: must be positive (inf sends every request at once)")
        arrival, unit = ("at-once" if rate == float("inf") else "poisson"), "s"
    else:
        unit = args.arrival_unit
    return WorkloadSpec(
        num_requests=args.num_prompts,
        prompt_range=parse_range(args.random_input_len, "--random-input-len"),
        output_range=parse_range(args.random_output_len, "--random-output-len"),
        arrival=arrival,
        unit=unit,
        window=getattr(args, "arrival_window", 0.0),
        rate=rate,
        shared_prefix_fraction=args.shared_prefix_fraction,
        shared_prefix_tokens=args.shared_prefix_len,
        seed=args.workload_seed,
    )


def model_from_args(args: argparse.Namespace) -> str:
    return getattr(args, "model_pos", None) or args.model or BUNDLED_MODEL_NAME


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The config the flags describe: every EngineConfig field whose argument this command
    defines (engine/config.py's ``cli_dest``, parsed by its ``parse``), the rest at their
    defaults, then ``overrides``. The model is the positional MODEL, --model or the bundled one."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        dest = cli_dest(f)
        if dest is None or not hasattr(args, dest):
            continue
        parse = f.metadata.get(PARSE)
        value = getattr(args, dest)
        values[f.name] = parse(value) if parse is not None else value
    values["model"] = model_from_args(args)
    return EngineConfig(**{**values, **overrides})
