"""Phase D's measured result, kept on disk so a warm CPU start does not re-measure it.

On a 2-core CPU the profile run measures the same peak every time for the same inputs. On
CPU it is measured in parts (engine/model/memory/profile_parts.py): the entry holds the peak as a
function of the step's tokens, so a start whose kernel plan chose another step budget
evaluates the stored line at its own (``ProfileResult.at_tokens``). The entry is keyed by
everything that decides that peak: the weights' content (not their path), dtype,
quantization, KV cache dtype, attention backend, block size, the step shape (the step sizes
profiled; ``max_num_seqs``), where the whole step is measured its tokens too, in the entry's name:
a start with a smaller budget reuses the entry of a bigger step (``load_covering``),
threads, torch version, ISA, and a hash of the source files that allocate during the run
(everything under engine/model/). Change any of them and the run is measured again. CUDA always measures: free device memory is shared with other
processes and the run also warms compiled kernels.

An entry is one small JSON file under ``<cache dir>/profiles/`` (or the folder
``KVSCOPE_PROFILE_CACHE`` names), written to a temporary name and renamed; an
unreadable entry is a miss. ``KVSCOPE_PROFILE_CACHE=0`` (or ``KVSCOPE_CACHE_DIR=off``)
always measures. The phase D event says which it
was (``cached``) and when the reused figure was measured (``measured_at``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from engine.model.loading.startup_cache import atomic_write, cache_dir, content_fingerprint, touch

PROFILE_CACHE_ENV = "KVSCOPE_PROFILE_CACHE"
PROFILE_FORMAT_VERSION = 2  # 2: the peak as a function of the step's tokens (engine/model/memory/profile_parts.py)
MAX_ENTRIES = 64  # a few bytes each; the oldest go past this
# Sources whose allocations the profile run measures: the whole model wing.
_MODEL_ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True, frozen=True)
class ProfileResult:
    activation_peak_bytes: int  # at ``tokens`` step tokens
    non_torch_bytes: int
    method: str
    forward_s: float
    sample_s: float
    measured_at: float  # unix time of the measurement
    cached: bool = False  # True when read back from the cache rather than measured now
    # The peak at any step's tokens (engine/model/memory/profile_parts.py PeakFunction.to_json()); None: the
    # whole step was measured at ``tokens`` only.
    peak_function: dict[str, Any] | None = None
    tokens: int = 0
    profiled_tokens: tuple[int, ...] = ()  # the step sizes the forward ran at

    def at_tokens(self, tokens: int) -> ProfileResult:
        """This profile for a step of ``tokens`` (a stored one reused under another budget): the
        peak function evaluated there; a profile of the whole step only at its own ``tokens``."""
        if self.peak_function is None or tokens == self.tokens:
            return self
        from engine.model.memory.profile_parts import PeakFunction

        peak = PeakFunction.from_json(self.peak_function).at(tokens)
        return replace(self, activation_peak_bytes=peak, tokens=tokens)


def profile_root() -> Path | None:
    """``<cache dir>/profiles``, a folder ``KVSCOPE_PROFILE_CACHE`` names, or None when
    it is ``0``/``off`` or the whole cache is off."""
    value = os.environ.get(PROFILE_CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    if value and value.lower() not in ("1", "on", "true", "yes"):
        return Path(value).expanduser()
    root = cache_dir()
    return None if root is None else root / "profiles"


@cache
def source_hash() -> str:
    """Hash of the engine sources that allocate during the profile run (engine/model/)."""
    digest = hashlib.sha256()
    for file in sorted(_MODEL_ROOT.rglob("*.py")):
        digest.update(file.relative_to(_MODEL_ROOT).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def weights_identity(model_path: str | None, model_facts: Mapping[str, Any]) -> str:
    """The weights' content fingerprint (GGUF file, or an HF folder's config and weight
    files by size), or the model's shape facts when it has no files (dummy weights)."""
    if model_path:
        path = Path(model_path)
        if path.is_file():
            return content_fingerprint(path)
        if path.is_dir():
            digest = hashlib.sha256()
            for file in sorted(path.iterdir()):
                if file.suffix in (".json", ".safetensors", ".bin"):
                    digest.update(f"{file.name}:{file.stat().st_size}".encode())
            config = path / "config.json"
            if config.is_file():
                digest.update(config.read_bytes())
            return digest.hexdigest()[:24]
    return hashlib.sha256(json.dumps(dict(model_facts), sort_keys=True, default=str).encode()).hexdigest()[:24]


def profile_key(parts: Mapping[str, Any]) -> str:
    text = json.dumps({"format": PROFILE_FORMAT_VERSION, "source": source_hash(), **parts}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _entry(key: str) -> Path | None:
    root = profile_root()
    return None if root is None else root / f"{key}.json"


def load(key: str) -> ProfileResult | None:
    """The stored result for ``key``, or None (disabled, absent or unreadable)."""
    path = _entry(key)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        result = ProfileResult(**{f.name: data[f.name] for f in fields(ProfileResult) if f.name != "cached"})
        result = replace(result, profiled_tokens=tuple(result.profiled_tokens))
        result.at_tokens(result.tokens + 1)  # a malformed peak function is a miss, not a failed start
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if result.activation_peak_bytes <= 0 or result.non_torch_bytes < 0:
        return None
    touch(path)
    return replace(result, cached=True)


def whole_step_key(base: str, tokens: int) -> str:
    """The entry of a whole step measured at ``tokens`` (``base``: the key of everything else)."""
    return f"{base}-t{tokens}"


def load_covering(base: str, tokens: int) -> ProfileResult | None:
    """A whole step's stored result at the fewest tokens >= ``tokens`` for ``base``, or None. A
    bigger step's peak bounds a smaller one's from above, so a start whose kernel plan chose a
    smaller budget than an earlier start's reuses it (a hybrid layout's step is measured whole,
    at one size: engine/model/memory/profile_parts.py applies to one KV table only)."""
    root = profile_root()
    if root is None or not root.is_dir():
        return None
    prefix = f"{base}-t"
    sizes = sorted(int(digits) for p in root.glob(f"{prefix}*.json")
                   if (digits := p.stem.removeprefix(prefix)).isdigit() and int(digits) >= tokens)
    for size in sizes:
        found = load(whole_step_key(base, size))
        if found is not None:
            return found if size == tokens else replace(
                found, method=f"{found.method}; measured at {size:,} tokens, an upper bound at {tokens:,}")
    return None


def store(key: str, result: ProfileResult) -> None:
    """Write the entry (best effort: a read-only cache still starts) and keep the newest
    ``MAX_ENTRIES``."""
    path = _entry(key)
    if path is None:
        return
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps({**asdict(result), "cached": False})))
        entries = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass

