"""GrammarCompiler: the model's tokenizer bridged to llguidance once, and compiled grammars cached by key.

The bridge (an llguidance LLTokenizer built from our tokenizer's tokenizer.json — the export writes one for
HF and GGUF models alike) takes ~0.5-1.5 s for a 50k vocabulary, so it is built on the first constrained
request, once per model. A compiled grammar is kept as a pristine "template" matcher whose lexer has been
warmed by one mask; each request gets a deep copy (microseconds), so n > 1 children and repeated schemas
share the work. The cache is an LRU of `cache_size` grammars. Thread-safe: the server compiles on its
own threads (InvalidRequestError raised there), the engine uses the matchers on its loop.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from octavo.structured.grammar import build_grammar
from octavo.structured.matcher import GrammarMatcher
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

if TYPE_CHECKING:
    from octavo.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_CACHE_SIZE = 256


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
    cache_size: int = DEFAULT_CACHE_SIZE
    stats: CompileStats = field(default_factory=CompileStats)
    _lltok: Any = None
    _cache: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return bitmask_words(self.vocab_size)

    def llg_tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use)."""
        with self._lock:
            return self._bridge()

    def _bridge(self) -> Any:
        if self._lltok is None:
            import llguidance as llg

            t = time.perf_counter()
            self._lltok = llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=max(self.vocab_size, self.tokenizer.vocab_size),
                                          eos_token=list(self.tokenizer.eos_token_ids) or None)
            self.stats.bridge_seconds = time.perf_counter() - t
            log.info("structured outputs: tokenizer bridged to llguidance in %.2fs", self.stats.bridge_seconds)
        return self._lltok

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of PARAMS' grammar; StructuredOutputError if it is unusable."""
        key = params.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return GrammarMatcher(template.deep_copy(), key)
            template = self._compile(params)
            self._cache[key] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return GrammarMatcher(template.deep_copy(), key)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance as llg

        grammar = build_grammar(params)
        tok = self._bridge()
        t = time.perf_counter()
        m = llg.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise StructuredOutputError(f"invalid {params.kind} constraint: {m.get_error()[:400]}",
                                        "json" if params.kind == "json_object" else params.kind)
        warm = np.full((1, self.words), -1, np.int32)  # builds the lexer's first states, shared by copies
        m.unsafe_compute_mask_ptr(warm.ctypes.data, warm.nbytes)
        if m.is_error():
            raise StructuredOutputError(f"the {params.kind} constraint cannot be matched: {m.get_error()[:400]}",
                                        "json" if params.kind == "json_object" else params.kind)
        self.stats.compiled += 1
        self.stats.compile_seconds += time.perf_counter() - t
        return m
