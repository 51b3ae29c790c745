"""AsyncEngine: an LLMEngine stepped by one background thread, for servers.

- asyncio: `await start()`, `async for out in generate(prompt, params, request_id)` (RequestOutputs of
  params.output_kind, the last one finished), `await abort(id)`, `await shutdown()`.
- threads (Triton's python backend): `submit(prompt, params, request_id, callback)`; callback
  (RequestOutput) runs on the engine thread; `abort_nowait(id)`; `shutdown_sync(timeout)` (blocks).

What a slow `generate` consumer has not read is coalesced into one pending output (OutputMailbox: deltas
concatenated, bounded by the request's own output); one that falls more than `max_unread_entries` tokens
+ logprob entries behind is aborted, so no client can make the server buffer without bound.

Only the engine thread touches the LLMEngine. `submit` validates and tokenizes in the caller's
thread (so a bad request raises right there: InvalidRequestError, PromptTooLongError) and drops the
prepared request into an inbox; `generate` does the same, tokenizing on a worker thread so that the
event loop never waits for a long prompt; `abort_nowait` queues behind it. Neither waits for a step: the
inbox lock is never held while the engine computes. The thread drains the inbox before every step.

Every submitted request gets exactly one final output, whatever happens: it finishes, it is aborted, the
engine shuts down ("abort") or the step loop dies ("error"; requests aborted just before keep "abort"). The
backend is closed only when no step can be running: by `shutdown` once the thread has left its loop, or by
the thread itself on its way out when `shutdown`'s join timed out.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from octavo.errors import EngineDeadError, InvalidRequestError, UnknownRequestError
from octavo.runtime.backends.base import Backend
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.input_processor import Prompt
from octavo.runtime.output_mailbox import DEFAULT_MAX_ENTRIES, OutputMailbox
from octavo.runtime.output_processor import RequestGroup
from octavo.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from octavo.runtime.lora import LoRARegistry
from octavo.runtime.pooling_params import EmbeddingModel
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.stats import EngineStats
from octavo.runtime.step_record import StepListener
from octavo.runtime.tokenizer import Tokenizer
from octavo.structured.compile_workers import CompileFuture
from octavo.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)
Callback = Callable[[RequestOutput], None]


class AsyncEngine:
    def __init__(self, args: EngineArgs, backend: Backend | None = None, *,
                 max_unread_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.engine = LLMEngine(args, backend)
        self.max_unread_entries = max_unread_entries
        self._lock = threading.Lock()  # guards the inbox, the callbacks and the flags (never held during a step)
        self._wake = threading.Condition(self._lock)
        # ("add", group) | ("abort", request_id) | ("call", (fn, done)): see between_steps
        self._inbox: list[tuple[str, Any]] = []
        self._callbacks: dict[str, Callback] = {}  # the requests submitted and not finished yet
        try:
            self._stats = self.engine.stats()
        except BaseException:
            self.engine.close()  # nobody else holds the engine yet: release its backend before raising
            raise
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None
        self._loop_done = False  # the thread has left its loop (no step runs any more)
        self._close_on_exit = False  # shutdown timed out waiting: the thread closes the engine when it leaves
        self._closed = False

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def loras(self) -> LoRARegistry:
        """The LoRA adapters this engine serves (name -> slot, and each one's folder)."""
        return self.engine.loras

    @property
    def embedding_model(self) -> EmbeddingModel:
        """What embedding requests get on this model: its pooling config (None: none) and hidden size."""
        return self.engine.inputs.embedding_model

    # -- lifecycle ----------------------------------------------------------------------------------
    def start_thread(self) -> None:
        with self._lock:
            if self._thread is not None or self._stopping:
                return
            self._thread = threading.Thread(target=self._loop, name="octavo-engine", daemon=True)
        self._thread.start()

    async def start(self) -> None:
        self.start_thread()

    def shutdown_sync(self, timeout: float | None = 30.0) -> bool:
        """Stop the loop (outstanding requests end with "abort") and release the backend.

        Returns True when the backend is closed on return. If a step is still running after TIMEOUT seconds,
        the backend is not closed under it: the engine thread closes it when that step ends (returns False)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        with self._lock:
            if thread is not None and not self._loop_done:
                self._close_on_exit = True
                logger.warning("engine shutdown: a step is still running after %s s; the engine thread will "
                               "release the backend when it ends", timeout)
                return False
        self._close_engine()
        return True

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_sync)

    def _close_engine(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.engine.close()

    # -- thread API ---------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str, callback: Callback,
               *, priority: int = 0) -> None:
        """Queue a request; raises at once if it is invalid. callback gets every output, on the engine thread."""
        self._check_alive()
        self._enqueue(self.engine.inputs.make_group(str(request_id), prompt, params, priority=priority), callback)

    def _enqueue(self, group: RequestGroup, callback: Callback) -> None:
        with self._lock:
            self._check_alive()
            if group.request_id in self._callbacks:
                raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
            self._callbacks[group.request_id] = callback
            self._inbox.append(("add", group))
            self._wake.notify_all()
        self.start_thread()

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request; its callback gets a final output with finish_reason "abort".
        Raises UnknownRequestError if no such request is running (never submitted, or already over)."""
        request_id = str(request_id)
        with self._lock:
            if request_id not in self._callbacks:
                raise UnknownRequestError(f"no running request has id {request_id!r} (finished, aborted or never added)")
            self._inbox.append(("abort", request_id))
            self._wake.notify_all()

    @property
    def dead_reason(self) -> str | None:
        """Why the step loop stopped after an internal error; None while it is healthy."""
        return self._dead

    def stats(self) -> EngineStats:
        """The counters as of the end of the latest step (or inbox drain)."""
        return self._stats

    def add_step_listener(self, fn: StepListener) -> None:
        self.engine.add_step_listener(fn)  # a list append: safe while the thread runs

    # -- asyncio API --------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams | None, request_id: str,
                       *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        request_id = str(request_id)
        self._check_alive()
        # validate and tokenize on a worker thread (a long prompt takes seconds, the event loop must not wait);
        # queue it from here, so a consumer that leaves meanwhile leaves no request behind
        group = await asyncio.to_thread(self.engine.inputs.make_group, request_id, prompt, params, priority=priority)
        delta = group.output_kind == "delta"
        box = OutputMailbox(asyncio.get_running_loop(), self.max_unread_entries,
                            on_overflow=lambda: self._overflow(request_id))
        self._enqueue(group, lambda out: box.put(out, delta))
        finished = False
        try:
            while not finished:
                out = await box.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation)
                try:
                    self.abort_nowait(request_id)
                except UnknownRequestError:
                    pass

    def _overflow(self, request_id: str) -> None:
        logger.warning("request %s: its consumer is more than %d entries behind; aborting it", request_id,
                       self.max_unread_entries)
        try:
            self.abort_nowait(request_id)
        except UnknownRequestError:
            pass

    async def prepare_constraint(self, params: StructuredOutputsParams) -> None:
        """Compile PARAMS' output constraint on the grammar workers (never on the event loop), so a request can
        be refused before it is queued: StructuredOutputError if the constraint is unusable, passes the limits
        or does not compile in time; OverloadedError if too many are waiting to compile. The compiled grammar
        is cached, so the request's own matcher is then a copy."""
        compiler = self.engine.structured.compiler
        job = compiler.prepare(params)
        waited = asyncio.wrap_future(job)
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even after a time-out
        timeout = compiler.limits.compile_timeout
        while True:  # the time-out runs from when a worker starts the compile, not while it queues
            left = job.seconds_left(timeout) if isinstance(job, CompileFuture) else None
            try:  # shield: the compile is shared with every request of the same constraint; it is never cancelled
                await asyncio.wait_for(asyncio.shield(waited), max(left, 0.0) if left is not None else timeout)
                return
            except TimeoutError:
                left = job.seconds_left(timeout) if isinstance(job, CompileFuture) else None
                if left is not None and left <= 0:
                    raise compiler.timeout_error(params) from None

    async def between_steps(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread between two steps (what must not change while a step runs: the
        backend's LoRA slots); its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, exc: BaseException | None) -> None:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(result)

        def done(result: Any, exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(settle, result, exc)

        with self._lock:
            self._check_alive()
            self._inbox.append(("call", (fn, done)))
            self._wake.notify_all()
        self.start_thread()
        return await future

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    # -- the step loop ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _loop(self) -> None:
        try:
            self._run_loop()
        finally:
            with self._lock:
                self._loop_done = True
                close = self._close_on_exit
            if close:  # shutdown gave up waiting for our last step: release the backend now that it is over
                self._close_engine()

    def _run_loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not self._stopping and not self._inbox and not engine.has_unfinished_requests():
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            try:
                for op, arg in inbox:
                    if op == "add":
                        engine.add_group(arg)  # type: ignore[arg-type]
                    elif op == "call":  # a function that must run between steps (loading a LoRA adapter)
                        fn, done = arg  # type: ignore[misc]
                        try:
                            done(fn(engine), None)
                        except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's
                            done(None, exc)
                    else:
                        try:
                            engine.abort_request(arg)  # type: ignore[arg-type]
                        except UnknownRequestError:
                            pass  # it finished meanwhile
                if stopping:
                    self._abort_all()
                    return
                steps = engine.step_count
                outputs = engine.step()
                self._stats = engine.stats()
                if not outputs and engine.step_count == steps:
                    time.sleep(0.001)  # nothing could run (should not happen): do not spin
            except Exception as exc:  # noqa: BLE001 - an engine bug: end every request, refuse new ones
                logger.exception("engine step loop died")
                with self._lock:
                    self._dead = f"the engine stopped after an internal error: {type(exc).__name__}: {exc}"
                self._end_all(self._dead)
                return
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            cb = self._callbacks.get(out.request_id)
            if out.finished:
                self._callbacks.pop(out.request_id, None)
        if cb is not None:
            try:
                cb(out)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
                logger.exception("output callback for %s failed", out.request_id)

    def _abort_all(self) -> None:
        """Shutdown: abort every request through the engine (freeing its blocks) and deliver the final outputs,
        those of aborts drained just before included."""
        self.engine.abort_all("abort")
        for out in self.engine.step():  # nothing is left to schedule: it only returns the aborted requests' outputs
            self._deliver(out)
        self._stats = self.engine.stats()

    def _end_all(self, message: str) -> None:
        """After an engine failure: end every request that has not had its final output yet, without asking the
        broken engine to step: those it runs, those still in the inbox, and those aborted (or finished) by the
        failed step or just before it. Children that finished keep their finish reason ("abort", ...); the
        others end with "error" and MESSAGE (the output processor builds these outputs as any other)."""
        with self._lock:
            waiting = [arg for op, arg in self._inbox if op == "add"]
            self._inbox = []
        for out in self.engine.outputs.end_all(message, more=waiting):  # type: ignore[arg-type]
            self._deliver(out)
        with self._lock:
            orphans = list(self._callbacks)  # their group was lost inside the failed step (an engine bug)
        for request_id in orphans:
            self._deliver(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "error", error=message)],
                                        finished=True, metrics=RequestMetrics(arrival_time=time.time())))
        self._stats = self.engine.stats()
