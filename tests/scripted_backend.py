"""A stand-in model that writes a given text: after a prompt ending with `anchor`, its logits make each next
token of `script` the only likely one; past the script (or after any other prompt) it goes on with the toy
model's pseudo-random logits. With the real engine, tokenizer and chat template around it, it is what a
reasoning or tool-calling model would produce, token for token (tests set `anchor` and `script` between
requests). An output constraint masks its logits like a real model's: a scripted token the mask forbids is
not written, which a test sees."""
from __future__ import annotations

import hashlib

import numpy as np
from toy_backend import ToyBackend

SCRIPTED_LOGIT = 50.0


class ScriptedBackend(ToyBackend):
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.vocab_size = vocab_size
        self.anchor: list[int] = []
        self.script: list[int] = []

    def logits_for(self, context: list[int]) -> np.ndarray:
        anchor, script, n = self.anchor, self.script, len(self.anchor)
        if n:
            for k in range(min(len(script), len(context) - n), -1, -1):
                end = len(context) - k
                if context[end - n:end] == anchor and context[end:] == script[:k]:
                    if k < len(script):
                        out = np.zeros(self.vocab_size, np.float32)
                        out[script[k]] = SCRIPTED_LOGIT
                        return out
                    break
        digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(self.vocab_size).astype(np.float32)
