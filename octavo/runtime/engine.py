"""LLMEngine: requests in, one scheduled + computed + sampled step per `step()` call, outputs out.

    add_request ─► Scheduler.schedule() ─► ModelRunner.prepare() ─► Backend.run() ─► Sampler
                                                                  └─ detokenizer, stop checks, free

Everything a user can get wrong is rejected in add_request (InvalidRequestError, PromptTooLongError)
without touching other requests. If the backend fails during a step, only that step's requests end
with finish_reason "error" (their blocks are freed) and the engine keeps serving.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from octavo.errors import InvalidRequestError, PromptTooLongError, StepFailedError, UnknownRequestError
from octavo.export.manifest import MANIFEST_NAME, Manifest
from octavo.runtime.backends.base import Backend
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.detokenizer import IncrementalDetokenizer
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.kv_cache import resolve_kv_cache_dtype
from octavo.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from octavo.runtime.request import Request
from octavo.runtime.runner import ModelRunner
from octavo.runtime.sampler import Sampler
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler
from octavo.runtime.stats import EngineStats
from octavo.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]
DEFAULT_POOL_CONTEXT = 4096  # default pool: max_num_seqs sequences of min(max_model_len, this) tokens
DEFAULT_POOL_CAP = 2 << 30  # ... but at most this many bytes and a quarter of the available memory


@dataclass(slots=True)
class RequestGroup:
    """The user's request: n children sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float
    pending: list[Request] = field(default_factory=list)  # children 1..n-1 until child 0 has its prompt cached
    final_only: bool = False  # SamplingParams.output_kind == "final_only": no output until it is finished

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


def _too_long(prompt_len: int, max_tokens: int, limit: int, what: str) -> tuple[str, str]:
    """(message, param) for prompt + max_tokens > LIMIT: the message says which of the two to change, and to what."""
    head = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds {what}"
    if prompt_len >= limit:  # no max_tokens can help
        return f"{head}; shorten the prompt to at most {limit - max_tokens} tokens", "prompt"
    return f"{head}; lower max_tokens to at most {limit - prompt_len}", "max_tokens"


def resolve_model_dir(model: str | Path, weights: str | None = None, quant_block_size: int | None = None,
                      quantize_lm_head: bool = False) -> Path:
    """An export folder as is; anything else (HF folder, .gguf) is exported once into the cache
    (with WEIGHTS int8/int4: the quantized variant, in its own cache folder)."""
    path = Path(model)
    if (path / MANIFEST_NAME).is_file() and weights is None:
        return path
    from octavo.export.resolve import resolve_model

    return Path(resolve_model(path, weights=weights, quant_block_size=quant_block_size,
                              quantize_lm_head=quantize_lm_head))


def default_num_blocks(args: EngineArgs, manifest: Manifest, max_model_len: int, kv_dtype: str | None = None) -> int:
    """KV pool size: num_blocks wins; else kv_cache_memory bytes; else the documented default.
    kv_dtype: the pool's element type (None: what args.kv_cache_dtype resolves to for this manifest)."""
    kv_dtype = kv_dtype or resolve_kv_cache_dtype(args.kv_cache_dtype, manifest)
    per_block = manifest.kv_bytes_per_block(args.block_size, kv_dtype)
    if args.num_blocks is not None:
        return args.num_blocks
    if args.kv_cache_memory is not None:
        n = int(args.kv_cache_memory) // per_block
        if n < 1:
            raise InvalidRequestError(
                f"kv_cache_memory={args.kv_cache_memory} bytes is less than one KV block ({per_block} bytes "
                f"of {kv_dtype})")
        return n
    want = args.max_num_seqs * -(-min(max_model_len, DEFAULT_POOL_CONTEXT) // args.block_size)
    cap = min(DEFAULT_POOL_CAP, _available_memory() // 4) // per_block
    one_context = -(-max_model_len // args.block_size)
    return max(min(want, cap), min(one_context, want), 1)


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def make_backend(args: EngineArgs, model_dir: Path, manifest: Manifest, max_model_len: int) -> Backend:
    if args.backend == "tensorrt":  # sizes its pool from free GPU memory unless told
        from octavo.build.tensorrt_builder import BUILD_INFO_NAME, BuildInfo
        from octavo.runtime.backends.tensorrt import TensorRTBackend

        # The pool dtype is the engine's, fixed at build time. Without an engine the backend itself says
        # what is missing (TensorRT, or the engine), so sizing falls back to the manifest's dtype.
        built = (model_dir / BUILD_INFO_NAME).is_file()
        pool_dtype = BuildInfo.load(model_dir).dtype if built else manifest.dtype
        if built and args.kv_cache_dtype not in ("auto", pool_dtype):
            raise InvalidRequestError(
                f"this TensorRT engine keeps its KV pool in {pool_dtype} (set by `octavo build --dtype`); "
                f"kv_cache_dtype={args.kv_cache_dtype!r} needs an engine built for it, or use 'auto'")
        explicit = args.num_blocks is not None or args.kv_cache_memory is not None
        num_blocks = default_num_blocks(args, manifest, max_model_len, pool_dtype) if explicit else None
        return TensorRTBackend(model_dir, manifest, num_blocks, args.block_size)
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, manifest)
    return OnnxRuntimeBackend(model_dir, manifest, default_num_blocks(args, manifest, max_model_len, kv_dtype),
                              args.block_size, num_threads=args.num_threads, kv_cache_dtype=kv_dtype)


class LLMEngine:
    def __init__(self, args: EngineArgs, backend: Backend | None = None) -> None:
        args.validate()
        self.args = args
        self.model_dir = resolve_model_dir(args.model, args.weights, args.quant_block_size, args.quantize_lm_head)
        self.manifest = Manifest.load(self.model_dir)
        if args.backend == "tensorrt" and self.manifest.weights != "fp32":  # before any TensorRT import
            raise InvalidRequestError(f"{self.model_dir} holds {self.manifest.weights} weights, which run on the "
                                      "onnxruntime backend only (its MatMulNBits op has no TensorRT plugin here); "
                                      "use backend='onnxruntime', or an fp32 export with tensorrt")
        self.tokenizer = Tokenizer(self.model_dir, self.manifest)
        if args.max_model_len is not None and not 1 <= args.max_model_len <= self.manifest.max_context:
            raise InvalidRequestError(f"max_model_len must be in [1, {self.manifest.max_context}] (the model's "
                                      f"context), got {args.max_model_len}")
        self.max_model_len = args.max_model_len or self.manifest.max_context
        if backend is None:
            backend = make_backend(args, self.model_dir, self.manifest, self.max_model_len)
        elif backend.block_size != args.block_size:
            raise InvalidRequestError(f"backend block_size {backend.block_size} != EngineArgs.block_size {args.block_size}")
        self.backend = backend
        self.block_size = args.block_size
        self.num_blocks = backend.num_blocks
        self.block_manager = BlockManager(self.num_blocks, self.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        max_blocks = min(self.block_manager.blocks_needed(self.max_model_len), self.num_blocks)
        self.runner = ModelRunner(backend, self.block_size, args.max_num_seqs, args.max_num_batched_tokens, max_blocks)
        self.sampler = Sampler(self.tokenizer.eos_token_ids)
        self.vocab_size = self.manifest.vocab_size
        self.groups: dict[str, RequestGroup] = {}
        self._arrival_counter = itertools.count(1)  # thread-safe under the GIL (make_group)
        self._arrived: list[str] = []
        self._finished_since_step: list[dict[str, str]] = []
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, returned by the next step
        self._listeners: list[Callable[[dict], None]] = []
        self._trace_file = open(args.trace_path, "w") if args.trace_path else None  # noqa: SIM115
        self.step_count = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue a request; raises InvalidRequestError / PromptTooLongError (nothing queued)."""
        self.add_group(self.make_group(request_id, prompt, params, arrival_time=arrival_time, priority=priority))

    def make_group(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                   arrival_time: float | None = None, priority: int = 0) -> RequestGroup:
        """Validate and tokenize a request without touching the engine's state (safe from any thread)."""
        request_id = str(request_id)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a private, normalised and validated copy
        text, ids = self._prompt_ids(prompt)
        max_tokens = self._check_fits(len(ids), params)
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        now = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            order = next(self._arrival_counter)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=rid, prompt_token_ids=ids, params=params, generator=self._generator(params, i, order),
                max_tokens=max_tokens, arrival_order=order, priority=priority,
                parent_id=request_id, index=i, metrics=RequestMetrics(arrival_time=now),
                logprobs=[] if params.logprobs is not None else None,
            )
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
            children.append(req)
        # children 1..n-1 join once child 0 has computed the prompt: they then share its cached blocks
        return RequestGroup(request_id, text, ids, children, now, pending=children[1:],
                            final_only=params.output_kind == "final_only")

    def add_group(self, group: RequestGroup) -> None:
        """Queue a request made by make_group."""
        if group.request_id in self.groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        self.scheduler.add(group.children[0])
        self._arrived.extend(c.request_id for c in group.children)  # sequence ids, as in "requests"

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
                raise InvalidRequestError("prompt_token_ids must be integers")
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        else:
            raise InvalidRequestError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return text, ids

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's effective max_tokens, or PromptTooLongError if it can never fit."""
        pool_tokens = self.num_blocks * self.block_size
        limit = min(self.max_model_len, pool_tokens + 1)  # the last sampled token needs no KV slot
        if params.max_tokens is None:
            if prompt_len >= limit:
                raise PromptTooLongError(
                    f"the prompt has {prompt_len} tokens; the limit is {limit - 1} "
                    f"(max_model_len {self.max_model_len}, KV pool {pool_tokens} tokens): shorten the prompt",
                    param="prompt")
            return limit - prompt_len
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(*_too_long(prompt_len, params.max_tokens, self.max_model_len,
                                                f"the model's context of {self.max_model_len} tokens"))
        if total > pool_tokens + 1:
            where = (f"the whole KV pool ({self.num_blocks} blocks of {self.block_size} = {pool_tokens} tokens; "
                     "a bigger pool: num_blocks / kv_cache_memory)")
            raise PromptTooLongError(*_too_long(prompt_len, params.max_tokens, pool_tokens + 1, where))
        return params.max_tokens

    def _generator(self, params: SamplingParams, index: int, order: int) -> np.random.Generator:
        if params.seed is None:
            return np.random.default_rng([self.args.seed % (1 << 64), order])
        seed = params.seed % (1 << 64)
        return np.random.default_rng(seed if index == 0 else [seed, index])

    def abort_request(self, request_id: str) -> None:
        group = self.groups.get(str(request_id))
        if group is None:
            raise UnknownRequestError(f"no running request has id {request_id!r} (finished, aborted or never added)")
        group.pending = []
        for req in group.children:
            if not req.finished:
                self._finish(req, "abort")
        del self.groups[group.request_id]
        self._pending.append(self._output(group))

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._pending)

    def add_step_listener(self, fn: Callable[[dict], None]) -> None:
        self._listeners.append(fn)

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        if not sched.scheduled:
            return outputs
        self.step_count += 1
        inputs, to_sample = self.runner.prepare(sched.scheduled)
        error: str | None = None
        try:
            logits = self.runner.run(inputs)
            if logits.shape[0] != len(to_sample):
                raise StepFailedError(f"backend returned {logits.shape[0]} logits rows, expected {len(to_sample)}")
            sampled = self.sampler(logits, to_sample)
        except Exception as exc:  # noqa: BLE001 - any backend failure ends only this step's requests
            logger.exception("step %d failed; ending its %d requests with an error", self.step_count, len(sched.scheduled))
            error = f"{type(exc).__name__}: {exc}"
        tracing = bool(self._listeners) or self._trace_file is not None  # rows only for a reader
        rows = []
        touched: dict[str, RequestGroup] = {}
        for req, n in sched.scheduled.items():
            start = req.num_computed_tokens
            if error is None:
                req.num_computed_tokens += n
                self.block_manager.cache_full_blocks(req)
                self.prompt_tokens_total += max(0, min(n, req.num_prompt_tokens - start))
            if tracing:
                rows.append({"id": req.request_id,
                             "phase": "decode" if n == 1 and start >= req.num_prompt_tokens else "prefill",
                             "tokens": n, "prompt_len": req.num_prompt_tokens, "total_len": start + n,
                             "output_len": req.num_output_tokens, "blocks": len(req.block_table),
                             "cached": req.num_cached_tokens})
            if error is not None:
                req.error = error
                self._finish(req, "error")
                touched[req.parent_id] = self.groups[req.parent_id]
        if error is None:
            now = time.time()
            for req, tok, lp in zip(to_sample, sampled.token_ids, sampled.logprobs):
                touched[req.parent_id] = self.groups[req.parent_id]
                try:
                    self._append_token(req, tok, lp, now)
                except Exception as exc:  # noqa: BLE001 - e.g. a token the tokenizer cannot decode: end only this one
                    logger.exception("request %s failed after sampling token %d", req.request_id, tok)
                    if not req.finished:
                        req.error = f"{type(exc).__name__}: {exc}"
                        self._finish(req, "error")
        for row, req in zip(rows, sched.scheduled):
            row["output_len"] = req.num_output_tokens
        for group in touched.values():
            first = group.children[0]
            if group.pending and (first.output_token_ids or first.finished):
                for req in group.pending:
                    self.scheduler.add(req)
                group.pending = []
        for group in touched.values():
            if group.finished or not group.final_only:
                outputs.append(self._output(group))
            if group.finished:
                del self.groups[group.request_id]
        if tracing:
            self._trace(t0, sched, rows)
        else:
            self._arrived, self._finished_since_step = [], []
        return outputs

    def _append_token(self, req: Request, tok: int, lp: dict[int, float] | None, now: float) -> None:
        p = req.params
        req.output_token_ids.append(tok)
        self.generation_tokens_total += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.logprobs is not None and lp is not None:
            req.logprobs.append({t: Logprob(t, v, self.tokenizer.decode([t], skip_special_tokens=False))
                                 for t, v in lp.items()})
        detok = req.detokenizer
        assert detok is not None
        min_done = req.num_output_tokens >= p.min_tokens
        if min_done and tok in p.stop_token_ids:
            if p.include_stop_str_in_output:
                detok.add(tok)
            req.stop_reason = tok
            self._finish(req, "stop")
            return
        if min_done and not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            self._finish(req, "stop")
            return
        stop = detok.add(tok, check_stop=min_done)
        if stop is not None:
            req.stop_reason = stop
            self._finish(req, "stop")
            return
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        if req.detokenizer is not None:
            try:
                req.detokenizer.flush()
            except Exception:  # noqa: BLE001 - never let text decoding keep blocks allocated
                logger.exception("detokenizer flush failed for %s", req.request_id)
        self.scheduler.finish(req, reason)
        req.metrics.finished_time = time.time()
        self._finished_since_step.append({"id": req.request_id, "reason": reason})

    def _output(self, group: RequestGroup) -> RequestOutput:
        outs = []
        for c in group.children:
            text = c.detokenizer.visible_text(c.finished) if c.detokenizer is not None else ""
            outs.append(CompletionOutput(
                index=c.index, text=text, token_ids=list(c.output_token_ids), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=list(c.logprobs) if c.logprobs is not None else None,
                error=c.error))
        ms = [c.metrics for c in group.children]

        def first(vals: list[float | None]) -> float | None:
            vals2 = [v for v in vals if v is not None]
            return min(vals2) if vals2 else None

        finished = group.finished
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=first([m.first_scheduled_time for m in ms]),
            first_token_time=first([m.first_token_time for m in ms]),
            last_token_time=max((m.last_token_time for m in ms if m.last_token_time is not None), default=None),
            finished_time=max(m.finished_time or 0.0 for m in ms) if finished else None,
            num_cached_tokens=ms[0].num_cached_tokens,
            num_preemptions=sum(m.num_preemptions for m in ms),
        )
        return RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             outputs=outs, finished=finished, metrics=metrics,
                             num_cached_tokens=metrics.num_cached_tokens)

    # -- observability ------------------------------------------------------------------------------
    def _trace(self, t0: float, sched: Any, rows: list[dict]) -> None:
        row = {
            "step": self.step_count, "time": time.time(), "duration_s": time.perf_counter() - t0,
            "batch_size": len(sched.scheduled), "num_tokens": sched.num_tokens,
            "num_waiting": len(self.scheduler.waiting), "free_blocks": self.block_manager.num_free_blocks,
            "total_blocks": self.num_blocks, "block_size": self.block_size, "requests": rows,
            "arrived": self._arrived, "finished": self._finished_since_step,
            "preempted": [r.request_id for r in sched.preempted],
            "held": [r.request_id for r in sched.held],  # waiting for a prefix block another request is computing
        }
        self._arrived, self._finished_since_step = [], []
        if self._trace_file is not None:
            self._trace_file.write(json.dumps(row) + "\n")
            self._trace_file.flush()
        for fn in self._listeners:
            try:
                fn(row)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
                logger.exception("step listener %r failed", fn)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=self.num_blocks,
            kv_cache_usage=1.0 - bm.num_free_blocks / self.num_blocks,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, step_count=self.step_count,
        )

    def close(self) -> None:
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
