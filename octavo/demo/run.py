"""Run a set of requests through a real LLMEngine, step by step, and keep every step's trace row.

Arrivals: "together" adds every request before step 1 (the seed's picture); "staggered" adds request i
before step 1 + i*every, so new requests join a batch that is already decoding (and a long prompt is
prefilled beside running decodes). We drive LLMEngine.step() ourselves, so arrivals land on exact steps.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from octavo.demo.profiles import SEED_PROFILES, Profile, prompt_ids
from octavo.errors import InvalidRequestError
from octavo.runtime.kv_dtype import resolve_kv_cache_dtype
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.step_record import StepRecord
from octavo.tracing.reader import check_rows
from octavo.tracing.report import TraceReport, build_report

if TYPE_CHECKING:
    from octavo.runtime.engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DemoRequest:
    id: str
    kind: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_step: int = 1  # added to the engine just before this step runs


@dataclass(slots=True)
class DemoConfig:
    model: str  # export folder, HF folder or .gguf
    block_size: int = 16
    num_blocks: int | None = None  # None: enough for every request at full length, +25% (see pool_blocks)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    arrivals: str = "together"  # "together" | "staggered"
    stagger_every: int = 4
    num_threads: int | None = None
    trace_path: str | None = None
    use_chat_template: bool = True
    enable_prefix_caching: bool = True
    weights: str | None = None  # "int8" | "int4": export the quantized variant (docs/quantization.md)
    kv_cache_dtype: str = "auto"  # "float16": half the KV bytes per token (docs/engine.md)
    engine_extra: dict[str, Any] = field(default_factory=dict)  # any other EngineArgs field (the CLI's flags)


@dataclass(slots=True)
class DemoRun:
    requests: list[DemoRequest]
    rows: list[dict[str, Any]]
    outputs: dict[str, RequestOutput]
    report: TraceReport
    num_blocks: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)


def stagger(requests: Sequence[DemoRequest], every: int) -> list[DemoRequest]:
    """Request i arrives before step 1 + i*every (in the given order)."""
    return [replace(r, arrival_step=1 + i * every) for i, r in enumerate(requests)]


def pool_blocks(requests: Sequence[DemoRequest], block_size: int, headroom: float = 0.25) -> int:
    """Blocks for every request at full length (prompt + max_tokens), plus headroom: no preemption,
    and the pool still runs nearly full at the peak, so the free-block story is visible."""
    need = sum(-(-(len(r.prompt_ids) + r.max_tokens) // block_size) for r in requests)
    return max(1, int(need * (1 + headroom) + 0.999))


def fit_context(requests: Sequence[DemoRequest], max_model_len: int) -> list[str]:
    """Cut prompts that cannot fit the model's context (keeping their end, where the question is)."""
    notes = []
    for r in requests:
        room = max_model_len - r.max_tokens
        if len(r.prompt_ids) > room:
            notes.append(f"seq[{r.id}]: prompt of {len(r.prompt_ids)} tokens cut to its last {room} "
                         f"to fit the model's context of {max_model_len}")
            r.prompt_ids = r.prompt_ids[-room:]
    for n in notes:
        log.warning("%s", n)
    return notes


def run_requests(engine: LLMEngine, requests: Sequence[DemoRequest],
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], dict[str, RequestOutput]]:
    """Add each request before its arrival step, step the engine until all finish; (rows, outputs).

    Greedy sampling, ignore_eos=True and max_tokens from the request: every length is exact. If the
    engine runs dry before the next arrival, that request is added at once (no empty steps exist).
    """
    rows: list[dict[str, Any]] = []
    listening = True

    def listen(record: StepRecord) -> None:
        if listening:
            row = record.trace_row()
            rows.append(row)
            if on_step is not None:
                on_step(row)

    engine.add_step_listener(listen)
    first_step = engine.step_count + 1  # the engine may have run before; arrival steps are relative
    pending = sorted(requests, key=lambda r: r.arrival_step)
    outputs: dict[str, RequestOutput] = {}
    try:
        while pending or engine.has_unfinished_requests():
            next_step = engine.step_count + 1 - first_step + 1
            while pending and (pending[0].arrival_step <= next_step or not engine.has_unfinished_requests()):
                req = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
                engine.add_request(req.id, {"prompt_token_ids": req.prompt_ids}, params)
            for out in engine.step():
                outputs[out.request_id] = out
    finally:
        listening = False
    return rows, outputs


def answer_text(tokenizer: Any, token_ids: list[int], eos_ids: Sequence[int]) -> str:
    """The answer up to the model's own end of turn; what ignore_eos made it write after, summarised."""
    cut = next((i for i, t in enumerate(token_ids) if t in eos_ids), len(token_ids))
    text = tokenizer.decode(token_ids[:cut]).strip()
    if cut < len(token_ids):
        text += f"  ⏹ [end of turn; {len(token_ids) - cut} more tokens generated because ignore_eos=True]"
    return text


def profile_requests(tokenizer: Any, profiles: Sequence[Profile] = SEED_PROFILES,
                     use_chat_template: bool = True) -> list[DemoRequest]:
    return [DemoRequest(p.id, p.kind, prompt_ids(tokenizer, p.messages, use_chat_template), p.max_tokens)
            for p in profiles]


def run_demo(config: DemoConfig, profiles: Sequence[Profile] = SEED_PROFILES,
             on_step: Callable[[dict[str, Any]], None] | None = None) -> DemoRun:
    """Resolve (export once, cached) the model, tokenize the profiles, run them, build the report."""
    from octavo.export.manifest import Manifest
    from octavo.export.resolve import resolve_model
    from octavo.runtime.engine import LLMEngine
    from octavo.runtime.engine_args import EngineArgs
    from octavo.runtime.tokenizer import Tokenizer

    extra = dict(config.engine_extra)
    quant = {k: extra.pop(k) for k in ("quant_block_size", "quantize_lm_head", "quant_kernel") if k in extra}
    model_dir = Path(resolve_model(config.model, weights=config.weights, **quant))
    manifest = Manifest.load(model_dir)
    tokenizer = Tokenizer(model_dir, manifest)
    requests = profile_requests(tokenizer, profiles, config.use_chat_template)
    notes = fit_context(requests, manifest.max_context)
    if config.arrivals == "staggered":
        if config.stagger_every < 1:
            raise InvalidRequestError(f"stagger_every must be >= 1, got {config.stagger_every}")
        requests = stagger(requests, config.stagger_every)
    elif config.arrivals != "together":
        raise InvalidRequestError(f"arrivals must be 'together' or 'staggered', got {config.arrivals!r}")
    num_blocks = config.num_blocks or pool_blocks(requests, config.block_size)
    engine = LLMEngine(EngineArgs(
        model=str(model_dir), block_size=config.block_size, num_blocks=num_blocks,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        num_threads=config.num_threads, trace_path=config.trace_path,
        enable_prefix_caching=config.enable_prefix_caching, kv_cache_dtype=config.kv_cache_dtype,
        **extra,
    ))
    try:
        rows, outputs = run_requests(engine, requests, on_step)
        max_model_len = engine.max_model_len
    finally:
        engine.close()
    eos = list(tokenizer.eos_token_ids)
    answers = {rid: answer_text(tokenizer, out.outputs[0].token_ids, eos) for rid, out in outputs.items()}
    report = build_report(
        check_rows(rows), labels={r.id: r.kind for r in requests}, answers=answers, notes=notes,
        max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
        bytes_per_slot=manifest.kv_bytes_per_block(1, resolve_kv_cache_dtype(config.kv_cache_dtype, manifest)),
    )
    return DemoRun(requests, rows, outputs, report, num_blocks, max_model_len, eos, answers)
