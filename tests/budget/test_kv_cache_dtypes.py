"""One --kv-cache-dtype table (engine/modelspec/kv_cache_dtypes.py) for the budget and the
attention wing: the bytes the plan counts are the bytes the cache stores."""

from __future__ import annotations

import pytest
import torch

from engine.budget.memory import kv_dtype_bytes, kv_scale_bytes
from engine.errors import UserError
from engine.model.attention.kv_quant import cache_row_width, kv_cache_torch_dtype
from engine.modelspec.config import KV_CACHE_DTYPE_CHOICES
from engine.modelspec.kv_cache_dtypes import KV_CACHE_DTYPES


@pytest.mark.parametrize("name", sorted(KV_CACHE_DTYPES))
def test_the_budget_counts_what_the_cache_stores(name: str) -> None:
    stored = kv_cache_torch_dtype(name, torch.float32)
    assert stored.itemsize == kv_dtype_bytes(name, "float32")
    head_dim = 64  # the row the cache allocates per (slot, KV head): elements plus int8's scale
    assert cache_row_width(head_dim, stored) * stored.itemsize == head_dim * kv_dtype_bytes(name, "float32") + \
        kv_scale_bytes(name)


def test_auto_follows_the_model_and_every_choice_is_in_the_table() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16 and kv_dtype_bytes("auto", "bfloat16") == 2
    assert set(KV_CACHE_DTYPE_CHOICES) - {"auto"} <= set(KV_CACHE_DTYPES)
    for wing in (lambda: kv_cache_torch_dtype("fp4", torch.float32), lambda: kv_dtype_bytes("fp4", "float32")):
        with pytest.raises(UserError, match="--kv-cache-dtype 'fp4': use one of auto, bfloat16"):
            wing()
