"""BlockTables (the step's block_table input, from per-request rows that take only new blocks) against the
plain conversion of every scheduled request's whole list, while a real BlockManager grows, frees and forks
the tables between steps."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.block_table import BlockTables
from octavo.runtime.request import Request
from octavo.runtime.sampling_params import SamplingParams

BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 64, 16


def reference(reqs: list[Request]) -> np.ndarray:
    width = max(len(r.block_table) for r in reqs)
    return np.array([r.block_table + [0] * (width - len(r.block_table)) for r in reqs], np.int32)


def make(i: int) -> Request:
    return Request(request_id=str(i), prompt_token_ids=list(range(60)), params=SamplingParams(),
                   generator=np.random.default_rng(0), max_tokens=4, arrival_order=i)


ops = st.lists(st.tuples(st.sampled_from(["grow", "release", "fork", "pack"]), st.integers(0, 3),
                         st.integers(1, 9), st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True)),
               max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_pack_matches_the_whole_lists(steps: list[tuple[str, int, int, list[int]]]) -> None:
    bm = BlockManager(NUM_BLOCKS, BLOCK)
    reqs = [make(i) for i in range(4)]
    tables = BlockTables(max_num_seqs=4, max_blocks_per_seq=MAX_BLOCKS)
    for op, i, n, batch in steps:
        r = reqs[i]
        if op == "grow" and r.num_computed_tokens + n <= MAX_BLOCKS * BLOCK and bm.allocate(r, n):
            bm.commit(r, n)
        elif op == "release":
            bm.release(r)
        elif op == "fork" and reqs[(i + 1) % 4].num_computed_tokens:
            bm.release(r)
            bm.fork(reqs[(i + 1) % 4], r, copy_partial=True)
        scheduled = [reqs[j] for j in batch if reqs[j].block_table]
        if scheduled:  # packed after every operation: a row must follow a list that grew or was replaced
            got = tables.pack(scheduled)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, reference(scheduled))


def test_a_grown_table_converts_only_its_new_blocks() -> None:
    bm = BlockManager(NUM_BLOCKS, BLOCK)
    r = make(0)
    tables = BlockTables(max_num_seqs=1, max_blocks_per_seq=MAX_BLOCKS)
    assert bm.allocate(r, 2 * BLOCK)
    tables.pack([r])
    row = tables._rows[r]
    assert bm.allocate(r, 3 * BLOCK)  # grows the same list by one block
    np.testing.assert_array_equal(tables.pack([r]), reference([r]))
    assert tables._rows[r] is row and row.count == 3  # the same row, extended (not rebuilt)
