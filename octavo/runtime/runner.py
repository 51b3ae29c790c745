"""ModelRunner: packs one scheduled step into the contract's flat arrays (the engine hands them to the backend).

No padding: T = the scheduled tokens of all sequences back to back. The arrays are views of buffers
allocated once (max_num_batched_tokens rows, max_num_seqs sequences) and sliced per step.
`logits_indices` names only the rows that need a next token: the last scheduled token of each
request whose prompt (plus any recomputed output) is complete after this step. A request with draft
tokens (speculative decoding) is packed as its last token followed by its drafts, and gets a row for each
of them: 1 + drafts rows in a row, which verify the drafts and give the token after the accepted ones.
"""
from __future__ import annotations

import numpy as np

from octavo.runtime.backends.base import StepInputs
from octavo.runtime.block_table import BlockTables
from octavo.runtime.request import Request


class ModelRunner:
    def __init__(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        t, b = max_num_batched_tokens, max_num_seqs
        self._input_ids = np.zeros(t, np.int64)
        self._positions = np.zeros(t, np.int64)
        self._slots = np.zeros(t, np.int64)
        self._cu = np.zeros(b + 1, np.int32)
        self._past = np.zeros(b, np.int32)
        self._logits_indices = np.zeros(b + t, np.int64)  # a row to sample per sequence, prompt-logprob rows
        self._hidden_indices = np.zeros(t, np.int64)  # embedding requests' rows (runtime/pooling.py)
        self._lora_slots = np.zeros(t, np.int64)  # each token's LoRA slot (runtime/lora.py)
        self.block_tables = BlockTables(max_num_seqs, max_blocks_per_seq)

    def prepare(self, scheduled: dict[Request, int], prompt_rows: dict[Request, tuple[int, int]] | None = None,
                pooled_rows: dict[Request, tuple[int, int]] | None = None) -> tuple[StepInputs, list[Request]]:
        """Pack the step; return the inputs and the requests that get logits rows (in row order; one each, or
        1 + its drafts for a request with drafts). Values go
        into Python lists (a decode row is a few ints), then one numpy assignment per array.
        PROMPT_ROWS (prompt logprobs): per request, (first position, count) of more rows to return, after
        the rows to sample, in the order given. POOLED_ROWS (embeddings): likewise, the rows of hidden_indices;
        an embedding request never samples."""
        bs = self.block_size
        b = len(scheduled)
        sampled: list[Request] = []
        logit_rows: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        past: list[int] = []
        cu: list[int] = []
        t = 0
        extra: list[int] = []
        hidden: list[int] = []
        lora = any(req.lora_slot for req in scheduled)
        for req, n in scheduled.items():
            if lora:
                self._lora_slots[t:t + n] = req.lora_slot
            start = req.num_computed_tokens
            if prompt_rows and req in prompt_rows:
                first, count = prompt_rows[req]
                extra.extend(range(t + first - start, t + first - start + count))
            if pooled_rows and req in pooled_rows:
                first, count = pooled_rows[req]
                hidden.extend(range(t + first - start, t + first - start + count))
            blocks = req.block_table
            past.append(start)
            cu.append(t)
            drafts = req.spec_token_ids
            if n == 1:
                ids.append(req.token(start))
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                ids.extend(req.tokens(start, start + n - len(drafts)) + drafts if drafts else req.tokens(start, start + n))
                positions.extend(range(start, start + n))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            t += n
            if start + n == req.num_tokens + len(drafts) and req.pool is None:
                logit_rows.extend(range(t - 1 - len(drafts), t))
                sampled.append(req)
        cu.append(t)
        self._input_ids[:t] = ids
        self._positions[:t] = positions
        self._slots[:t] = slots
        self._past[:b] = past
        self._cu[: b + 1] = cu
        logit_rows += extra
        self._logits_indices[: len(logit_rows)] = logit_rows
        self._hidden_indices[: len(hidden)] = hidden
        inputs = StepInputs(
            input_ids=self._input_ids[:t], position_ids=self._positions[:t],
            cumulative_sequence_length=self._cu[: b + 1], past_seqlens=self._past[:b],
            block_table=self.block_tables.pack(scheduled), slot_mapping=self._slots[:t],
            logits_indices=self._logits_indices[: len(logit_rows)],
            hidden_indices=self._hidden_indices[: len(hidden)] if pooled_rows else None,
            lora_slots=self._lora_slots[:t] if lora else None,
        )
        return inputs, sampled
