"""Reading a :class:`~engine.modelspec.config.ModelConfig`: from a preset name, an HF
folder's config.json (the family's own fields by the registry,
:mod:`engine.modelspec.families`) or a GGUF file's header (milliseconds,
:mod:`engine.modelspec.gguf_header`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.modelspec.config import (
    CANONICAL_DTYPE,
    ModelConfig,
    RopeScaling,
)
from engine.modelspec.families import (
    Family,
    family_for_architecture,
    family_for_hf_config,
    linear_rope_scaling,
)
from engine.modelspec.gguf_header import ArrayValue, GGUFHeader, TensorInfo, read_gguf_header
from engine.modelspec.presets import (
    FILE_BACKED_PRESETS,
    FILE_PRESET_NAMES,
    MODEL_PRESETS,
    resolve_preset_name,
)


def _hf_rope_theta(cfg: dict[str, Any]) -> float:
    """transformers 5 writes the rope base under ``rope_parameters``; older config.json files
    at the top level (or under ``rope_scaling``)."""
    for key in ("rope_parameters", "rope_scaling"):
        nested = cfg.get(key)
        if isinstance(nested, dict) and "rope_theta" in nested:
            return float(nested["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def _hf_rope_scaling(cfg: dict[str, Any], family: Family, where: str) -> RopeScaling | None:
    """The rope scaling of config.json (``rope_parameters``, transformers 5, or ``rope_scaling``):
    None for plain rope, a :class:`RopeScaling` for ``llama3`` and ``linear``; any other type is refused,
    naming it (a family whose parser reads its rope itself, Gemma 3, is skipped here)."""
    if family.reads_own_rope:
        return None
    nested_dicts = [n for n in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(n, dict)]
    for factor in (cfg.get("partial_rotary_factor"), *(n.get("partial_rotary_factor") for n in nested_dicts)):
        if factor is not None and float(factor) != 1.0:
            raise UserError(f"{where}: partial_rotary_factor {factor}: kvscope rotates every dimension of a head; "
                            f"the {family.name} family runs with partial_rotary_factor 1 only")
    for nested in nested_dicts:
        kind = nested.get("rope_type", nested.get("type", "default"))
        if kind in (None, "default"):
            continue
        if kind == "linear":
            return linear_rope_scaling(nested, where)
        if kind == "llama3":
            try:
                return RopeScaling(factor=float(nested["factor"]), low_freq_factor=float(nested["low_freq_factor"]),
                                   high_freq_factor=float(nested["high_freq_factor"]),
                                   original_max_position_embeddings=int(nested["original_max_position_embeddings"]))
            except KeyError as exc:
                raise UserError(f"{where}: config.json's llama3 rope scaling lacks {exc.args[0]!r}") from exc
        raise UserError(f"{where}: config.json's rope scaling type {kind!r} is not supported (kvscope runs plain rope, "
                        f"linear scaling and Llama 3.1's llama3 scaling); the {family.name} family's long-context variants need it")
    return None


def model_config_from_hf_dict(cfg: dict[str, Any], name: str, path: str | None = None) -> ModelConfig:
    """A ModelConfig from config.json: the shapes every family shares, then the family's own
    fields (engine/modelspec/families.py's registry, by the ``architectures`` entry; an
    architecture it does not list is refused here, naming the families)."""
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
            rope_scaling=_hf_rope_scaling(cfg, family, path or name),
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
    gguf_fields = family_for_architecture(arch).gguf_fields
    family = gguf_fields(meta, layers, head_dim) if gguf_fields is not None else {}
    rope_freqs = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:  # Llama 3.1/3.2: llama3 scaling as one divisor per frequency
        family["rope_scaling"] = RopeScaling(rope_type="freq_factors",
                                             freq_factors=_read_f32_tensor(path, header, rope_freqs))
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


def _read_f32_tensor(path: Path, header: GGUFHeader, tensor: TensorInfo) -> tuple[float, ...]:
    """A small F32 tensor's values, read from the file (a few hundred bytes: ``rope_freqs``)."""
    if tensor.ggml_type != 0:
        raise UserError(f"{path}: tensor {tensor.name} is ggml type {tensor.ggml_type}; kvscope reads it as F32 only")
    count = math.prod(tensor.dims)
    with open(path, "rb") as handle:
        handle.seek(header.data_start + tensor.offset)
        data = handle.read(4 * count)
    if len(data) != 4 * count:
        raise UserError(f"{path}: tensor {tensor.name} is cut short; copy or download the file again")
    return struct.unpack(f"<{count}f", data)


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
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as exc:  # a name too long for the file system (a garbled log field), a loop...
        raise UserError(f"model {model[:120]!r}{'…' if len(model) > 120 else ''} ({len(model):,} characters) is not "
                        f"a usable path: {exc.strerror}; give a preset name, a .gguf file or an HF folder") from None
    if is_dir:
        return model_config_from_hf_folder(path)
    if is_file:
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
    try:
        return path if path.exists() else None
    except OSError:  # not a path the file system can hold: no weights there
        return None
