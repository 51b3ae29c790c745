"""AsyncEngine: an LLMEngine stepped by one background thread, for servers.

- asyncio: `await start()`, `async for out in generate(prompt, params, request_id)` (cumulative
  RequestOutputs, the last one finished), `await abort(id)`, `await shutdown()`.
- threads (Triton's python backend): `submit(prompt, params, request_id, callback)`; callback
  (RequestOutput) runs on the engine thread; `abort_nowait(id)`.
The engine itself is not thread-safe: every call into it holds `_lock`. Requests are validated in
the caller's thread, so a bad request raises right there (InvalidRequestError, PromptTooLongError).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from octavo.errors import EngineDeadError, InvalidRequestError
from octavo.runtime.backends.base import Backend
from octavo.runtime.engine import LLMEngine, Prompt
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.outputs import CompletionOutput, RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.stats import EngineStats

logger = logging.getLogger(__name__)
Callback = Callable[[RequestOutput], None]


class AsyncEngine:
    def __init__(self, args: EngineArgs, backend: Backend | None = None) -> None:
        self.engine = LLMEngine(args, backend)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._callbacks: dict[str, Callback] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    # -- lifecycle ----------------------------------------------------------------------------------
    def start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="octavo-engine", daemon=True)
            self._thread.start()

    async def start(self) -> None:
        self.start_thread()

    def shutdown_nowait(self, timeout: float | None = 30.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_nowait)

    # -- thread API ---------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str, callback: Callback,
               *, priority: int = 0) -> None:
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(self._dead or "the engine is shutting down")
            self.engine.add_request(request_id, prompt, params, priority=priority)
            self._callbacks[str(request_id)] = callback
            self._wake.notify_all()
        self.start_thread()

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request; its callback gets a final output with finish_reason "abort"."""
        with self._lock:
            self.engine.abort_request(request_id)
            self._wake.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def add_step_listener(self, fn: Callable[[dict], None]) -> None:
        with self._lock:
            self.engine.add_step_listener(fn)

    # -- asyncio API --------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams | None, request_id: str,
                       *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.submit(prompt, params, request_id, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out),
                    priority=priority)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation)
                try:
                    self.abort_nowait(request_id)
                except (KeyError, EngineDeadError):
                    pass

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    # -- the step loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.engine.has_unfinished_requests():
                    self._wake.wait()
                if self._stopping:
                    self._fail_all("the engine was shut down", reason="abort")
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - an engine bug: end every request, refuse new ones
                    logger.exception("engine step loop died")
                    self._dead = f"the engine stopped after an internal error: {type(exc).__name__}: {exc}"
                    self._fail_all(self._dead, reason="error")
                    return
                calls = []
                for out in outputs:
                    cb = self._callbacks.get(out.request_id)
                    if out.finished:
                        self._callbacks.pop(out.request_id, None)
                    if cb is not None:
                        calls.append((cb, out))
            for cb, out in calls:
                self._call(cb, out)

    def _fail_all(self, message: str, reason: str) -> None:
        """(lock held) End every outstanding request with a final output."""
        for rid, group in list(self.engine.groups.items()):
            outs = [CompletionOutput(index=c.index, text=c.detokenizer.text if c.detokenizer else "",
                                     token_ids=list(c.output_token_ids), finish_reason=reason,
                                     error=message if reason == "error" else None) for c in group.children]
            out = RequestOutput(request_id=rid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                                outputs=outs, finished=True,
                                metrics=group.children[0].metrics)
            cb = self._callbacks.pop(rid, None)
            if cb is not None:
                self._call(cb, out)
        self.engine.groups.clear()

    @staticmethod
    def _call(cb: Callback, out: RequestOutput) -> None:
        try:
            cb(out)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
            logger.exception("output callback for %s failed", out.request_id)


__all__ = ["AsyncEngine", "InvalidRequestError"]
