"""Weights for a model (Llama family, Gemma 3): from a GGUF file, an HF safetensors
folder, or random ("dummy") weights of a config's shapes.

Every source is read into HF parameter names (``model.layers.0.self_attn.q_proj.weight``)
so one model class and one exporter serve them all; the model fuses QKV and
gate/up when it takes the tensors (:meth:`~engine.model.loading.hf_layout.HfLayout.load`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.errors import UserError
from engine.modelspec.config import ModelConfig
from engine.modelspec.families import GGUF_GLOBAL_NAMES, family_for_architecture
from engine.modelspec.gguf_header import read_gguf_header
from engine.modelspec.readers import resolve_model_file

if TYPE_CHECKING:
    from engine.model.families.llama import LlamaForCausalLM

# (tensors done, tensors total) -> None; the engine turns it into a progress event.
ProgressCallback = Callable[[int, int], None]

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass(slots=True)
class LoadInfo:
    """What the engine's weight-loading phase reports."""

    load_format: str
    source: str | None
    weights_bytes: int
    load_seconds: float
    num_tensors: int
    cache: str = "none"  # GGUF: "hit", "miss" (read the file, cache written), "off", or "mapped" (read as blocks)
    file_tensor_bytes: int | None = None  # a GGUF read as blocks: its tensors' bytes
    block_bytes: int | None = None  # ... and the bytes of blocks the weights hold


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """llama.cpp's tensor name -> HF's, by the family's map (engine/modelspec/families.py)."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    layer_names = family_for_architecture(architecture).gguf_layer_names
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _rotary_rows_permuted(config: ModelConfig) -> bool:
    """llama.cpp's converter interleaves the rotary halves of Q/K rows for Llama only; the
    other families' GGUFs (Qwen2, Qwen3, Gemma 3: NeoX rope) keep HF's order (the registry's
    ``gguf_rotary_permuted``)."""
    return config.family.gguf_rotary_permuted


def _cache_key_parts(config: ModelConfig) -> tuple[str, ...]:
    """More of the dequantized-weights cache key for families other than Llama and Gemma 3
    (whose keys stay as they were): Qwen2 GGUF entries written before issue 32 hold Q/K rows
    un-permuted as if llama.cpp had permuted them, and must not be read again."""
    name = config.family.name
    return () if name in ("llama", "gemma3") else (f"family={name}",)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: its converter interleaves the two
    rotary halves of each head so the GGML kernel can rotate adjacent pairs; HF's
    rotate_half wants them as two contiguous halves (the same reversal HF
    transformers applies when it reads a GGUF)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation (inverse of :func:`unpermute_rotary_rows`)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, np.ndarray, int]]:
    """Yield ``(hf_name, float32 array, total)`` for each tensor of a GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    read_gguf_header(path)  # milliseconds: a cut-short file is named before GGUFReader's seconds
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct.error/OSError on garbage
        raise UserError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    total = len(reader.tensors)
    permuted = _rotary_rows_permuted(config)
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, config.architecture)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from rope_theta
        try:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        except Exception as exc:
            raise UserError(f"{path}: tensor {tensor.name} cannot be decoded ({exc})") from exc
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if not permuted:
            pass
        elif hf_name.endswith("q_proj.weight") or hf_name.endswith("q_proj.bias"):
            array = unpermute_rotary_rows(array, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight") or hf_name.endswith("k_proj.bias"):
            array = unpermute_rotary_rows(array, config.num_kv_heads)
        yield hf_name, array, total


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor, int]]:
    """Yield ``(hf_name, tensor, total)`` from ``model.safetensors`` or a sharded index."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no *.safetensors files (looked for model.safetensors and its index)")
    names: list[tuple[str, str]] = []
    for file in files:
        try:
            with safe_open(str(folder / file), framework="pt") as handle:
                names.extend((file, key) for key in handle.keys())  # noqa: SIM118 (not a dict)
        except Exception as exc:
            raise UserError(f"{folder / file}: not a readable safetensors file ({exc})") from exc
    total = len(names)
    for file in files:
        with safe_open(str(folder / file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                yield key, handle.get_tensor(key), total


def resolve_load_format(config: ModelConfig, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise UserError(f"--load-format {load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    if load_format != "auto":
        return load_format
    if config.source == "gguf":
        return "gguf"
    if config.source == "hf":
        return "safetensors"
    return "dummy"  # a preset with no file: shapes only


def weights_location(config: ModelConfig) -> Path:
    location = Path(config.path) if config.path else resolve_model_file(config.name)
    if location is None or not location.exists():
        raise UserError(f"model {config.name!r}: no weights file found (path {config.path!r}); use --load-format dummy")
    return location


def iter_hf_tensors(
    config: ModelConfig, load_format: str
) -> Iterator[tuple[str, torch.Tensor | np.ndarray, int]]:
    """HF-named tensors from the model's file, in file order."""
    fmt = resolve_load_format(config, load_format)
    location = weights_location(config)
    if fmt == "gguf":
        if location.is_dir():
            raise UserError(f"{location}: --load-format gguf needs a .gguf file, got a folder")
        yield from iter_gguf_tensors(location, config)
    elif fmt == "safetensors":
        if not location.is_dir():
            raise UserError(f"{location}: --load-format safetensors needs an HF folder, got a file")
        norms_plus_one = config.family.hf_norms_add_one  # Gemma's HF norms hold w; the model 1 + w
        split, adds = config.family.hf_split, config.family.hf_split_adds * config.num_layers
        for name, tensor, total in iter_safetensors(location):
            if norms_plus_one and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0
            parts = split(name, config) if split is not None else None
            if parts is None:
                yield name, tensor, total + adds
            else:  # a fused tensor (Phi-3's qkv_proj, gate_up_proj) as Llama's parts
                for part, first, rows in parts:
                    yield part, tensor[first : first + rows], total + adds
    else:
        raise UserError(f"load format {fmt!r} has no file to read")


def load_hf_state_dict(config: ModelConfig, load_format: str = "auto", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The whole checkpoint as an HF-named state dict (unfused); the exporter uses it."""
    out: dict[str, torch.Tensor] = {}
    for name, array, _ in iter_hf_tensors(config, load_format):
        tensor = torch.from_numpy(np.require(array, requirements=["C", "W"])) if isinstance(array, np.ndarray) else array
        out[name] = tensor.to(dtype)
    return out


def _load_each_tensor(model: LlamaForCausalLM, config: ModelConfig, fmt: str, progress: ProgressCallback | None,
                      source: str) -> int:
    """Every tensor of the checkpoint into ``model`` by its HF name; a UserError naming what is
    missing. Returns how many were read."""
    seen: set[str] = set()
    count = 0
    for name, array, total in iter_hf_tensors(config, fmt):
        tensor = torch.from_numpy(np.require(array, requirements=["C", "W"])) if isinstance(array, np.ndarray) else array
        model.hf_layout.load(name, tensor)
        seen.add(name)
        count += 1
        if progress:
            progress(count, total)
    missing = model.hf_layout.missing(seen)
    if missing:
        raise UserError(f"{source}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return count


def load_weights_into(
    model: LlamaForCausalLM,
    config: ModelConfig,
    load_format: str = "auto",
    progress: ProgressCallback | None = None,
    seed: int = 0,
) -> LoadInfo:
    """Fill ``model`` (a :class:`engine.model.families.llama.LlamaForCausalLM`) from its source.
    A GGUF file goes through the dequantized-weights cache (:mod:`engine.model.loading.startup_cache`)."""
    from engine.model.loading.startup_cache import load_cached_weights, save_cached_weights, weights_path

    start = time.perf_counter()
    fmt = resolve_load_format(config, load_format)
    count = 0
    cache = "none"
    if fmt == "dummy":
        count = model.hf_layout.init_dummy(seed=seed)
        if progress:
            progress(count, count)
        source = None
    else:
        location = weights_location(config)
        source = str(location)
        cache_path = (weights_path(location, model.dtype, *_cache_key_parts(config))
                      if fmt == "gguf" and location.is_file() else None)
        if fmt == "gguf":
            cache = "off" if cache_path is None else "miss"
        # A tensor-parallel rank holds slices: it reads the whole model's entry and never writes one.
        load_slices = getattr(model, "load_cached_slices", None)  # TensorParallelLlama's
        if cache_path is not None and (load_slices(cache_path) if load_slices is not None
                                       else load_cached_weights(model, cache_path)):
            cache = "hit"
            count = len(model.hf_layout.names())
            if progress:
                progress(count, count)
        else:
            count = _load_each_tensor(model, config, fmt, progress, source)
            if cache_path is not None and load_slices is None:
                try:
                    save_cached_weights(model, cache_path)
                except OSError:
                    cache = "off"  # unwritable cache folder: still a good load
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadInfo(
        load_format=fmt,
        source=source,
        weights_bytes=int(weights_bytes),
        load_seconds=time.perf_counter() - start,
        num_tensors=count,
        cache=cache,
    )
