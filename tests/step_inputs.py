"""StepInputs for one sequence, built directly (callers that run a backend without the engine's ModelRunner:
backend tests, and teacher-forced logits in benchmarks/bench_weights.py, which puts tests/ on sys.path). The
engine's batched inputs come from octavo/runtime/runner.py."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from octavo.runtime.backends.base import StepInputs


def one_sequence(tokens: Sequence[int], start: int, table: Sequence[int] | np.ndarray, block_size: int,
                 all_logits: bool = False) -> StepInputs:
    """TOKENS at positions start, start+1, ... of one sequence whose blocks are TABLE (a block-table row,
    long enough for start + len(tokens) positions); logits for the last token only, or for every token
    with all_logits."""
    n = len(tokens)
    pos = np.arange(start, start + n, dtype=np.int64)
    row = np.asarray(table, np.int32).reshape(1, -1)
    return StepInputs(
        input_ids=np.asarray(tokens, np.int64), position_ids=pos,
        cumulative_sequence_length=np.array([0, n], np.int32), past_seqlens=np.array([start], np.int32),
        block_table=row, slot_mapping=row[0, pos // block_size].astype(np.int64) * block_size + pos % block_size,
        logits_indices=np.arange(n, dtype=np.int64) if all_logits else np.array([n - 1], np.int64),
    )


def prefill(tokens: Sequence[int], block_size: int, all_logits: bool = True) -> StepInputs:
    """A whole prompt as the first step of one sequence in blocks 0, 1, ... (a pool of at least
    ceil(len(tokens) / block_size) blocks); logits at every position by default (teacher forcing)."""
    return one_sequence(tokens, 0, np.arange(-(-len(tokens) // block_size), dtype=np.int32), block_size,
                        all_logits=all_logits)
