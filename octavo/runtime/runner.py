"""ModelRunner: packs one scheduled step into the contract's flat arrays and runs the backend.

No padding: T = the scheduled tokens of all sequences back to back. The arrays are views of buffers
allocated once (max_num_batched_tokens rows, max_num_seqs sequences) and sliced per step.
`logits_indices` names only the rows that need a next token: the last scheduled token of each
request whose prompt (plus any recomputed output) is complete after this step.
"""
from __future__ import annotations

import numpy as np

from octavo.runtime.backends.base import Backend, StepInputs
from octavo.runtime.request import Request


class ModelRunner:
    def __init__(self, backend: Backend, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_blocks_per_seq: int) -> None:
        self.backend = backend
        self.block_size = block_size
        t, b = max_num_batched_tokens, max_num_seqs
        self._input_ids = np.zeros(t, np.int64)
        self._positions = np.zeros(t, np.int64)
        self._slots = np.zeros(t, np.int64)
        self._cu = np.zeros(b + 1, np.int32)
        self._past = np.zeros(b, np.int32)
        self._logits_indices = np.zeros(b, np.int64)
        self._table = np.zeros(b * max_blocks_per_seq, np.int32)  # viewed as [B, max_blocks of this step]

    def prepare(self, scheduled: dict[Request, int]) -> tuple[StepInputs, list[Request]]:
        """Pack the step; return the inputs and the requests that get a logits row (in row order)."""
        bs = self.block_size
        width = max(len(r.block_table) for r in scheduled)
        table = self._table[: len(scheduled) * width].reshape(len(scheduled), width)
        table.fill(0)
        sampled: list[Request] = []
        t = 0
        for i, (req, n) in enumerate(scheduled.items()):
            start = req.num_computed_tokens
            self._input_ids[t:t + n] = req.tokens(start, start + n)
            pos = np.arange(start, start + n)
            self._positions[t:t + n] = pos
            blocks = np.asarray(req.block_table, dtype=np.int64)
            self._slots[t:t + n] = blocks[pos // bs] * bs + pos % bs
            table[i, : len(req.block_table)] = req.block_table
            self._past[i] = start
            self._cu[i] = t
            t += n
            if start + n == req.num_tokens:
                self._logits_indices[len(sampled)] = t - 1
                sampled.append(req)
        b = len(scheduled)
        self._cu[b] = t
        inputs = StepInputs(
            input_ids=self._input_ids[:t], position_ids=self._positions[:t],
            cumulative_sequence_length=self._cu[: b + 1], past_seqlens=self._past[:b],
            block_table=table, slot_mapping=self._slots[:t],
            logits_indices=self._logits_indices[: len(sampled)],
        )
        return inputs, sampled

    def run(self, inputs: StepInputs) -> np.ndarray:
        return self.backend.run(inputs)
