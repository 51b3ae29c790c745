"""BlockManager: refcounts, on-demand growth, prefix caching and LRU eviction, plus a hypothesis
property test that drives it with random requests and checks it against a shadow copy of the pool."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.request import Request
from octavo.runtime.sampling_params import SamplingParams
from pool_check import check_pool


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams(),
                   generator=np.random.default_rng(0), max_tokens=16, arrival_order=0)


def compute(bm: BlockManager, r: Request, n: int) -> None:
    assert bm.allocate(r, n)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)


def test_grow_on_demand_and_release() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    r = req(list(range(10)))
    assert bm.allocate(r, 3) and len(r.block_table) == 1
    r.num_computed_tokens = 3
    assert bm.allocate(r, 2) and len(r.block_table) == 2  # crosses into the second block
    r.num_computed_tokens = 5
    assert not bm.allocate(r, 100) and len(r.block_table) == 2  # refused: nothing changed
    check_pool(bm, [r.block_table])
    bm.release(r)
    assert bm.num_free_blocks == 4 and r.block_table == []
    check_pool(bm, [])


def test_prefix_hit_shares_blocks_and_never_covers_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(list(range(12)), "a")
    compute(bm, a, 12)
    b = req(list(range(12)), "b")
    cached = bm.find_cached(b)
    assert cached == a.block_table[:2]  # 3 full blocks match but the last token must be computed
    assert bm.can_admit(b, cached, 4)
    bm.admit(b, cached)
    assert b.num_computed_tokens == 8
    assert bm.allocate(b, 4)
    assert bm.ref_count[cached[0]] == 2
    check_pool(bm, [a.block_table, b.block_table])
    c = req(list(range(8)) + [99, 98, 97, 96, 95], "c")  # diverges in block 3
    assert bm.find_cached(c) == a.block_table[:2]
    d = req([1] + list(range(1, 12)), "d")  # differs in the first token: no hit at all
    assert bm.find_cached(d) == []


def test_freed_blocks_stay_cached_and_tail_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5, 6, 7], "a")
    compute(bm, a, 7)  # 4 blocks: 3 full (hashed) + 1 partial
    table = list(a.block_table)
    bm.release(a)
    assert bm.num_free_blocks == 4
    # eviction order: the unhashed partial block, then the tail (block 2), then 1, then the head
    assert list(bm.free_lru) == [table[3], table[2], table[1], table[0]]
    b = req([1, 2, 3, 4, 5, 6, 9], "b")
    cached = bm.find_cached(b)
    assert cached == table[:3]  # still cached after the free
    assert bm.can_admit(b, cached, 1)
    bm.admit(b, cached)
    assert bm.num_free_blocks == 1
    other = req([50, 51], "o")
    assert bm.allocate(other, 2)  # takes the last free block (the old partial one)
    assert other.block_table == [table[3]]
    check_pool(bm, [b.block_table, other.block_table])


def test_eviction_drops_the_hash() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = req([1, 2, 3], "a")
    compute(bm, a, 3)
    bm.release(a)
    x = req([9, 9, 9, 9], "x")
    assert bm.allocate(x, 4)  # evicts both cached blocks
    assert bm.find_cached(req([1, 2, 3], "again")) == []
    assert bm.hash_to_block == {}


def test_can_admit_counts_revived_free_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = req([1, 2, 3, 4, 5], "a")
    compute(bm, a, 5)
    bm.release(a)  # 2 hashed free blocks + 1 partial
    b = req([1, 2, 3, 4, 7, 8, 9], "b")
    cached = bm.find_cached(b)
    assert len(cached) == 2
    assert bm.can_admit(b, cached, 2)  # 2 revived + 1 new = 3
    assert not bm.can_admit(b, cached, 3)  # 2 revived + 2 new > 3


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = req([1, 2, 3, 4, 5], "a")
    compute(bm, a, 5)
    assert bm.find_cached(req([1, 2, 3, 4, 5], "b")) == [] and bm.hash_to_block == {}


def test_promises_are_filled_or_withdrawn() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = req([1, 2, 3, 4, 5, 6, 7], "a")
    assert bm.allocate(a, 4)
    bm.promise(a)  # a will compute 3 full blocks
    assert list(bm.promised) == a.block_hashes[:3] and set(bm.promised.values()) == {a}
    b = req([1, 2, 3, 4, 9, 9, 9], "b")
    assert bm.find_cached(b) == [] and bm.producer_of_next(b, 0) is a
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)  # blocks 0 and 1 filled
    assert bm.promised == {a.block_hashes[2]: a}
    assert bm.find_cached(b) == a.block_table[:2] and bm.producer_of_next(b, 2) is None  # b's block 2 differs
    c = req([1, 2, 3, 4, 5, 6, 7, 8, 0], "c")
    assert bm.find_cached(c) == a.block_table[:2] and bm.producer_of_next(c, 2) is a
    check_pool(bm, [a.block_table])
    bm.release(a)  # preempted or aborted before filling block 2
    assert bm.promised == {} and bm.producer_of_next(c, 2) is None
    assert len(bm.find_cached(c)) == 2  # what a filled stays cached


def test_the_last_token_block_is_never_waited_for() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = req([1, 2, 3, 4], "a")
    assert bm.allocate(a, 4)
    bm.promise(a)
    same = req([1, 2, 3, 4], "same")  # block 1 holds its last token: it computes it anyway
    assert bm.find_cached(same) == [] and bm.producer_of_next(same, 0) is a
    a.num_computed_tokens = 2
    bm.cache_full_blocks(a)
    assert len(bm.find_cached(same)) == 1 and bm.producer_of_next(same, 1) is None


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "free"]), st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), ops=ops, caching=st.booleans())
def test_property_random_workload(num_blocks: int, block_size: int, ops: list, caching: bool) -> None:
    """No leak, no double ownership, free + used == total, and a cache hit always returns blocks whose
    shadow content equals the requesting prefix."""
    bm = BlockManager(num_blocks, block_size, caching)
    shadow: dict[int, dict[int, int]] = {b: {} for b in range(num_blocks)}  # block -> offset -> token
    live: list[Request] = []
    for k, (op, x) in enumerate(ops):
        if op == "new":
            rng = np.random.default_rng(x)
            r = req([int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 20)))], f"r{k}")
            cached = bm.find_cached(r)
            for i, b in enumerate(cached):
                assert [shadow[b].get(o) for o in range(block_size)] == r.tokens(i * block_size, (i + 1) * block_size)
            n = 1 + x % (r.num_tokens - len(cached) * block_size)
            if bm.can_admit(r, cached, n):
                bm.admit(r, cached)
                assert bm.allocate(r, n)
                bm.promise(r)
                for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                    shadow[r.block_table[p // block_size]][p % block_size] = r.token(p)
                r.num_computed_tokens += n
                bm.cache_full_blocks(r)
                live.append(r)
        elif op == "grow" and live:
            r = live[x % len(live)]
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(x % 3)  # "sample" a token
            n = 1 + x % (r.num_tokens - r.num_computed_tokens)
            before = list(r.block_table)
            if bm.allocate(r, n):
                for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                    b = r.block_table[p // block_size]
                    assert bm.ref_count[b] == 1, "writing into a shared block"
                    shadow[b][p % block_size] = r.token(p)
                r.num_computed_tokens += n
                bm.cache_full_blocks(r)
            else:
                assert r.block_table == before
        elif op == "free" and live:
            bm.release(live.pop(x % len(live)))
        check_pool(bm, [r.block_table for r in live])
        assert sum(1 for c in bm.ref_count if c) + bm.num_free_blocks == num_blocks
        assert all(any(p is r for r in live) for p in bm.promised.values()), "a promise outlived its request"
    for r in live:
        bm.release(r)
    check_pool(bm, [])
    assert bm.promised == {}
    assert bm.num_free_blocks == num_blocks


def test_fork_shares_the_full_computed_blocks_and_releases_cleanly() -> None:
    """BlockManager.fork (beam search, n > 1): the child references the parent's full computed blocks,
    not its partial last one; releasing both in any order frees everything."""
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = req(list(range(10)), "p")
    compute(bm, parent, 10)  # blocks: 2 full + 1 partial
    child = req(list(range(10)) + [99], "c")
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert [bm.ref_count[b] for b in parent.block_table] == [2, 2, 1]
    assert bm.allocate(child, 3) and len(child.block_table) == 3 and child.block_table[2] != parent.block_table[2]
    check_pool(bm, [parent.block_table, child.block_table])
    bm.release(parent)
    check_pool(bm, [child.block_table])
    bm.release(child)
    assert bm.num_free_blocks == 8
    check_pool(bm, [])
