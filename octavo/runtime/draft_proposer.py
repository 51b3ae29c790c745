"""DraftModelProposer: draft tokens from a smaller model with the target's vocabulary (`{"model": PATH}`).

The draft model is loaded like any model (export folder, HF folder, .gguf) and run by its own backend over its
own KV pool (a BlockManager without the prefix cache), in the engine's process and thread. Each target request
has a shadow Request in that pool holding its tokens and the draft model's own drafts after them. To propose,
the shadow is synced with the request: its tokens after the first one that differs (drafts the target
rejected) are replaced by the request's, its KV rewound to them (`BlockManager.rewind`); then the draft model
computes what it has not seen (the prompt the first time, the accepted tokens after) and k - 1 more single
tokens, greedily (the argmax of its logits). A deterministic draft is a point-mass proposal, so the rejection
sampler's rule keeps sampled requests distributed exactly as the target's. Requests are drafted one after the
other (k draft-model calls each): the single-user case; `disable_by_batch_size` turns it off under load.
A shadow is dropped when its request ends (`release`), or when the draft pool is full (no drafts then).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from octavo.errors import InvalidRequestError
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.model_setup import load_model
from octavo.runtime.request import Request
from octavo.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class _Shadow:
    seq: Request  # the draft pool's copy: the request's tokens, then the draft model's own drafts
    synced: int = 0  # leading output tokens known to equal the request's


class DraftModelProposer:
    def __init__(self, model: str, target: EngineArgs, vocab_size: int, max_model_len: int) -> None:
        args = EngineArgs(model=model, block_size=target.block_size, max_num_seqs=target.max_num_seqs,
                          num_threads=target.num_threads, backend=target.backend,
                          max_num_batched_tokens=target.max_num_batched_tokens)
        self.model = load_model(args)
        drafted = self.model.manifest.vocab_size
        if drafted != vocab_size:
            self.model.backend.close()
            raise InvalidRequestError(f"speculative_config: the draft model {model} has a vocabulary of {drafted} "
                                      f"tokens, the target {vocab_size}: a draft model needs the target's tokenizer")
        self.max_len = min(self.model.max_model_len, max_model_len)
        self.pool = BlockManager(self.model.backend.num_blocks, args.block_size, enable_prefix_caching=False)
        max_blocks = min(self.pool.blocks_needed(self.max_len), self.pool.num_blocks)
        self.runner = ModelRunner(args.block_size, 1, self.max_len, max_blocks)
        self.shadows: dict[Request, _Shadow] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to K greedy draft tokens of the draft model after REQ's tokens."""
        if req.num_tokens >= self.max_len:
            return []
        sh = self.shadows.get(req)
        if sh is None:
            sh = self.shadows[req] = _Shadow(Request(req.request_id, req.prompt_token_ids, req.params, req.generator,
                                                     req.max_tokens, req.arrival_order))
        self._sync(sh, req)
        drafts: list[int] = []
        seq = sh.seq
        while len(drafts) < k and seq.num_tokens < self.max_len:
            n = seq.num_tokens - seq.num_computed_tokens
            if not self.pool.allocate(seq, n):
                logger.debug("draft pool full: no drafts for %s", req.request_id)
                self.release(req)
                return drafts
            inputs, _ = self.runner.prepare({seq: n})
            logits = self.model.backend.run(inputs)
            self.pool.commit(seq, n)
            tok = int(np.argmax(logits[0]))
            drafts.append(tok)
            seq.output_token_ids.append(tok)
        return drafts

    def _sync(self, sh: _Shadow, req: Request) -> None:
        """Make the shadow's tokens REQ's (its own drafts kept where the target took them), its KV rewound to
        the tokens they share."""
        mine, theirs = sh.seq.output_token_ids, req.output_token_ids
        i, end = sh.synced, min(len(mine), len(theirs))
        while i < end and mine[i] == theirs[i]:
            i += 1
        del mine[i:]
        mine.extend(theirs[i:])
        sh.synced = len(theirs)
        self.pool.rewind(sh.seq, req.num_prompt_tokens + i)

    def release(self, req: Request) -> None:
        """REQ ended (or its shadow cannot grow): free its shadow's blocks."""
        sh = self.shadows.pop(req, None)
        if sh is not None:
            self.pool.release(sh.seq)

    def close(self) -> None:
        for req in list(self.shadows):
            self.release(req)
        self.model.backend.close()
