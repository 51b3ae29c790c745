"""GrammarMatcher: one sequence's position in its grammar (one per request; each child of n > 1 its own).

The engine advances it with every token it commits to the sequence (`accept`), asks it for the next
token's bitmask (`fill_bitmask`: bit t of row = token t allowed; EOS only where the grammar may end), and
ends the sequence when the grammar is complete (`is_terminated`). `rollback` / `reset` undo accepted
tokens for an engine that discards them (a recompute that drops output); `free` drops the state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True, eq=False)
class GrammarMatcher:
    _m: Any  # llguidance.LLMatcher (None once freed)
    key: str  # the compiled grammar's cache key (for logs)
    num_accepted: int = 0

    def accept(self, token: int) -> bool:
        """Advance by TOKEN. False (and the matcher is then in error) if the grammar does not allow it."""
        ok = bool(self._m.consume_token(int(token)))
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last NUM_TOKENS accepted tokens."""
        num_tokens = min(num_tokens, self.num_accepted)
        if num_tokens > 0:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar (nothing accepted)."""
        self._m.reset()
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence ends here)."""
        return bool(self._m.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return str(self._m.get_error())

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the next token's allowed set into BITMASK[row] (int32 words, C-contiguous, 32 tokens each).
        Releases the GIL while it works."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)

    def free(self) -> None:
        self._m = None

    @property
    def freed(self) -> bool:
        return self._m is None
