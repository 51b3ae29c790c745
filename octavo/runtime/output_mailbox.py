"""OutputMailbox: one request's outputs between the engine thread and an asyncio consumer, coalesced.

A consumer that reads slower than the engine produces (a client that stopped reading its stream) must not
grow memory per step: the engine thread merges each new output into the one output still unread —
deltas are concatenated per completion (their size is bounded by the request's own output), a cumulative
or final output replaces the previous one — and wakes the consumer only when the box turns non-empty.
When the unread delta holds more than `max_entries` items (tokens plus logprob entries), the consumer is
too far behind: `on_overflow` runs once (AsyncEngine aborts the request; the final output still arrives).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from octavo.runtime.outputs import CompletionOutput, Logprob, RequestOutput

DEFAULT_MAX_ENTRIES = 1 << 16  # unread tokens + logprob entries per request before it is aborted


@dataclass(slots=True)
class _Pending:
    """The unread part of one completion (text kept as pieces: appending is O(new))."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    last: CompletionOutput | None = None  # the newest delta (finish reason, stop reason, error)


class OutputMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_entries: int = DEFAULT_MAX_ENTRIES,
                 on_overflow: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._latest: RequestOutput | None = None  # the newest output (its request-level fields)
        self._prompt_logprobs: list | None = None  # an unread output's prompt logprobs (they come once)
        self._parts: dict[int, _Pending] = {}
        self._entries = 0
        self._max_entries = max_entries
        self._on_overflow = on_overflow
        self._overflowed = False

    @property
    def unread_entries(self) -> int:
        return self._entries

    def put(self, out: RequestOutput, delta: bool) -> None:
        """From any thread: merge OUT into the unread output (DELTA: out holds only what is new)."""
        with self._lock:
            was_empty = self._latest is None
            self._latest = out
            if out.prompt_logprobs is not None:
                self._prompt_logprobs = out.prompt_logprobs
            if delta:
                for c in out.outputs:
                    part = self._parts.get(c.index)
                    if part is None:
                        part = self._parts[c.index] = _Pending(c.index)
                    part.text.append(c.text)
                    part.token_ids.extend(c.token_ids)
                    if c.logprobs is not None:
                        if part.logprobs is None:
                            part.logprobs = []
                        part.logprobs.extend(c.logprobs)
                        self._entries += sum(len(d) for d in c.logprobs)
                    part.last = c
                    self._entries += len(c.token_ids)
            overflow = delta and self._entries > self._max_entries and not self._overflowed and not out.finished
            self._overflowed |= overflow
        if was_empty:
            self._loop.call_soon_threadsafe(self._ready.set)
        if overflow and self._on_overflow is not None:
            self._on_overflow()

    async def get(self) -> RequestOutput:
        """The unread output (all deltas since the previous get, merged); waits for one."""
        while True:
            await self._ready.wait()
            with self._lock:
                self._ready.clear()
                out, self._latest = self._latest, None
                parts, self._parts = self._parts, {}
                prompt_lps, self._prompt_logprobs = self._prompt_logprobs, None
                self._entries = 0
            if out is None:
                continue  # a wake-up for an output already read
            if prompt_lps is not None:
                out.prompt_logprobs = prompt_lps
            if not parts:
                return out
            comps = [CompletionOutput(index=p.index, text="".join(p.text), token_ids=p.token_ids,
                                      finish_reason=p.last.finish_reason, stop_reason=p.last.stop_reason,
                                      logprobs=p.logprobs, error=p.last.error)
                     for p in sorted(parts.values(), key=lambda p: p.index) if p.last is not None]
            return RequestOutput(request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                                 outputs=comps, finished=out.finished, metrics=out.metrics,
                                 num_cached_tokens=out.num_cached_tokens, prompt_logprobs=out.prompt_logprobs)
