"""LLMEngine: requests in, one scheduled + computed + sampled step per `step()` call, delta outputs out.

    add_request ─► InputProcessor ─► Scheduler.schedule() ─► ModelRunner.prepare() ─► Backend.run()
        ─► RejectionSampler (the Sampler; verifies draft tokens) ─► Scheduler.update_from_output() (the commit)
        ─► OutputProcessor (text, stop strings, RequestOutputs) ─► StepRecord to the step listeners

Everything a user can get wrong is rejected in add_request (InvalidRequestError, PromptTooLongError)
without touching other requests. If the backend or the sampler fails during a step, only that step's
requests end with "error" (their blocks are freed) and the engine keeps serving (docs/architecture.md).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from octavo.errors import InvalidRequestError, StepFailedError, UnknownRequestError
from octavo.runtime.backends.base import Backend
from octavo.runtime.beam_search import BeamSearchManager
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.input_processor import InputProcessor, Prompt
from octavo.runtime.kv_events import KVEventLog, KVEventsConfig
from octavo.runtime.model_setup import load_model
from octavo.runtime.output_processor import OutputProcessor, RequestGroup
from octavo.runtime.outputs import RequestOutput
from octavo.export.pooling_config import PoolingConfig
from octavo.runtime.lora import LoRAAdapter, load_lora_modules
from octavo.runtime.pooling import accept_rows, finished_embeddings, pooling_rows, run_step
from octavo.runtime.pooling_params import EmbeddingModel
from octavo.runtime.request import Request
from octavo.runtime.prompt_logprobs import max_prompt_logprob_rows, prompt_rows
from octavo.runtime.rejection_sampler import RejectionSampler
from octavo.runtime.runner import ModelRunner
from octavo.runtime.sampler import Sampler
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler
from octavo.runtime.spec_decode import make_proposer
from octavo.runtime.speculative_config import SpeculativeConfig, with_cpu_default
from octavo.runtime.stats import EngineStats, engine_stats
from octavo.runtime.step_record import StepListener, StepRecord, notify
from octavo.runtime.reasoning import get_reasoning_format
from octavo.runtime.structured_outputs import StructuredOutputManager
from octavo.runtime.trace_writer import JsonlTraceWriter

if TYPE_CHECKING:
    from octavo.runtime.kv_event_publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


def open_kv_event_publisher(config: KVEventsConfig, block_size: int) -> ZmqEventPublisher:
    """The ZeroMQ publisher (imported here: pyzmq and msgspec come with the serve extra)."""
    try:
        from octavo.runtime.kv_event_publisher import ZmqEventPublisher
    except ModuleNotFoundError as exc:
        raise InvalidRequestError(f"kv_events_config needs {exc.name!r}: pip install 'octavo[serve]'") from None
    return ZmqEventPublisher(config, block_size)


class LLMEngine:
    def __init__(self, args: EngineArgs, backend: Backend | None = None) -> None:
        args.validate()
        self.args = args
        model = load_model(args, backend)
        self.model_dir, self.manifest, self.tokenizer = model.model_dir, model.manifest, model.tokenizer
        self.max_model_len, self.backend = model.max_model_len, model.backend
        self.block_size, self.num_blocks, self.vocab_size = args.block_size, self.backend.num_blocks, self.manifest.vocab_size
        kv_events = args.kv_events()
        self._kv_log = KVEventLog() if kv_events.publishes else None
        self.block_manager = BlockManager(self.num_blocks, self.block_size, args.enable_prefix_caching, self._kv_log)
        prompt_logprob_rows = max_prompt_logprob_rows(self.backend, args.max_num_seqs, self.vocab_size)
        spec = with_cpu_default(SpeculativeConfig.parse(args.speculative_config), args.backend)
        self.proposer = make_proposer(spec, args, self.vocab_size, self.max_model_len) if spec else None
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                                   eos_token_ids=self.tokenizer.eos_token_ids, max_model_len=self.max_model_len,
                                   max_prompt_logprob_rows=prompt_logprob_rows,
                                   speculative_config=spec, proposer=self.proposer)
        max_blocks = min(self.block_manager.blocks_needed(self.max_model_len), self.num_blocks)
        self.runner = ModelRunner(self.block_size, args.max_num_seqs, args.max_num_batched_tokens, max_blocks)
        self.sampler = RejectionSampler(Sampler(self.tokenizer.eos_token_ids))
        self.structured = StructuredOutputManager(  # grammars, masks
            self.tokenizer, self.vocab_size, args.constraint_limits(),
            reasoning=get_reasoning_format(args.reasoning_parser) if args.reasoning_parser else None)
        self.beams = BeamSearchManager(self.scheduler, self.block_manager, self.backend, self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.num_blocks,
                                     self.block_size, args.seed, self.structured, beam_search_refusal=self.beams.refusal,
                                     prompt_logprob_rows=prompt_logprob_rows,
                                     max_prompt_logprob_entries=args.max_prompt_logprob_entries,
                                     max_logprobs=args.max_logprobs,
                                     embedding_model=EmbeddingModel(
                                         PoolingConfig.from_json(self.manifest.pooling) if self.manifest.pooling else None,
                                         self.manifest.hidden_size, hasattr(self.backend, "run_with_hidden")))
        self.loras = load_lora_modules(args.lora_modules, args.max_loras, args.max_lora_rank, self.backend)
        self.inputs.loras = self.loras
        self.outputs = OutputProcessor(self.tokenizer)
        self._trace = JsonlTraceWriter(args.trace_path) if args.trace_path else None
        self._listeners: list[StepListener] = [self._trace] if self._trace is not None else []
        self._arrived: list[str] = []
        self.step_count = 0
        self.kv_event_publisher: ZmqEventPublisher | None = None
        if self._kv_log is not None:
            try:
                self.kv_event_publisher = open_kv_event_publisher(kv_events, self.block_size)
            except BaseException:
                self.close()  # nobody else holds the engine yet: release its backend before raising
                raise

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue a request; raises InvalidRequestError / PromptTooLongError (nothing queued)."""
        self.add_group(self.inputs.make_group(request_id, prompt, params, arrival_time=arrival_time, priority=priority))

    def add_group(self, group: RequestGroup) -> None:
        """Queue a request made by InputProcessor.make_group (which validated it, safe from any thread)."""
        if group.request_id in self.outputs.groups or self.beams.has(group.request_id):
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
        if group.children[0].params.use_beam_search:  # its beams are the beam search's, its output too
            self.scheduler.add(self.beams.add(group))
            self._arrived.append(group.children[0].request_id)
            return
        self.outputs.add(group)
        if not self._lora_current(group.children[0]):  # its adapter was unloaded since it was made: end it
            self.abort_request(group.request_id, "error", error=f"the LoRA adapter "
                               f"{group.children[0].params.lora_name!r} was unloaded")
            return
        self.scheduler.add(group.children[0])  # its followers (n > 1) join once it has computed the prompt
        self._arrived.extend(c.request_id for c in group.children)  # sequence ids, as in the trace's "requests"

    def _lora_current(self, req: Request) -> bool:
        name = req.params.lora_name
        return name is None or (self.loras.slots.get(name) == req.lora_slot
                                and self.loras.salts.get(name) == req.cache_salt)

    def add_lora(self, adapter: LoRAAdapter) -> int:
        """Load ADAPTER into a free LoRA slot (between steps); returns the slot."""
        return self.loras.add(adapter, self.backend)

    def remove_lora(self, name: str) -> None:
        """Unload the adapter NAME (between steps); refused while a request runs or waits with it."""
        users = [g.request_id for g in self.outputs.groups.values() if g.children[0].params.lora_name == name]
        if users:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is in use by {len(users)} request(s); unload it "
                                      "once they finish")
        self.loras.remove(name, self.backend)

    def abort_request(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        """End a request now (its blocks are freed); its final output comes with the next step()."""
        if self.beams.has(str(request_id)):
            self.outputs.ready.append(self.beams.abort(str(request_id), reason, error))
            return
        group = self.outputs.groups.get(str(request_id))
        if group is None:
            raise UnknownRequestError(f"no running request has id {request_id!r} (finished, aborted or never added)")
        for req in group.children:
            self.scheduler.finish(req, reason, error=error)
        self.outputs.close(group.request_id)

    def abort_all(self, reason: str = "abort", error: str | None = None) -> None:
        """End every request (shutdown: "abort"); their final outputs come with the next step()."""
        for request_id in [*self.outputs.groups, *self.beams.searches]:
            self.abort_request(request_id, reason, error)

    def has_request(self, request_id: str) -> bool:
        return str(request_id) in self.outputs.groups or self.beams.has(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or bool(self.outputs.ready) or bool(self.beams.searches)

    def add_step_listener(self, fn: StepListener) -> None:
        """fn(StepRecord) after every step that ran the model (on the engine's thread)."""
        self._listeners.append(fn)

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        rec = StepRecord(self.step_count + 1)
        sched = self.scheduler.schedule()
        outputs = self.outputs.take_ready()
        if not sched.scheduled:
            self._publish_kv_events()
            return outputs
        self.step_count += 1
        rec.lap("schedule")
        scored = prompt_rows(sched.scheduled)  # prompt-logprob rows, returned after the rows to sample
        pooled = pooling_rows(sched.scheduled)  # embedding requests' hidden-state rows
        inputs, to_sample = self.runner.prepare(sched.scheduled, scored, pooled)
        rec.capture(sched.scheduled)
        rec.lap("pack")
        try:  # the masks depend on committed tokens only: computed while the backend runs (if any row has a grammar)
            self.structured.start_bitmask(to_sample)
            logits, hidden = run_step(self.backend, inputs)
            if logits.shape[0] != len(inputs.logits_indices):
                raise StepFailedError(f"backend returned {logits.shape[0]} logits rows, expected "
                                      f"{len(inputs.logits_indices)}")
            rec.lap("backend")
            bitmask = self.structured.bitmask(to_sample)  # None when no row is constrained
            num_rows = sum(1 + len(r.spec_token_ids) for r in to_sample)  # drafts: a row each
            sampled = self.sampler(logits[:num_rows], to_sample, bitmask)
            rec.lap("sample")
        except Exception as exc:  # noqa: BLE001 - any backend failure ends only this step's requests
            self.structured.discard()  # (its worker reads the matchers the failure is about to free)
            logger.exception("step %d failed; ending its %d requests with an error", rec.step, len(sched.scheduled))
            rec.error = f"{type(exc).__name__}: {exc}"
            for req in sched.scheduled:
                self.scheduler.finish(req, "error", error=rec.error)
            touched = list(sched.scheduled)
            outputs += self.beams.fail(touched, rec.error)
        else:
            # the rows of beam-search beams leave the normal commit: the beam search appends their tokens
            to_sample, token_ids, logprobs, beam_rows = self.beams.split(to_sample, sampled.token_ids,
                                                                         sampled.logprobs)
            if self.proposer is not None:
                rec.speculated(to_sample, token_ids)  # (before the commit clears the drafts)
            taken = self.scheduler.update_from_output(sched.scheduled, to_sample, token_ids)
            embedded = self._embed(sched.scheduled, pooled, hidden)
            outputs += self.beams.advance(beam_rows)
            rec.lap("commit")
            failed = self.outputs.score_prompts(scored, logits[num_rows:])
            stopped, failed_text = self.outputs.detokenize(to_sample, taken, logprobs)
            for req, stop, kept in stopped:  # (a stop string inside accepted drafts: the tokens after it go)
                self.scheduler.finish(req, "stop", stop_reason=stop, keep_tokens=kept)
            for req, error in failed + failed_text:  # only these requests end: a prompt not scored, a token not decoded
                self.scheduler.finish(req, "error", error=error)
            touched = to_sample + embedded
        outputs += self.outputs.make_outputs(touched)
        rec.lap("detokenize")
        rec.end(sched, self._arrived, self.scheduler.take_finished(), len(self.scheduler.waiting), self.block_manager)
        self._arrived = []
        notify(self._listeners, rec)
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand what the prefix cache did since the last call to the KV event publisher (one batch)."""
        if self._kv_log is not None and self._kv_log.events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self._kv_log.take())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's): only when no request holds blocks; returns whether it did."""
        done = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _embed(self, scheduled: dict[Request, int], pooled: dict[Request, tuple[int, int]],
               hidden: np.ndarray | None) -> list[Request]:
        """Pool this step's hidden-state rows; finish the embedding requests whose prompt is complete (their
        vector goes on their final output). Returns the requests it finished."""
        if not pooled and not any(req.pool is not None for req in scheduled):
            return []
        try:
            accept_rows(pooled, hidden)
            done = finished_embeddings(scheduled)
        except Exception as exc:  # noqa: BLE001 - end this step's embedding requests only
            logger.exception("pooling failed in step %d", self.step_count)
            ended = [req for req in scheduled if req.pool is not None and not req.finished]
            for req in ended:
                self.scheduler.finish(req, "error", error=f"{type(exc).__name__}: {exc}")
            return ended
        for req, vector in done:
            self.outputs.set_embedding(req, vector)
            self.scheduler.finish(req, "stop")
        return [req for req, _ in done]

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.block_manager, self.step_count,
                            self.loras.max_loras if self.loras.enabled else 0)

    def close(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
            self.kv_event_publisher = None
        if hasattr(self.proposer, "close"):  # a draft model's backend
            self.proposer.close()
        self.structured.close()
        if self._trace is not None:
            self._trace.close()
        self.backend.close()
