"""BlockManager: a fixed pool of KV blocks, per-request block tables and automatic prefix caching.

- Every block has a reference count. A request's block table grows on demand (`allocate`).
- A FULL block is identified by a chained hash of its tokens (block_hash.py: equal prefixes, equal
  hashes). `hash_to_block` finds them.
- Free blocks (refcount 0) sit in an LRU `free_lru` list (OrderedDict: O(1) touch and evict) and keep
  their hash until reused, so a later request with the same prefix gets them back for free. A finished
  request frees its blocks last-first: its tail is evicted before its (more shareable) head.
- Promises (cold shared prefixes): an admitted request's about-to-be-computed full blocks are in
  `promised` (hash -> that request) until filled (`cache_full_blocks`) or let go (`release`).
- The one writer of a request's KV state: block_table, num_computed_tokens (`admit`: the cached
  prefix, `commit`: a step's tokens, `release`: 0), block hashes; it counts its own cache hits.
  Speculative decoding commits only accepted tokens, so a rejected draft's KV never fills a cached block;
  `trim` gives back the blocks allocated past a request's tokens for drafts that were rejected.
- `fork`: a new request shares another's full computed blocks (beam search, n > 1); for beam search also its
  own copy of the partially filled last block (copy on write: both will write into it).
- Invariant (tests/pool_check.py checks it): free + in use == total; a block is free iff its refcount is 0.
- KV events (runtime/kv_events.py, with an `events` log): every hash registered (`BlocksStored`: runs of consecutive
  blocks with their parent hash and tokens), evicted (`BlocksRemoved`) or dropped (`CacheCleared`) is logged at the
  transition itself, so the events replay to exactly `hash_to_block`'s keys.
"""
from __future__ import annotations

from collections import OrderedDict

from octavo.runtime.block_hash import extend_block_hashes
from octavo.runtime.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KVEventLog
from octavo.runtime.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_lru: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.promised: dict[bytes, Request] = {}  # hash of a full block being computed -> the request computing it
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found
        self.events = events if enable_prefix_caching else None  # no prefix cache: nothing is ever cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_lru)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------
    def find_cached(self, req: Request) -> list[int]:
        """Blocks holding a cached prefix of req (never its last token: that one must be computed)."""
        if not self.enable_prefix_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        extend_block_hashes(req, limit * self.block_size, self.block_size)
        blocks: list[int] = []
        for h in req.block_hashes[:limit]:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cache_full_blocks(self, req: Request) -> None:
        """Register the full blocks whose K/V are now computed so that other requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_table))
        extend_block_hashes(req, n_full * self.block_size, self.block_size)
        run_start = -1  # with events: the first of the consecutive blocks registered just now
        for i in range(req.num_registered_blocks, n_full):
            b, h = req.block_table[i], req.block_hashes[i]
            if self.hash_of[b] is None and h not in self.hash_to_block:
                self.hash_of[b] = h
                self.hash_to_block[h] = b
                if self.events is not None and run_start < 0:
                    run_start = i
            elif run_start >= 0:  # already cached (another block has these tokens): the run ends before it
                self._stored(req, run_start, i)
                run_start = -1
            self.promised.pop(h, None)  # filled (by req or by whoever got there first): now in hash_to_block
        if run_start >= 0:
            self._stored(req, run_start, n_full)
        req.num_registered_blocks = max(req.num_registered_blocks, n_full)

    def _stored(self, req: Request, start: int, end: int) -> None:
        """Log req's blocks [start, end) as stored (chained: the parent is the hash of block start - 1)."""
        assert self.events is not None
        bs = self.block_size
        self.events.events.append(BlocksStored(req.block_hashes[start:end],
                                               req.block_hashes[start - 1] if start else None,
                                               req.tokens(start * bs, end * bs)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache: after new weights, or between benchmarks). Only
        when no request holds a block; returns whether it was done."""
        if len(self.free_lru) != self.num_blocks:
            return False
        self.hash_of[:] = [None] * self.num_blocks
        self.hash_to_block.clear()
        self.promised.clear()
        if self.events is not None:
            self.events.events.append(CacheCleared())
        return True

    # -- promises (cold shared prefixes) ------------------------------------------------------------
    def promise(self, req: Request) -> None:
        """Announce the full blocks an admitted req is about to compute (past its cached prefix)."""
        if not self.enable_prefix_caching:
            return
        n_full = req.num_tokens // self.block_size
        extend_block_hashes(req, n_full * self.block_size, self.block_size)
        for i in range(req.num_registered_blocks, n_full):
            h = req.block_hashes[i]
            if h not in self.hash_to_block:
                self.promised.setdefault(h, req)  # a block already promised keeps its first producer
        req.num_promised_blocks = n_full

    def producer_of_next(self, req: Request, num_cached_blocks: int) -> Request | None:
        """The running request computing req's first uncached prefix block right now, if any.

        Call right after `find_cached(req)` (whose hashes it reads); O(1), and free when nothing is promised."""
        if not self.promised or num_cached_blocks >= (req.num_tokens - 1) // self.block_size:
            return None
        return self.promised.get(req.block_hashes[num_cached_blocks])

    # -- allocation ---------------------------------------------------------------------------------
    def can_admit(self, req: Request, cached: list[int], num_new_tokens: int) -> bool:
        """Would admitting req (with its cached prefix blocks) plus num_new_tokens fit right now?"""
        revived = sum(1 for b in cached if self.ref_count[b] == 0)  # cached but in the free list
        new = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return revived + new <= len(self.free_lru)

    def admit(self, req: Request, cached: list[int]) -> None:
        """Give req its cached prefix blocks (touching them out of the free list); on its first admission
        count the prompt's lookup in the prefix-cache statistics."""
        if req.metrics.first_scheduled_time is None:
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += len(cached) * self.block_size
        for b in cached:
            if self.ref_count[b] == 0:
                del self.free_lru[b]
            self.ref_count[b] += 1
        req.block_table = list(cached)
        req.num_computed_tokens = len(cached) * self.block_size
        req.num_registered_blocks = len(cached)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow req's block table to hold num_new_tokens more tokens; False (nothing done) if no room."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if need > len(self.free_lru):
            return False
        evicted: list[bytes] = []
        for _ in range(need):
            b, _ = self.free_lru.popitem(last=False)  # least recently freed: evict its cached hash
            h = self.hash_of[b]
            if h is not None:
                self.hash_of[b] = None
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                    evicted.append(h)
            self.ref_count[b] = 1
            req.block_table.append(b)
        if evicted and self.events is not None:
            self.events.events.append(BlocksRemoved(evicted))
        return True

    def commit(self, req: Request, num_tokens: int) -> None:
        """A step computed num_tokens more tokens of req: advance it and offer its new full blocks."""
        req.num_computed_tokens += num_tokens
        self.cache_full_blocks(req)

    def trim(self, req: Request) -> None:
        """Give back the blocks past req's tokens (allocated for draft tokens that were rejected). They hold
        no computed token, so none is shared or cached: they go to the front of the free list."""
        keep = self.blocks_needed(req.num_tokens)
        if len(req.block_table) <= keep:
            return
        for b in reversed(req.block_table[keep:]):
            assert self.ref_count[b] == 1 and self.hash_of[b] is None, "a draft block is shared or cached"
            self.ref_count[b] = 0
            self.free_lru[b] = None
            self.free_lru.move_to_end(b, last=False)
        req.block_table = req.block_table[:keep]  # a new list, never an edit in place (block_table.py)

    def rewind(self, req: Request, num_tokens: int) -> None:
        """Only req's first NUM_TOKENS tokens' KV is valid now (a draft model's own drafts that the target
        rejected): computed tokens back to it, blocks past req's tokens freed (`trim`). For a pool without
        the prefix cache (a rewound block must not be named by a hash)."""
        assert not self.enable_prefix_caching, "rewind in a pool with the prefix cache"
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)
        self.trim(req)

    def fork(self, parent: Request, child: Request, copy_partial: bool = False) -> tuple[int, int] | None:
        """Give child (no blocks yet) parent's full computed blocks, shared by reference count. The
        partial last block is not shared (a write would change the parent's copy): the child computes
        those tokens itself, or with COPY_PARTIAL (beam search) gets its own copy if a block is free — then
        (parent's block, the copy) is returned for the backend's copy_blocks. child's tokens must start with
        parent's first num_computed_tokens."""
        assert not child.block_table, "fork into a request that already holds blocks"
        n_full = parent.num_computed_tokens // self.block_size
        self.admit(child, parent.block_table[:n_full])  # as if they were its cached prefix
        child.block_hashes = parent.block_hashes[:n_full]  # (the same tokens: not hashed again)
        partial = parent.num_computed_tokens - child.num_computed_tokens
        if not copy_partial or not partial or not self.allocate(child, partial):
            return None
        child.num_computed_tokens = parent.num_computed_tokens
        return parent.block_table[n_full], child.block_table[n_full]

    def release(self, req: Request) -> None:
        """Drop req's references, last block first; unreferenced blocks join the free list. Its
        unfilled promises are withdrawn (requests held on them compute the blocks themselves)."""
        for h in req.block_hashes[req.num_registered_blocks:req.num_promised_blocks]:
            if self.promised.get(h) is req:
                del self.promised[h]
        req.num_promised_blocks = 0
        for b in reversed(req.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_lru[b] = None
                if self.hash_of[b] is None:
                    self.free_lru.move_to_end(b, last=False)  # nothing cached in it: reuse it first
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
