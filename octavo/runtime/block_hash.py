"""Block hashes: the name of a FULL block of tokens in the prefix cache (vLLM's hash_block_tokens).

A block's hash is the hash of the previous block's hash and this block's token ids, so it names the whole
prefix up to the block's end: equal prefixes map to equal hashes in any request, and a block can be found
again (BlockManager.hash_to_block) only by a request with exactly the same tokens before it.
"""
from __future__ import annotations

import hashlib

import numpy as np

from octavo.runtime.request import Request


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Chained hash of one full block (blake2b: a crafted prompt cannot collide into another's cache)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def extend_block_hashes(req: Request, num_tokens: int, block_size: int) -> None:
    """Extend req.block_hashes to cover the full blocks among its first num_tokens tokens (each hashed once). The
    chain starts from req.cache_salt (a LoRA adapter's name: its K/V differ from the base model's)."""
    for i in range(len(req.block_hashes), num_tokens // block_size):
        parent = req.block_hashes[i - 1] if i else req.cache_salt
        req.block_hashes.append(block_hash(parent, req.tokens(i * block_size, (i + 1) * block_size)))
