"""A GGUF model read as it is: its block tensors mapped from the file, only the rest decoded.

``--quantization auto`` on CPU takes a file whose projections are all in block formats a
kernel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: every llama.cpp "Q*_K_M"
mix) as those blocks. The file is memory-mapped once (``torch.from_file``, private and
read lazily): a projection's blocks are a view of the mapping when its rows stay where
they are, a copy only where a row moves (Llama's Q/K rows, which llama.cpp permutes) or
Q4_1 is interleaved 8 rows at a time. No float copy of a block-backed projection or of the
embedding is made; the norms (float32 in the file) are the only tensors decoded. Weights
held after loading are about the file's tensor bytes, plus what the kernel plan chooses to
make (engine/model/plan/), and phase C's event reports both.

A warm start maps the same file again (the page cache holds it), so nothing is decoded,
cached or written: the dequantized-weights cache is for float models only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model.layers.projection_linear import placeholder
from engine.model.layers.quantized_linear import (
    BLOCK_FORMATS,
    FORMAT_OF_GGML_TYPE,
    QuantizedLinear,
    fits,
    row_bytes,
)
from engine.model.loading.loader import (
    LoadInfo,
    ProgressCallback,
    gguf_to_hf_name,
    resolve_load_format,
    unpermute_rotary_rows,
    weights_location,
)
from engine.model.loading.weight_blocks import PROJECTION_PARTS, quantized_linears, quantized_projections
from engine.modelspec.config import ModelConfig
from engine.modelspec.gguf_header import TensorInfo, read_gguf_header

_PROJECTION_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# ggml float types read directly from the mapping: id -> numpy dtype (bf16 goes through torch).
_FLOAT_TYPES = {0: np.float32, 1: np.float16}
_BF16 = 30


def _gguf_file(config: ModelConfig, load_format: str) -> Path | None:
    if resolve_load_format(config, load_format) != "gguf":
        return None
    location = weights_location(config)
    return None if location.is_dir() else location


def projection_formats(path: Path) -> set[str]:
    """The formats of the file's projection tensors (a ggml type no kernel reads: its id)."""
    table = read_gguf_header(path).tensors
    return {FORMAT_OF_GGML_TYPE.get(t.ggml_type, str(t.ggml_type)) for t in table
            if t.name.startswith("blk.") and t.name.endswith(_PROJECTION_SUFFIXES)}


def native_quantization(config: ModelConfig, load_format: str = "auto") -> tuple[str | None, str]:
    """``(method, reason)``: the ``--quantization`` whose blocks are exactly the GGUF's own:
    every projection Q4_1 -> int4 (interleaved 8 rows), every projection Q8_0 -> int8, any mix
    of block formats a kernel reads -> native (a K-quant file); None for other files/sources.
    A file whose projections a kernel cannot read still reads its LM head's blocks (native)."""
    path = _gguf_file(config, load_format)
    if path is None:
        return None, "not a GGUF file: float weights as loaded"
    formats = projection_formats(path)
    if formats == {"q4_1"}:
        return "int4", "every projection in the GGUF is Q4_1: decode steps read its own blocks"
    if formats == {"q8_0"}:
        return "int8", "every projection in the GGUF is Q8_0: decode steps read its own blocks"
    if formats and formats <= set(FORMAT_OF_GGML_TYPE.values()):
        return "native", (f"the GGUF's projections are {'/'.join(f.upper() for f in sorted(formats))} blocks: "
                          "every step reads them as they are (no float copy)")
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    kind = next((t.ggml_type for t in read_gguf_header(path).tensors if t.name == head), None)
    if kind in FORMAT_OF_GGML_TYPE:
        return "native", (f"the LM head is {FORMAT_OF_GGML_TYPE[kind].upper()} in the GGUF: steps read its blocks; "
                          f"projection types {sorted(formats)} have no kernel and stay float")
    return None, f"GGUF projection types {sorted(formats)}: no kernel reads them as they are"


def map_file(path: Path) -> torch.Tensor:
    """The whole file as ``uint8``, mapped privately and read lazily (no copy, no write)."""
    return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)


def _tensor_bytes(info: TensorInfo) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    return int(np.prod(info.dims)) // per_block * size


def read_gguf_blocks(config: ModelConfig, load_format: str = "auto",
                     mapped: torch.Tensor | None = None) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> ``(format, uint8 [rows, row bytes])`` of each 2-D tensor of the model's GGUF in
    a block format a kernel reads: views of the mapped file, or copies where Llama's Q/K rows
    are un-permuted like the floats (a row's blocks move with it). Empty for other sources."""
    path = _gguf_file(config, load_format)
    if path is None:
        return {}
    header = read_gguf_header(path)
    data = map_file(path) if mapped is None else mapped
    out: dict[str, tuple[str, torch.Tensor]] = {}
    permuted = config.family.gguf_rotary_permuted
    for info in header.tensors:
        hf_name = gguf_to_hf_name(info.name, config.architecture)
        fmt = FORMAT_OF_GGML_TYPE.get(info.ggml_type)
        if fmt is None or hf_name is None or len(info.dims) != 2 or not fits(fmt, info.dims[0]):
            continue
        width = row_bytes(fmt, info.dims[0])  # dims are ggml's (in, out): in varies fastest
        start = header.data_start + info.offset
        raw = data[start : start + info.dims[1] * width].view(info.dims[1], width)
        if permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads
            raw = torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(raw.numpy(), heads)))
        out[hf_name] = (fmt, raw)
    return out


def _float_tensor(data: torch.Tensor, start: int, info: TensorInfo) -> torch.Tensor:
    """A tensor the kernels do not read, decoded to float32 ``[out, in]`` (or ``[n]``)."""
    raw = data[start : start + _tensor_bytes(info)]
    shape = [int(d) for d in reversed(info.dims)]
    if info.ggml_type in _FLOAT_TYPES:
        return torch.from_numpy(raw.numpy().view(_FLOAT_TYPES[info.ggml_type]).astype(np.float32)).reshape(shape)
    if info.ggml_type == _BF16:
        return raw.view(torch.bfloat16).float().reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.numpy(), GGMLQuantizationType(info.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _consumed_names(model: Any) -> set[str]:
    """HF names whose values the model now holds as blocks (its float parameters not needed)."""
    names: set[str] = set()
    head = model.projections["head"].blocks
    if head is not None and head.source == "gguf":
        names.add("model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight")
    for index, layer in enumerate(model.layers):
        for name, projection in layer.projections.items():
            if projection.blocks is not None and projection.blocks.source == "gguf":
                names.update(f"model.layers.{index}.{part}" for part in PROJECTION_PARTS[name])
    return names


def _drop_floats(model: Any, blocks: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Placeholders for every float parameter the blocks replace, and the embedding's blocks."""
    for projection in quantized_projections(model):
        if projection.blocks is not None and projection.blocks.source == "gguf":
            projection.drop_float()
    embed = blocks.get("model.embed_tokens.weight")
    head = model.projections["head"].blocks
    if model.lm_head is None and head is not None and head.source == "gguf":
        model._embed_blocks = head
    elif embed is not None and fits(embed[0], model.embed_tokens.shape[1]) and embed[0] in BLOCK_FORMATS:
        model._embed_blocks = QuantizedLinear.single(embed[1], embed[0], "gguf", int(model.embed_tokens.shape[1]))
        model.register_buffer("embed_tokens_blocks", embed[1], persistent=False)  # counted in weights_bytes
        model.embed_tokens = placeholder(model.embed_tokens)


def load_as_blocks(runner: Any, progress: ProgressCallback | None = None) -> LoadInfo:
    """Load ``runner``'s model from its GGUF as blocks (the quantized entries through
    ``runner.install_quantized``) and decode only the tensors no entry holds."""
    start = time.perf_counter()
    model, config = runner.model, runner.model_config
    path = weights_location(config)
    header = read_gguf_header(path)
    mapped = map_file(path)
    blocks = read_gguf_blocks(config, runner.load_format, mapped)
    runner.quantization_counts = runner.install_quantized(runner.quantization, blocks)
    consumed = _consumed_names(model)
    _drop_floats(model, blocks)
    if model._embed_blocks is not None:
        consumed.add("model.embed_tokens.weight")
    seen, total = set(consumed), len(header.tensors)
    for count, info in enumerate(header.tensors, start=1):
        hf_name = gguf_to_hf_name(info.name, config.architecture)
        if hf_name is not None and hf_name not in consumed:
            tensor = _float_tensor(mapped, header.data_start + info.offset, info)
            if config.family.gguf_rotary_permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight",
                                                                         "q_proj.bias", "k_proj.bias")):
                heads = config.num_attention_heads if "q_proj" in hf_name else config.num_kv_heads
                tensor = torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(tensor.numpy(), heads)))
            model.hf_layout.load(hf_name, tensor)
            seen.add(hf_name)
        if progress:
            progress(count, total)
    missing = model.hf_layout.missing(seen)
    if missing:
        from engine.errors import UserError

        raise UserError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    entries = quantized_linears(model)
    held_blocks = sum(q.nbytes for q in entries)
    if model._embed_blocks is not None and not any(q is model._embed_blocks for q in entries):
        held_blocks += model._embed_blocks.nbytes
    return LoadInfo(load_format="gguf", source=str(path), weights_bytes=model.weights_bytes(),
                    load_seconds=time.perf_counter() - start, num_tensors=total, cache="mapped",
                    file_tensor_bytes=sum(_tensor_bytes(t) for t in header.tensors), block_bytes=held_blocks)
