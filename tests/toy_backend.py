"""A tiny stand-in model for engine tests that need many steps fast (property tests).

It keeps a real paged pool of token ids and positions: each step writes the new tokens at
slot_mapping, then reads every sequence's whole context back through its block table (as attention
would) and checks the positions. The logits are a pseudo-random function of that context, so any
wrong block table, slot, cached block or position changes the output. `toy_greedy` is the oracle:
the same function applied to a plain token list, with no paging at all.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from octavo.export.manifest import Manifest
from octavo.runtime.backends.base import StepInputs

VOCAB = 384


def toy_logits(context: list[int]) -> np.ndarray:
    digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(VOCAB).astype(np.float32)


def toy_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(int(np.argmax(toy_logits(ctx))))
    return ctx[len(prompt):]


class ToyBackend:
    def __init__(self, num_blocks: int, block_size: int, fail_on_steps: set[int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = VOCAB
        self.tokens = np.full((num_blocks, block_size), -1, np.int64)
        self.positions = np.full((num_blocks, block_size), -1, np.int64)
        self.fail_on_steps = fail_on_steps or set()
        self.calls = 0

    def run(self, inputs: StepInputs) -> np.ndarray:
        self.calls += 1
        if self.calls in self.fail_on_steps:
            # a real failure may leave garbage in the written slots
            self.tokens.reshape(-1)[inputs.slot_mapping] = 7
            raise RuntimeError(f"injected backend failure on call {self.calls}")
        bs = self.block_size
        cu, past, table = inputs.cumulative_sequence_length, inputs.past_seqlens, inputs.block_table
        assert inputs.input_ids.dtype == np.int64 and cu.dtype == np.int32 and table.dtype == np.int32
        assert len(cu) == len(past) + 1 and cu[0] == 0 and cu[-1] == len(inputs.input_ids)
        self.tokens.reshape(-1)[inputs.slot_mapping] = inputs.input_ids
        self.positions.reshape(-1)[inputs.slot_mapping] = inputs.position_ids
        out = np.empty((len(inputs.logits_indices), self.vocab_size), np.float32)
        for j, row in enumerate(inputs.logits_indices):
            i = int(np.searchsorted(cu, row, side="right")) - 1
            assert row == cu[i + 1] - 1, "logits requested for a row that is not a sequence's last token"
            length = int(past[i] + cu[i + 1] - cu[i])
            pos = np.arange(length)
            blocks = table[i, pos // bs]
            assert np.array_equal(self.positions[blocks, pos % bs], pos), "KV slots hold wrong positions"
            out[j] = self.logits_for(self.tokens[blocks, pos % bs].tolist())
        return out

    def logits_for(self, context: list[int]) -> np.ndarray:
        """The next-token logits after CONTEXT (subclasses script other models)."""
        return toy_logits(context)

    def close(self) -> None:
        pass


def make_toy_model_dir(path: str | Path, max_context: int = 1024) -> Path:
    """A model folder with a manifest and the test tokenizer (no ONNX: use it with ToyBackend)."""
    from models import make_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    from models import CHAT_TEMPLATE

    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    Manifest(architecture="llama", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, hidden_size=4,
             vocab_size=VOCAB, max_context=max_context, rope_theta=10000.0,
             bos_token_id=tok.token_to_id("<s>"), eos_token_ids=[tok.token_to_id("</s>")]).save(path)
    return path
