"""Launch geometry of the OpenAI-Triton paged-attention kernel (octavo.tensorrt.gpu_kernel), in plain Python (no
`triton` import), shared by the torch launcher, the TensorRT plugin's symbolic launch parameters and the tests."""
from __future__ import annotations


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_h(num_heads: int, kv_num_heads: int) -> int:
    """Query heads per KV head (the GQA group), padded to a power of two."""
    return next_power_of_2(num_heads // kv_num_heads)


def block_m(num_heads: int, kv_num_heads: int) -> int:
    """Query tokens per program: enough rows (tokens x group heads) for a 16-row tensor-core tile."""
    return max(1, 16 // block_h(num_heads, kv_num_heads))


def num_tiles(num_tokens: int, num_seqs: int, tokens_per_tile: int) -> int:
    """Upper bound on query tiles (grid axis 0): every sequence wastes at most one partial tile."""
    return (num_tokens + tokens_per_tile - 1) // tokens_per_tile + num_seqs
