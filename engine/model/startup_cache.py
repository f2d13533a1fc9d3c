"""On-disk cache of what startup derives from a GGUF file: the dequantized, fused
weights (a safetensors file read back through mmap) and the built tokenizer
(a ``tokenizer.json`` plus its special-token facts).

Dequantizing the GGUF in numpy and rebuilding the BPE from its vocabulary take
most of a cold start on CPU; both depend only on the file, so they are cached
under ``$KVSCOPE_CACHE_DIR`` (default ``~/.cache/kvscope``), keyed by the file's
absolute path, size and mtime (and the dtype for weights). Entries are written
to a temporary name and renamed, so a crash never leaves a half-written entry
that a later start would trust. ``KVSCOPE_CACHE_DIR=off`` disables the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

# Bump when the cached layout changes (fused parameter names, tokenizer fields).
CACHE_FORMAT_VERSION = 1
CACHE_ENV = "KVSCOPE_CACHE_DIR"


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is switched off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "kvscope"


def cache_key(source: Path, *parts: str) -> str:
    """Stable name for an entry derived from ``source``: changes when the file does."""
    stat = source.stat()
    text = "|".join([str(CACHE_FORMAT_VERSION), str(source.resolve()), str(stat.st_size),
                     str(stat.st_mtime_ns), *parts])
    return f"{source.stem[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _atomic_write(target: Path, write: Any) -> None:
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
def weights_path(source: Path, dtype: torch.dtype) -> Path | None:
    root = cache_dir()
    return None if root is None else root / f"{cache_key(source, str(dtype))}.safetensors"


def load_cached_weights(model: torch.nn.Module, path: Path) -> bool:
    """Fill ``model``'s parameters from a cache entry; False if absent or unusable."""
    if not path.is_file():
        return False
    from safetensors import safe_open

    params = dict(model.named_parameters())
    try:
        with safe_open(str(path), framework="pt") as handle:
            if set(handle.keys()) != set(params):
                return False
            for name, param in params.items():
                tensor = handle.get_tensor(name)
                if tensor.shape != param.shape or tensor.dtype != param.dtype:
                    return False
                with torch.no_grad():
                    param.copy_(tensor)
    except Exception:  # a corrupt entry is a cache miss, never a failed start
        return False
    return True


def save_cached_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    _atomic_write(path, lambda tmp: save_file(tensors, tmp))


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

    from engine.model.tokenizer import Tokenizer

    paths = tokenizer_paths(source)
    if paths is not None and paths[0].is_file() and paths[1].is_file():
        try:
            meta = json.loads(paths[1].read_text())
            backend = BackendTokenizer.from_file(str(paths[0]))
            return Tokenizer(backend, meta["bos_token_id"], meta["eos_token_id"], meta["chat_template"],
                             meta["stop_token_ids"], meta["add_bos_token"])
        except Exception:
            pass  # unusable entry: rebuild and overwrite it
    tokenizer = Tokenizer.from_gguf(source)
    if paths is not None:
        meta = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "chat_template": tokenizer.chat_template, "stop_token_ids": tokenizer.stop_token_ids,
                "add_bos_token": tokenizer.add_bos_token}
        try:
            _atomic_write(paths[0], lambda tmp: tokenizer.backend.save(tmp))
            _atomic_write(paths[1], lambda tmp: Path(tmp).write_text(json.dumps(meta)))
        except OSError:
            pass  # a read-only home still starts, just without the cache
    return tokenizer
