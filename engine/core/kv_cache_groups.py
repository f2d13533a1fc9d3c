"""KV cache specs and groups: which layers share a block table (vLLM V1's hybrid layout).

A layer's KV cache spec says how much of the past it attends to: full attention (every
token) or a sliding window of ``W`` tokens (the token itself and the ``W - 1`` before
it). Layers are grouped by spec as vLLM groups them for one shared pool with one page
size (``kv_cache_utils._get_kv_cache_groups_uniform_page_size``): every group has the
same number of layers, so a block (one page per layer of its group) has one size, and
one block id names the same-sized slice of memory in every group.

The grouping rule: collect the layers of each spec in order of first appearance; the
group size is the smallest spec's layer count, or the largest's when the largest is
under 1.5x the smallest (fewer padding layers); each spec's layers split into
``ceil(n / size)`` groups, group ``i`` taking every ``num_groups``-th layer from ``i``.
Gemma 3 270M (18 layers, five sliding then one full, three times): 15 sliding and 3
full layers -> size 3 -> five sliding groups (layers 0,6,12 / 1,7,13 / ...) then one
full group (5, 11, 17).

A model whose layers are all full attention has one group. A config's ``kv_cache_groups``
() stands for that group (:func:`resolve_groups`; :func:`config_groups` is the inverse), so a
full-attention model's config, recording and profile key name no groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FULL_ATTENTION = "full_attention"  # transformers' layer type and vLLM's KVCacheSpecKind
SLIDING_ATTENTION = "sliding_attention"  # transformers' layer type
SLIDING_WINDOW_KIND = "sliding_window"  # vLLM's KVCacheSpecKind for it
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One layer's KV cache: ``sliding_window`` tokens (None: full attention)."""

    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def kind(self) -> str:
        """vLLM's ``kv_cache_spec_kind`` (the KV events' field)."""
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_WINDOW_KIND

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token to compute (vLLM's
        ``get_num_skipped_tokens``): with window 4 and 7 computed, the next token (7)
        attends to 4..7, so 4 are skipped. 0 for full attention."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def max_blocks(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once in a group of
        this spec: all of them for full attention; for a window, the window before the
        largest chunk plus the chunk, and one more for a window that straddles a block
        boundary (vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``)."""
        every = _cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return every
        return min(every, _cdiv(self.sliding_window - 1 + max_num_batched_tokens, block_size) + 1)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sliding_window": self.sliding_window}


FULL = KVCacheSpec()


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers (indices into the model's layers) that share one block table."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "layers": list(self.layers)}


def layer_specs(layer_types: Sequence[str], sliding_window: int | None) -> list[KVCacheSpec]:
    """Each layer's spec from transformers' ``layer_types`` and ``sliding_window``."""
    specs: list[KVCacheSpec] = []
    for i, kind in enumerate(layer_types):
        if kind == FULL_ATTENTION:
            specs.append(FULL)
        elif kind == SLIDING_ATTENTION:
            if not sliding_window:
                raise ValueError(f"layer {i} is {SLIDING_ATTENTION} but the model has no sliding_window")
            specs.append(KVCacheSpec(sliding_window))
        else:
            raise ValueError(f"layer {i}: layer type {kind!r} has no KV cache spec here; use one of "
                             f"{', '.join(LAYER_TYPES)}")
    return specs


def group_layers(specs: Sequence[KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """vLLM's uniform-page-size grouping (see the module docstring)."""
    if not specs:
        raise ValueError("a model with no layers has no KV cache groups")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    if len(by_spec) == 1:
        ((spec, layers),) = by_spec.items()
        return (KVCacheGroup(spec, tuple(layers)),)
    counts = [len(layers) for layers in by_spec.values()]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    groups: list[KVCacheGroup] = []
    for spec, layers in by_spec.items():
        num_groups = _cdiv(len(layers), size)
        groups.extend(KVCacheGroup(spec, tuple(layers[i::num_groups])) for i in range(num_groups))
    return tuple(groups)


def kv_cache_groups(layer_types: Sequence[str] | None, sliding_window: int | None,
                    num_layers: int = 1) -> tuple[KVCacheGroup, ...]:
    """The groups of a model: one full-attention group when ``layer_types`` is None."""
    if not layer_types:
        return (KVCacheGroup(FULL, tuple(range(num_layers))),)
    return group_layers(layer_specs(layer_types, sliding_window))


def is_hybrid(groups: Sequence[KVCacheGroup]) -> bool:
    """More than one group, or a window: anything but one full-attention group."""
    return len(groups) > 1 or any(g.spec.is_sliding for g in groups)


# What a config's () stands for: one full-attention group of every layer (the layers are
# the runner's business; the KV cache manager reads only the spec).
DEFAULT_GROUPS = (KVCacheGroup(FULL, ()),)


def resolve_groups(groups: Sequence[KVCacheGroup]) -> tuple[KVCacheGroup, ...]:
    """The groups a config's ``kv_cache_groups`` stands for: () is one full-attention group."""
    return tuple(groups) or DEFAULT_GROUPS


def config_groups(groups: Sequence[KVCacheGroup]) -> tuple[KVCacheGroup, ...]:
    """The groups as a config names them: () for one full-attention group (the default),
    so its ``engine.config``, recordings and profile keys read as they always have."""
    return tuple(groups) if is_hybrid(groups) else ()


def groups_to_config(groups: Iterable[KVCacheGroup]) -> list[dict[str, Any]]:
    """The groups as the ``kv_cache_groups`` entry of ``engine.config`` (JSON)."""
    return [g.to_dict() for g in groups]


def groups_from_config(entries: Iterable[Mapping[str, Any]] | None) -> tuple[KVCacheGroup, ...]:
    """Inverse of :func:`groups_to_config`; () for a recording without the entry."""
    out: list[KVCacheGroup] = []
    for entry in entries or ():
        window = entry.get("sliding_window")
        out.append(KVCacheGroup(KVCacheSpec(int(window) if window else None),
                                tuple(int(x) for x in entry.get("layers") or ())))
    return tuple(out)


def parse_layer_pattern(pattern: str, num_layers: int) -> tuple[str, ...]:
    """``"5:1"`` (five sliding, one full, repeated) or an explicit comma list of
    ``sliding``/``full`` as transformers' ``layer_types`` for ``num_layers`` layers."""
    text = pattern.strip()
    if ":" in text:
        sliding_text, full_text = text.split(":", 1)
        sliding, full = int(sliding_text), int(full_text)
        if sliding < 0 or full < 0 or sliding + full == 0:
            raise ValueError(f"layer pattern {pattern!r}: give SLIDING:FULL counts, e.g. 5:1")
        period = [SLIDING_ATTENTION] * sliding + [FULL_ATTENTION] * full
        return tuple(period[i % len(period)] for i in range(num_layers))
    names = {"sliding": SLIDING_ATTENTION, "full": FULL_ATTENTION, SLIDING_ATTENTION: SLIDING_ATTENTION,
             FULL_ATTENTION: FULL_ATTENTION}
    items = [t.strip() for t in text.split(",") if t.strip()]
    if len(items) != num_layers or any(t not in names for t in items):
        raise ValueError(f"layer pattern {pattern!r}: give SLIDING:FULL (e.g. 5:1) or {num_layers} comma-separated "
                         "'sliding'/'full' entries")
    return tuple(names[t] for t in items)
