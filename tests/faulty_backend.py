"""FaultyBackend: wraps a real backend and misbehaves on purpose (fault injection for reliability tests).
A test double: it lives with the tests and is not part of the octavo package; tests pass it to the engine.

    inner = OnnxRuntimeBackend(folder, manifest, num_blocks, block_size)
    backend = FaultyBackend(inner, FaultPlan(fail_on_calls={3}, delay_s=0.05))
    engine = LLMEngine(args, backend)          # or AsyncEngine(args, backend)

What it can do, per call of `run` (calls are numbered from 1, one call per engine step):
- raise: on the calls in `fail_on_calls`, or when `fail_if(inputs)` is true (e.g. a poison token),
  before the inner backend runs (nothing written); on the calls in `fail_after_run_on`, after it ran
  (the KV pool was written, as a real mid-step crash would leave it);
- return bad logits: NaN rows on `nan_on_calls`, one row too few on `short_on_calls`;
- be slow: sleep `delay_s` (or `delay_fn(call)`) seconds before running.
Everything it did is counted in `calls`, `failures` and `failed_request_counts` for assertions.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from octavo.runtime.backends.base import Backend, StepInputs


class InjectedFault(RuntimeError):
    """The error a FaultyBackend raises; its message names the call that failed."""


@dataclass(slots=True)
class FaultPlan:
    fail_on_calls: set[int] = field(default_factory=set)
    fail_if: Callable[[StepInputs], bool] | None = None
    fail_after_run_on: set[int] = field(default_factory=set)  # raise after the inner backend wrote the pool
    nan_on_calls: set[int] = field(default_factory=set)
    short_on_calls: set[int] = field(default_factory=set)
    delay_s: float = 0.0
    delay_fn: Callable[[int], float] | None = None  # call number -> seconds (wins over delay_s)


class FaultyBackend:
    """A Backend that forwards to `inner` and injects the faults of `plan`. Thread-safe counters."""

    def __init__(self, inner: Backend, plan: FaultPlan | None = None) -> None:
        self.inner = inner
        self.plan = plan if plan is not None else FaultPlan()
        self.num_blocks = inner.num_blocks
        self.block_size = inner.block_size
        self.vocab_size = inner.vocab_size
        self.calls = 0
        self.failures = 0
        self.failed_request_counts: list[int] = []  # sequences in each failed call
        self._lock = threading.Lock()

    def run(self, inputs: StepInputs) -> np.ndarray:
        with self._lock:
            self.calls += 1
            call = self.calls
        plan = self.plan
        delay = plan.delay_fn(call) if plan.delay_fn is not None else plan.delay_s
        if delay > 0:
            time.sleep(delay)
        if call in plan.fail_on_calls or (plan.fail_if is not None and plan.fail_if(inputs)):
            self._count_failure(inputs)
            raise InjectedFault(f"injected backend failure on call {call}")
        logits = self.inner.run(inputs)
        if call in plan.fail_after_run_on:
            self._count_failure(inputs)
            raise InjectedFault(f"injected backend failure after running call {call}")
        if call in plan.nan_on_calls:
            logits = np.full_like(logits, np.nan)
        if call in plan.short_on_calls:
            logits = logits[:-1]
        return logits

    def _count_failure(self, inputs: StepInputs) -> None:
        with self._lock:
            self.failures += 1
            self.failed_request_counts.append(len(inputs.past_seqlens))

    def __getattr__(self, name: str) -> object:
        """Optional backend methods (copy_blocks) are the inner backend's: faults are injected in run only."""
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        self.inner.close()


__all__ = ["FaultPlan", "FaultyBackend", "InjectedFault"]
