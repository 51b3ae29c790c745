"""One HTTP request's prompts running on the shared AsyncEngine, seen as per-choice deltas.

The engine yields delta RequestOutputs (output_kind="delta": only what is new); a Generation turns them into
ChoiceUpdates (new text, new tokens, new logprobs, finish reason) for the route handlers, keeps the counts
the usage block needs (never the text), observes latency metrics, and aborts
its engine requests when it is closed early (client gone, handler cancelled, shutdown), so their KV
blocks are freed at once. It never sees block tables: it talks to the AsyncEngine only (whose submit and
abort never wait for a step, so they run right on the event loop).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from octavo.errors import EngineDeadError, UnknownRequestError
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.outputs import Logprob, RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.serving.metrics import RequestTimer, ServerMetrics
from octavo.serving.responses import request_metrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceUpdate:
    index: int  # choice index in the response: prompt_index * n + output index
    text: str  # text added since the previous update of this choice
    token_ids: list[int]  # tokens added since the previous update
    logprobs: list[dict[int, Logprob]] | None  # their logprob entries (when asked for)
    finish_reason: str | None  # set on the choice's last update
    error: str | None = None  # message when finish_reason == "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it (with finish_reason "stop")


@dataclass(slots=True)
class _Choice:
    num_tokens: int = 0
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Sub:
    """One prompt = one engine request."""

    request_id: str
    prompt: Any
    timer: RequestTimer
    prompt_tokens: int = 0
    finished: bool = False
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None  # known once the engine has tokenized the prompt
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: Any = None  # the engine's RequestMetrics of the latest output
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once the engine has scored the prompt


_END = object()


class Generation:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, prompts: list[Any], params: SamplingParams,
                 request_id: str, priority: int = 0) -> None:
        self._engine = engine
        self._params = dataclasses.replace(params, output_kind="delta")
        self._priority = priority
        self._failed = False  # ended by an exception (not counted as an abort)
        now = time.monotonic()
        self._subs = [_Sub(request_id if len(prompts) == 1 else f"{request_id}-{i}", p, RequestTimer(metrics, now))
                      for i, p in enumerate(prompts)]

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self._subs)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for s in self._subs for c in s.choices.values())

    @property
    def num_choices(self) -> int:
        return len(self._subs) * self._params.n

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self._subs)

    def prompt_token_ids(self, choice: int) -> list[int] | None:
        """The token ids of CHOICE's prompt (None until the engine has tokenized it)."""
        return self._subs[choice // self._params.n].prompt_token_ids

    def timing(self) -> dict[str, float | None] | None:
        """vLLM's per-request "metrics" — only for one prompt with n == 1 (one generation stream), else None."""
        if len(self._subs) != 1 or self._params.n != 1 or self._subs[0].metrics is None:
            return None
        m = self._subs[0].metrics
        return request_metrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                               self.completion_tokens)
    def prompt_scores(self, choice: int) -> tuple[list[int], list[dict[int, Logprob] | None]] | None:
        """The prompt token ids and prompt logprobs of CHOICE's prompt, once the engine has returned them."""
        sub = self._subs[choice // self._params.n]
        if sub.prompt_logprobs is None or sub.prompt_token_ids is None:
            return None
        return sub.prompt_token_ids, sub.prompt_logprobs

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Yields the updates of each engine output as it arrives; aborts what is left when closed early."""
        try:
            if len(self._subs) == 1:
                sub = self._subs[0]
                async for out in self._engine.generate(sub.prompt, self._params, sub.request_id,
                                                      priority=self._priority):
                    yield self._apply(0, sub, out)
            else:
                async for i, out in self._merged():
                    yield self._apply(i, self._subs[i], out)
        except Exception:  # a prompt refused (400), the engine gone: the request failed, it was not aborted
            self._failed = True
            raise
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort every engine request of this generation that has not finished (idempotent, sync)."""
        for sub in self._subs:
            if sub.finished:
                continue
            sub.finished = True
            try:
                self._engine.abort_nowait(sub.request_id)  # queued, never waits for a step
            except (UnknownRequestError, EngineDeadError):
                continue  # never submitted (rejected, or the client left while it was tokenized), or gone
            if not self._failed:  # it was in the engine: an abort, before or after its first token
                sub.timer.finish(time.monotonic(), "abort", None)

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        # bounded: a pump whose output the consumer has not taken waits, and the engine coalesces meanwhile
        # (AsyncEngine's mailbox), so a client that stops reading holds at most one output per prompt here
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=len(self._subs))

        async def pump(i: int, sub: _Sub) -> None:
            try:
                async for out in self._engine.generate(sub.prompt, self._params, sub.request_id,
                                                      priority=self._priority):
                    await queue.put((i, out))
                await queue.put(_END)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._subs)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is _END:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    def _apply(self, i: int, sub: _Sub, out: RequestOutput) -> list[ChoiceUpdate]:
        now = time.monotonic()
        sub.prompt_tokens = len(out.prompt_token_ids)
        sub.prompt_token_ids = out.prompt_token_ids
        sub.cached_tokens = out.num_cached_tokens
        sub.metrics = out.metrics
        if out.prompt_logprobs is not None and sub.prompt_logprobs is None:
            sub.prompt_logprobs = out.prompt_logprobs
        updates = []
        for o in out.outputs:  # deltas: each holds only what is new for its choice
            st = sub.choices.setdefault(o.index, _Choice())
            if st.finished:
                continue
            st.num_tokens += len(o.token_ids)
            st.finish_reason = o.finish_reason
            if o.text or o.token_ids or st.finished:
                updates.append(ChoiceUpdate(i * self._params.n + o.index, o.text, list(o.token_ids),
                                            list(o.logprobs) if o.logprobs is not None else None,
                                            o.finish_reason, o.error, o.stop_reason))
        sub.timer.output(now, max((c.num_tokens for c in sub.choices.values()), default=0))
        if out.finished:
            sub.finished = True
            reasons = [c.finish_reason or "stop" for _, c in sorted(sub.choices.items())]
            reason = "error" if "error" in reasons else "abort" if "abort" in reasons else reasons[0] if reasons else "stop"
            m = out.metrics
            queue_time = (m.first_scheduled_time - m.arrival_time) if m.first_scheduled_time is not None else None
            sub.timer.finish(now, reason, queue_time)
        return updates
