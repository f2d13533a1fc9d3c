"""KVCacheManager with one full-attention group: prefix hits in full blocks, allocation,
freeing, usage."""

from __future__ import annotations

from pathlib import Path

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request


def _admit(kv: KVCacheManager, req: Request) -> int:
    hits, hit_tokens = kv.get_computed_blocks(req)
    num_new = req.num_tokens - hit_tokens
    assert kv.allocate_slots(req, num_new, hits, hit_tokens) is not None
    kv.record_lookup(req.num_tokens, hit_tokens)
    req.num_computed_tokens = hit_tokens + num_new
    return hit_tokens


def test_shared_1000_token_prefix_hits_992_tokens() -> None:
    kv = KVCacheManager(num_blocks=500, block_size=16)
    prefix = list(range(1000, 2000))
    first = Request("a", [*prefix, *range(5000, 5040)], 10)
    second = Request("b", [*prefix, *range(7000, 7040)], 10)
    assert _admit(kv, first) == 0
    assert _admit(kv, second) == 992
    assert second.block_tables[0][:62] == first.block_tables[0][:62]
    assert second.block_tables[0][62] != first.block_tables[0][62]
    assert kv.prefix_query_tokens == 2 * 1040
    assert kv.prefix_hit_tokens == 992
    kv.pool.check_integrity([*first.block_tables, *second.block_tables])


def test_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=16)
    tokens = list(range(32))
    _admit(kv, Request("a", tokens, 4))
    again = Request("b", tokens, 4)
    hits, hit_tokens = kv.get_computed_blocks(again)
    assert hit_tokens == 16 and [len(h) for h in hits] == [1]  # one group; the last token must be computed


def test_hit_survives_the_owner_finishing_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", list(range(9)), 1)
    _admit(kv, a)
    kv.free(a)
    b = Request("b", list(range(9)), 1)
    assert _admit(kv, b) == 8
    kv.free(b)
    # fill the pool with other content: the old blocks get evicted
    c = Request("c", list(range(100, 116)), 1)
    _admit(kv, c)
    d = Request("d", list(range(9)), 1)
    assert kv.get_computed_blocks(d)[1] == 0


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = Request("a", list(range(8)), 4)
    _admit(kv, a)
    before = (kv.pool.num_free, list(a.block_tables[0]))
    b = Request("b", list(range(50, 62)), 4)
    assert kv.allocate_slots(b, 12) is None
    assert (kv.pool.num_free, list(a.block_tables[0])) == before and b.block_tables == ()
    kv.pool.check_integrity(a.block_tables)


def test_decode_allocates_a_block_only_at_a_boundary() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("a", list(range(4)), 8)
    _admit(kv, r)
    assert r.num_table_blocks == 1
    r.token_ids.append(99)
    assert kv.allocate_slots(r, 1) == [1]
    r.num_computed_tokens += 1
    r.token_ids.append(98)
    assert kv.allocate_slots(r, 1) == []


def test_free_is_reverse_order_and_usage_counts_cached_as_free() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = Request("a", list(range(12)), 2)
    _admit(kv, r)
    assert kv.usage == 0.3
    table = list(r.block_tables[0])
    assert kv.free(r) == table
    assert kv.pool.free_queue_order()[-3:] == table[::-1]
    assert kv.usage == 0.0 and r.block_tables == ()


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    _admit(kv, Request("a", list(range(12)), 2))
    assert _admit(kv, Request("b", list(range(12)), 2)) == 0
    assert kv.pool.cached_block_ids() == set()
    assert kv.prefix_query_tokens == 0


def test_a_finished_requests_blocks_are_evicted_tail_first() -> None:
    """llm-d's indexer assumes it (llm-d-inference-sim#704): a finished request's blocks
    are freed tail first, so eviction takes its chain from the end and the ancestors of
    every block still cached stay cached; a router's prefix index never holds a child
    without its parent."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = Request("a", list(range(17)), 1)  # 4 full blocks, cached, and a partial one
    _admit(kv, a)
    chain = [kv.pool.lookup(h) for h in a.block_hashes[:4]]
    assert None not in chain
    kv.free(a)
    for i in range(1, 6):  # each newcomer takes one more block, evicting one of a's cached ones
        taker = Request(f"n{i}", list(range(1000 * i, 1000 * i + 4 * i - 1)), 1)
        _admit(kv, taker)
        still = [kv.pool.lookup(h) is not None for h in a.block_hashes[:4]]
        assert still == sorted(still, reverse=True), f"after {i} blocks taken, cached: {still}"  # a prefix
        kv.free(taker)
    assert not any(kv.pool.lookup(h) is not None for h in a.block_hashes[:4])  # all gone in the end


def test_cache_salt_partitions_the_prefix_cache() -> None:
    """vLLM's cache_salt: a prompt hits only blocks cached under the same salt (none under
    another salt or under no salt), and the salt's root hash is the same in every process."""
    import subprocess
    import sys

    from engine.core.kv_cache import root_hash
    from engine.core.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=500, block_size=16)
    prompt = list(range(1000, 1100))

    def salted(rid: str, salt: str | None) -> Request:
        return Request(rid, prompt, 10, sampling=SamplingParams(cache_salt=salt))

    assert _admit(kv, salted("a", "tenant-1")) == 0
    assert _admit(kv, salted("b", "tenant-2")) == 0
    assert _admit(kv, salted("c", None)) == 0
    assert _admit(kv, salted("d", "tenant-1")) == 96
    assert _admit(kv, salted("e", None)) == 96
    here = root_hash(salted("f", "tenant-1"))
    code = ("from engine.core.kv_cache import root_hash; from engine.core.request import Request; "
            "from engine.core.sampling_params import SamplingParams; "
            "print(root_hash(Request('x', [1], 1, sampling=SamplingParams(cache_salt='tenant-1'))))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=Path(__file__).resolve().parents[2])
    assert int(other.stdout) == here


def test_an_empty_or_non_string_cache_salt_is_refused() -> None:
    import pytest

    from engine.core.sampling_params import SamplingParams
    from engine.errors import UserError

    for bad in ("", 7):
        with pytest.raises(UserError, match=r"cache_salt .* non-empty string"):
            SamplingParams(cache_salt=bad)  # type: ignore[arg-type]
