"""StructuredOutputManager: the engine's one handle on structured outputs.

    InputProcessor / make_group ─► init_requests(children)      each child its own GrammarMatcher
    before sampling              ─► start_bitmask(rows) ... bitmask()   masks of the rows to sample
    the commit                   ─► commit_token(req, token)   advance; say whether the grammar ended
    finish / abort               ─► release_grammar(req)

A request with draft tokens (speculative decoding) has a mask row per draft position too: the matcher
accepts the drafts one by one (stopping at one its grammar forbids: that draft is rejected anyway, as its
row's mask gives it no probability), fills each row, and is rolled back; the commit then advances it over
the tokens actually accepted. The masks depend only on tokens already committed (and the drafts), so
`start_bitmask` may run while the backend computes the step (llguidance releases the GIL, as ONNX Runtime does); `bitmask` waits for it. Rows of requests
without a grammar are all ones. Preemption, recompute, prefix-cache hits and chunked prefill need nothing:
they change which KV is computed, never the committed tokens the matcher has seen, and a mask is computed
only for rows that sample.

With a reasoning parser (EngineArgs.reasoning_parser) a request's grammar starts after the thinking, as in
vLLM: until the end marker is committed (its ThinkingGate, runtime/reasoning.py) the row is not masked and
the matcher sees no token; the first token after the marker is the grammar's first. A prompt that already
closed the thinking (Qwen3 with enable_thinking off) constrains from the first token.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from octavo.runtime.reasoning import ReasoningFormat, ThinkingGate, TokenPieces, prompt_ends_reasoning
from octavo.structured.compiler import GrammarCompiler
from octavo.structured.grammar import error_text
from octavo.structured.limits import ConstraintLimits
from octavo.structured.matcher import GrammarMatcher
from octavo.structured.params import CONSTRAINT_FAILED

if TYPE_CHECKING:
    from octavo.runtime.request import Request
    from octavo.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# a step's masks are computed on the worker when at least this many rows are constrained: the hand-off
# (~0.1 ms) is small next to a model step, and even one row's mask can take ~1 ms on a fresh grammar state
OVERLAP_MIN_ROWS = 1


@dataclass(slots=True)
class CommitResult:
    terminated: bool = False  # the grammar is complete: the sequence ends ("stop")
    error: str | None = None  # the token broke the grammar (cannot happen with its mask applied)


def commit_token(req: Request, token: int) -> CommitResult:
    """REQ committed TOKEN: advance its matcher (the scheduler's commit calls this for every sampled token)."""
    g: GrammarMatcher | None = req.grammar
    if g is None or g.freed:
        return CommitResult()
    if req.thinking is not None and not req.thinking.ended:  # the thinking: not the grammar's (it may end here)
        req.thinking.feed(token)
        return CommitResult()
    if g.is_terminated:  # (an EOS after completion: nothing to match)
        return CommitResult(terminated=True)
    if not g.accept(token):
        return CommitResult(error=f"{CONSTRAINT_FAILED} at token {token}: {error_text(g.error(), 300)}")
    return CommitResult(terminated=g.is_terminated)


def constrained(req: Request) -> bool:
    """REQ's next token is masked by its grammar (it has one, and its thinking, if any, has ended)."""
    return (req.grammar is not None and not req.grammar.freed
            and (req.thinking is None or req.thinking.ended))


def release_grammar(req: Request) -> None:
    """Drop REQ's matcher (it finished, or was aborted)."""
    if req.grammar is not None:
        req.grammar.free()
        req.grammar = None


def _fill_with_drafts(g: GrammarMatcher, drafts: list[int], mask: np.ndarray, row: int) -> None:
    """Fill MASK[row] for the matcher's state, and MASK[row + j] after each of the first j DRAFTS it allows
    (rows after a forbidden draft stay all ones: they are never sampled); the matcher ends where it began."""
    g.fill_bitmask(mask, row)
    advanced = 0
    for j, d in enumerate(drafts):
        if not (int(mask[row + j, d >> 5]) >> (d & 31)) & 1 or g.is_terminated or not g.accept(d):
            break
        advanced += 1
        g.fill_bitmask(mask, row + j + 1)
    g.rollback(advanced)


@dataclass(slots=True)
class MaskStats:
    rows: int = 0  # constrained rows masked
    fill_seconds: float = 0.0  # computing masks (on the worker or inline)
    wait_seconds: float = 0.0  # the engine loop waiting for them after the backend returned


@dataclass(slots=True)
class StructuredOutputManager:
    tokenizer: Tokenizer
    vocab_size: int
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    reasoning: ReasoningFormat | None = None  # the engine's reasoning parser: grammars start after the thinking
    compiler: GrammarCompiler = field(init=False)
    _pieces: TokenPieces | None = None
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    _pending: concurrent.futures.Future | None = None
    _pending_key: tuple[tuple[int, int], ...] = ()  # (row, id(request)) of the masks being computed
    masks: MaskStats = field(default_factory=MaskStats)

    def __post_init__(self) -> None:
        self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.limits)
        if self.reasoning is not None:
            self._pieces = TokenPieces(self.tokenizer)

    # -- requests -----------------------------------------------------------------------------------
    def init_requests(self, reqs: Sequence[Request]) -> None:
        """Give each request whose params ask for structured outputs its own matcher (StructuredOutputError,
        an InvalidRequestError, if the constraint is unusable or passes the limits; OverloadedError if too many
        are waiting to compile). Safe from any thread; blocks while the grammar compiles on the workers."""
        prompt_ended: dict[int, bool] = {}  # n > 1 children share one prompt list: read it once
        for req in reqs:
            so = req.params.structured_outputs
            if so is not None and req.grammar is None:
                req.grammar = self.compiler.matcher(so)
                if self.reasoning is not None and self._pieces is not None:
                    key = id(req.prompt_token_ids)
                    if key not in prompt_ended:
                        prompt_ended[key] = prompt_ends_reasoning(self.reasoning, self.tokenizer, req.prompt_token_ids)
                    req.thinking = ThinkingGate(self.reasoning.end, self._pieces, ended=prompt_ended[key])

    commit = staticmethod(commit_token)
    free = staticmethod(release_grammar)

    # -- masks --------------------------------------------------------------------------------------
    def start_bitmask(self, reqs: Sequence[Request]) -> None:
        """Begin computing the masks of REQS (the rows the step will sample, in order) in the background."""
        self._pending = None
        rows = tuple(i for i, r in enumerate(reqs) if constrained(r))
        if len(rows) < OVERLAP_MIN_ROWS:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="octavo-grammar")
        self._pending_key = tuple((i, id(reqs[i])) for i in rows)
        self._pending = self._pool.submit(self._fill, list(reqs), rows)

    def bitmask(self, reqs: Sequence[Request]) -> np.ndarray | None:
        """[logits rows, words] int32 masks (None when no row is constrained; a row per request, and one more
        per draft token): the one start_bitmask began for these rows, or computed now."""
        pending, self._pending = self._pending, None
        rows = tuple(i for i, r in enumerate(reqs) if constrained(r))
        if not rows:
            return None
        t = time.perf_counter()
        if pending is not None and tuple((i, id(reqs[i])) for i in rows) == self._pending_key:
            mask = pending.result()
        else:
            mask = self._fill(list(reqs), rows)
        self.masks.wait_seconds += time.perf_counter() - t
        return mask

    def discard(self) -> None:
        """The step failed before its masks were used: wait for the worker (it reads the matchers the
        failure is about to free) and drop its result."""
        pending, self._pending = self._pending, None
        if pending is not None:
            concurrent.futures.wait([pending])

    def _fill(self, reqs: list[Request], rows: tuple[int, ...]) -> np.ndarray:
        t = time.perf_counter()
        starts = np.cumsum([0] + [1 + len(r.spec_token_ids) for r in reqs])
        mask = np.full((int(starts[-1]), self.compiler.words), -1, np.int32)
        for i in rows:
            _fill_with_drafts(reqs[i].grammar, reqs[i].spec_token_ids, mask, int(starts[i]))
        self.masks.rows += len(rows)
        self.masks.fill_seconds += time.perf_counter() - t
        return mask

    def warm(self) -> None:
        """Build the tokenizer bridge now (~0.5-1.5 s holding the GIL): a server does it while it loads, so its
        first constrained request does not freeze the event loop."""
        self.compiler.llg_tokenizer()

    def close(self) -> None:
        self.compiler.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def stats(self) -> Any:
        return self.compiler.stats
