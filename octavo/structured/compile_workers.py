"""CompileWorkers: the threads that run native grammar compiles, each with a large stack, behind a bounded queue.

Why not a ThreadPoolExecutor: its threads get the process' default stack (8 MiB here), and llguidance recurses on
the caller's stack (~3.4 KB a `$ref` or rule level): a stack overflow in native code kills the process. These
threads are started with `COMPILE_STACK_BYTES` (virtual memory: only the pages a compile touches are committed),
about 7x what the deepest constraint the limits admit needs (limits.py). Why not a subprocess: a compiled
matcher cannot cross a process boundary, so it would have to be compiled twice.

The queue is bounded (`max_queued` jobs waiting): past it `submit` raises CompileQueueFullError at once
(a 503 with Retry-After from the server), so a burst of constraints cannot grow memory or latency without end,
and requests whose grammar is already compiled never wait behind it (the cache answers them first).
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from octavo.errors import OverloadedError

log = logging.getLogger(__name__)

COMPILE_STACK_BYTES = 256 << 20
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it, start a thread, put it back


class CompileQueueFullError(OverloadedError):
    """More constraints are waiting to compile than the queue holds."""


class CompileFuture(concurrent.futures.Future):
    """A job's Future, and when a worker began it (a request's compile time-out runs from then, not from the
    time it waited in the queue behind others)."""

    started_at: float | None = None

    def seconds_left(self, timeout: float) -> float | None:
        """TIMEOUT minus the seconds the job has run (None while it waits for a worker)."""
        started = self.started_at
        return None if started is None else timeout - (time.monotonic() - started)


@dataclass(slots=True)
class CompileWorkers:
    threads: int = 2
    max_queued: int = 64
    stack_bytes: int = COMPILE_STACK_BYTES
    _jobs: queue.Queue = field(init=False)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def __post_init__(self) -> None:
        self._jobs = queue.Queue(self.max_queued)

    def submit(self, fn: Callable[..., Any], *args: Any) -> CompileFuture:
        """Run FN(*ARGS) on a worker; its Future. CompileQueueFullError when the queue is full."""
        self._start()
        fut = CompileFuture()
        try:
            self._jobs.put_nowait((fut, fn, args))
        except queue.Full:
            raise CompileQueueFullError(f"{self.max_queued} output constraints are already waiting to compile; "
                                        "retry shortly") from None
        return fut

    def close(self) -> None:
        """Stop the workers once the jobs already queued are done (does not wait)."""
        with self._lock:
            self._closed = True
            for _ in self._workers:
                self._jobs.put((None, None, ()))  # blocks only while the queue is full of real jobs

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile workers are closed")
            while len(self._workers) < self.threads:
                with _STACK_SIZE_LOCK:
                    old = threading.stack_size(self.stack_bytes)
                    try:
                        t = threading.Thread(target=self._run, name=f"octavo-compile-{len(self._workers)}", daemon=True)
                        t.start()
                    finally:
                        threading.stack_size(old)
                self._workers.append(t)

    def _run(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            if fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            fut.started_at = time.monotonic()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter (a pyo3 panic is a BaseException)
                fut.set_exception(exc)
