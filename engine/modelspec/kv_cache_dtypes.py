"""The ``--kv-cache-dtype`` values, one table for the budget (bytes per element and per
scale) and the attention wing (the storage dtype): vLLM's names, kvscope's int8, and the
spellings both accept. Imports no torch: the attention wing maps ``torch_name`` itself."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UserError
from engine.modelspec.config import INT8_KV_SCALE_BYTES, KV_CACHE_DTYPE_CHOICES


@dataclass(frozen=True, slots=True)
class KvCacheDtype:
    """How one KV cache element is stored."""

    name: str  # the canonical name (fp8 is vLLM's fp8_e4m3)
    element_bytes: int
    scale_bytes: int  # stored per (token, KV head) for each of K and V: int8's fp32 scale; fp8 uses scale 1.0
    torch_name: str  # the torch dtype's attribute name


_ENTRIES = (
    KvCacheDtype("float32", 4, 0, "float32"),
    KvCacheDtype("bfloat16", 2, 0, "bfloat16"),
    KvCacheDtype("float16", 2, 0, "float16"),
    KvCacheDtype("fp8_e4m3", 1, 0, "float8_e4m3fn"),
    KvCacheDtype("fp8_e5m2", 1, 0, "float8_e5m2"),
    KvCacheDtype("int8", 1, INT8_KV_SCALE_BYTES, "int8"),
)
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3"}
KV_CACHE_DTYPES: dict[str, KvCacheDtype] = {
    **{e.name: e for e in _ENTRIES}, **{alias: next(e for e in _ENTRIES if e.name == name) for alias, name in ALIASES.items()}}


def check_kv_cache_dtype(value: str, flag: str = "--kv-cache-dtype") -> str:
    """The lower-cased name as given (``auto``, a choice or an alias), or a UserError naming the choices."""
    key = str(value).strip().lower()
    if key != "auto" and key not in KV_CACHE_DTYPES:
        raise UserError(f"{flag} {value!r}: use one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return key


def resolve_kv_cache_dtype(value: str, model_dtype: str) -> KvCacheDtype:
    """The storage of ``--kv-cache-dtype value``: ``auto`` is the model dtype's."""
    key = check_kv_cache_dtype(value)
    if key == "auto":
        key = model_dtype.replace("torch.", "").lower()
        if key not in KV_CACHE_DTYPES:
            raise UserError(f"--dtype {model_dtype!r}: no KV cache storage known for it")
    return KV_CACHE_DTYPES[key]
