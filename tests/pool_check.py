"""The block pool's invariants, asserted by tests after every operation that could break them."""
from __future__ import annotations

from collections import Counter

from octavo.runtime.block_manager import BlockManager


def check_pool(bm: BlockManager, tables: list[list[int]]) -> None:
    """Assert BM's invariants given every live block table."""
    counts = Counter(b for table in tables for b in table)
    assert [counts[b] for b in range(bm.num_blocks)] == bm.ref_count, "refcounts disagree with the block tables"
    assert len(counts) + len(bm.free_lru) == bm.num_blocks, "free + used != total"
    assert all(bm.ref_count[b] == 0 for b in bm.free_lru), "a referenced block is in the free list"
    assert all(bm.hash_of[b] == h for h, b in bm.hash_to_block.items()), "hash map out of sync"
    assert all(req.block_table for req in bm.promised.values()), "a promise held by a request without blocks"
    assert not bm.promised.keys() & bm.hash_to_block.keys(), "a filled block is still promised"
