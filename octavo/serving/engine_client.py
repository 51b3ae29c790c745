"""EngineClient: the server's handle on the AsyncEngine, keeping engine calls off the event loop.

AsyncEngine holds its lock for a whole step, so `submit` / `abort_nowait` called on the event loop
would freeze every stream for a step or more (measured: ~2 steps per call under load). Here they run
on one worker thread, in FIFO order — an abort always follows its request's submit, even when the
client vanished while the submit was still waiting — and back to back, so a burst of arrivals is
admitted together. Outputs come back through the engine's callback onto the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from octavo.errors import EngineDeadError, UnknownRequestError
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class EngineClient:
    def __init__(self, engine: Any) -> None:
        self.engine = engine  # octavo.AsyncEngine, started
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="octavo-engine-calls")

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        submitted = loop.run_in_executor(self._calls, self.engine.submit, prompt, params, request_id, on_output)
        finished = False
        try:
            await asyncio.shield(submitted)  # raises the engine's InvalidRequestError / PromptTooLongError
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
                submitted.add_done_callback(_retrieve)  # a submit error after we left is not "unretrieved"

    def abort(self, request_id: str) -> None:
        """Abort without waiting (queued after the request's submit); unknown/finished ids are ignored."""
        try:
            self._calls.submit(self._abort, request_id)
        except RuntimeError:  # executor already shut down: the engine is going away anyway
            pass

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_nowait(request_id)
        except (UnknownRequestError, EngineDeadError):
            pass
        except Exception:  # noqa: BLE001 - an abort must never take the worker down
            log.exception("aborting %s failed", request_id)

    def stats(self) -> Any:
        return self.engine.stats()

    def close(self) -> None:
        """Run the queued calls (aborts), then stop the worker."""
        self._calls.shutdown(wait=True)
