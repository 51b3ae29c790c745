"""GrammarCompiler: the model's tokenizer bridged to llguidance once, and compiled grammars cached by key.

Every native call happens on CompileWorkers' threads (large stacks, a bounded queue), after the constraint has
passed ConstraintLimits in Python (limits.py): a hostile schema is refused before llguidance sees it, and what
llguidance does see cannot overflow the stack it runs on.

    prepare(params)  ─► a Future of the compiled template: from the cache, from a compile already under way
                        (one compile per key, whoever asks), or a new job on the workers
    matcher(params)  ─► waits for it (limits.compile_timeout from when a worker starts it) and hands out a copy

The bridge (an llguidance LLTokenizer built from our tokenizer's tokenizer.json) takes ~0.5-1.5 s for a 50k
vocabulary and holds the GIL while it is built, so a server builds it while loading (`warm`); elsewhere it is
built by the first compile. A compiled grammar is kept as a pristine "template" matcher whose lexer has been
warmed by one mask and whose first tokens have been tried on a copy (a grammar the parser cannot follow fails
then, as a 400, rather than at the request's first token); each request gets a deep copy (microseconds). The
cache is an LRU of `cache_size` grammars and `cache_bytes` of constraint text; a constraint that failed to
compile is remembered too, so repeating it costs nothing. The lock guards the cache and the map of compiles
under way only: no request waits on it while another compiles.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from octavo.structured.compile_workers import CompileFuture, CompileWorkers
from octavo.structured.grammar import build_grammar, error_text
from octavo.structured.limits import ConstraintLimits
from octavo.structured.matcher import GrammarMatcher
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams


class Tokenizer(Protocol):
    """What the bridge reads of a tokenizer (octavo.runtime.tokenizer.Tokenizer is one)."""

    vocab_size: int
    eos_token_ids: Any

    def to_json(self) -> str: ...

log = logging.getLogger(__name__)
DEFAULT_CACHE_SIZE = 256
DEFAULT_CACHE_BYTES = 64 << 20  # constraint text held by the cache's keys (compiled grammars grow with it)
PROBE_TOKENS = 2  # tokens tried on a copy of a fresh template (the parser's first rows are built then)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class CompileStats:
    compiled: int = 0  # grammars compiled (cache misses)
    hits: int = 0
    compile_seconds: float = 0.0  # total, cache misses only
    bridge_seconds: float = 0.0  # building the tokenizer bridge (once)


@dataclass(slots=True)
class GrammarCompiler:
    tokenizer: Tokenizer
    vocab_size: int  # the model's logits width (may exceed the tokenizer's vocabulary)
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    cache_size: int = DEFAULT_CACHE_SIZE
    cache_bytes: int = DEFAULT_CACHE_BYTES
    stats: CompileStats = field(default_factory=CompileStats)
    workers: CompileWorkers = field(default_factory=CompileWorkers)
    _lltok: Any = None
    _cache: OrderedDict[str, Any] = field(default_factory=OrderedDict)  # key -> template, or the error it raised
    _cached_bytes: int = 0
    _inflight: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _bridge_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return bitmask_words(self.vocab_size)

    def llg_tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use)."""
        with self._bridge_lock:
            if self._lltok is None:
                import llguidance as llg

                t = time.perf_counter()
                self._lltok = llg.LLTokenizer(self.tokenizer.to_json(),
                                              n_vocab=max(self.vocab_size, self.tokenizer.vocab_size),
                                              eos_token=list(self.tokenizer.eos_token_ids) or None)
                self.stats.bridge_seconds = time.perf_counter() - t
                log.info("structured outputs: tokenizer bridged to llguidance in %.2fs", self.stats.bridge_seconds)
            return self._lltok

    def prepare(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A Future of PARAMS' compiled template (StructuredOutputError in it if the constraint is unusable).
        CompileQueueFullError (an OverloadedError) when too many compiles are waiting."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                done: concurrent.futures.Future = concurrent.futures.Future()
                if isinstance(hit, _Failed):
                    done.set_exception(hit.error())  # a new exception each time (a raised one keeps its traceback)
                else:
                    done.set_result(hit)
                return done
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._inflight[key] = self.workers.submit(self._compile_and_cache, params, key)
            return fut

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of PARAMS' grammar; StructuredOutputError if it is unusable or does not
        compile within limits.compile_timeout."""
        fut = self.prepare(params)
        timeout = self.limits.compile_timeout
        while True:
            left = fut.seconds_left(timeout) if isinstance(fut, CompileFuture) else None
            try:
                template = fut.result(timeout=max(left, 0.0) if left is not None else timeout)
                break
            except concurrent.futures.TimeoutError:
                left = fut.seconds_left(timeout) if isinstance(fut, CompileFuture) else None
                if left is not None and left <= 0:
                    raise self.timeout_error(params) from None
        return GrammarMatcher(template.deep_copy(), params.cache_key())

    def timeout_error(self, params: StructuredOutputsParams) -> StructuredOutputError:
        return StructuredOutputError(
            f"the {params.kind} constraint did not compile within {self.limits.compile_timeout:g} s (the "
            "server's --constraint-compile-timeout): simplify it", _field(params.kind))

    def close(self) -> None:
        self.workers.close()

    # -- on a worker --------------------------------------------------------------------------------
    def _compile_and_cache(self, params: StructuredOutputsParams, key: str) -> Any:
        try:
            result: Any = self._compile(params)
        except StructuredOutputError as exc:
            result = _Failed(str(exc), exc.field)
        except RecursionError:
            result = _Failed(f"the {params.kind} constraint is nested too deeply", _field(params.kind))
        with self._lock:
            self._inflight.pop(key, None)
            self._cache[key] = result
            self._cached_bytes += len(key)
            while len(self._cache) > self.cache_size or (self._cached_bytes > self.cache_bytes and len(self._cache) > 1):
                old, _ = self._cache.popitem(last=False)
                self._cached_bytes -= len(old)
        if isinstance(result, _Failed):
            raise result.error()
        return result

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance as llg

        grammar = build_grammar(params, self.limits)
        tok = self.llg_tokenizer()
        t = time.perf_counter()
        m = llg.LLMatcher(tok, grammar, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
        self._check(m, params, "invalid")
        warm = np.full((1, self.words), -1, np.int32)  # builds the lexer's first states, shared by copies
        m.unsafe_compute_mask_ptr(warm.ctypes.data, warm.nbytes)
        self._check(m, params, "cannot be matched")
        self._probe(m.deep_copy(), warm[0], params)
        self.stats.compiled += 1
        self.stats.compile_seconds += time.perf_counter() - t
        return m

    def _probe(self, m: Any, mask: np.ndarray, params: StructuredOutputsParams) -> None:
        """Follow the grammar for a few tokens on a copy: llguidance builds the parser's rows when a token is
        consumed, and a grammar whose rows pass its limits fails there (a 400 now, not an error mid-request)."""
        for _ in range(PROBE_TOKENS):
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size])
            if allowed.size == 0 or m.is_stopped():
                return
            m.consume_token(int(allowed[0]))
            self._check(m, params, "is too complex to follow")
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            self._check(m, params, "is too complex to follow")

    @staticmethod
    def _check(m: Any, params: StructuredOutputsParams, what: str) -> None:
        if m.is_error():
            raise StructuredOutputError(f"the {params.kind} constraint {what}: {error_text(m.get_error())}",
                                        _field(params.kind))


@dataclass(frozen=True, slots=True)
class _Failed:
    """A constraint that did not compile, as the cache remembers it."""

    message: str
    field: str

    def error(self) -> StructuredOutputError:
        return StructuredOutputError(self.message, self.field)


def _field(kind: str) -> str:
    return "json" if kind == "json_object" else kind
