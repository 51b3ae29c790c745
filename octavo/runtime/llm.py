"""LLM: the offline facade (vLLM's names). `LLM(model).generate(prompts, params)` runs to completion."""
from __future__ import annotations

import dataclasses
import json

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from octavo.errors import InvalidRequestError, StepFailedError
from octavo.runtime.backends.base import Backend
from octavo.runtime.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from octavo.runtime.engine import LLMEngine
from octavo.runtime.input_processor import Prompt
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.pooling_params import PoolingParams
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.tokenizer import Tokenizer

Message = dict[str, Any]


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # the pooled vector (vLLM's EmbeddingOutput)


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool


class LLM:
    def __init__(self, model: str, *, backend_instance: Backend | None = None, **engine_args: Any) -> None:
        """engine_args: EngineArgs' fields (`backend` is its name, e.g. "onnxruntime"); backend_instance: a
        ready Backend object to run instead (tests, fault injection)."""
        if isinstance(engine_args.get("speculative_config"), Mapping):  # vLLM's LLM takes the dict
            engine_args["speculative_config"] = json.dumps(engine_args["speculative_config"])
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args), backend_instance)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, backend_instance: Backend | None = None) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args, backend_instance)
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: str | Any | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A bad prompt raises before any runs.
        priority: per prompt, lower is scheduled first (default: first come, first served). lora_request: the
        name of a loaded LoRA adapter (EngineArgs.lora_modules), or an object with `lora_name` (vLLM's LoRARequest)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a string, a dict or a list of token ids
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        # only finished outputs are returned: the engine need not build one per request per step
        finals = {id(p): dataclasses.replace(p, output_kind="final_only")  # one copy per distinct params object
                  for p in params if isinstance(p, SamplingParams)}
        params = [finals.get(id(p), p) for p in params]
        if lora_request is not None:
            name = lora_request if isinstance(lora_request, str) else getattr(lora_request, "lora_name", None)
            if not isinstance(name, str):
                raise InvalidRequestError(f"lora_request must be an adapter name or a LoRARequest, got {lora_request!r}")
            params = [dataclasses.replace(p, lora_name=name) if isinstance(p, SamplingParams) else p for p in params]
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError(f"{len(priority)} priorities for {len(prompts)} prompts")
        prios = priority or [0] * len(prompts)
        batch = uuid.uuid4().hex[:8]
        ids = [f"{batch}-{i}" for i in range(len(prompts))]
        added: list[str] = []
        try:
            for rid, prompt, p, prio in zip(ids, prompts, params, prios):
                self.engine.add_request(rid, prompt, p, priority=prio)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            self.engine.step()  # collect the aborted outputs
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, *, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             special_tokens_in_content: bool = False, tools: list[dict[str, Any]] | None = None
             ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or CHAT_TEMPLATE, sandboxed alike), then
        generate. continue_final_message: continue the last (assistant) message instead of closing it;
        chat_template_kwargs: extra template variables (vLLM's LLM.chat options). Special-token strings inside
        the messages stay plain text unless SPECIAL_TOKENS_IN_CONTENT (see Tokenizer.encode_chat). TOOLS (OpenAI's
        [{"type": "function", "function": {...}}]) reach the template as in transformers' apply_chat_template."""
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt=False")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts: list[Prompt] = [{"prompt_token_ids": tok.encode_chat(
            c, add_generation_prompt, chat_template=chat_template, continue_final_message=continue_final_message,
            special_tokens_in_content=special_tokens_in_content, **extra)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's LLM.embed), in input order: the model's pooling of its final hidden
        states (an embedding export: `octavo export --pooling`, or a sentence-transformers folder), unless
        POOLING_PARAMS asks another type, normalization or a truncation to fewer dimensions. The prompts run
        batched through the engine (runtime/pooling.py)."""
        params = SamplingParams(max_tokens=1, pooling=pooling_params or PoolingParams(), output_kind="final_only")
        results = []
        for out in self.generate(prompts, params, use_tqdm):
            if out.embedding is None:
                error = out.outputs[0].error if out.outputs else None
                raise StepFailedError(f"the embedding of request {out.request_id} failed: {error or 'no vector'}")
            results.append(EmbeddingRequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                                  EmbeddingOutput(out.embedding.tolist()), out.finished))
        return results

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's LLM.beam_search): the beam_width best hypotheses each, best first;
        a sequence's tokens are the prompt's and the generated ones, its text their decoding. The beams
        share KV blocks (runtime/beam_search.py); all prompts' searches run batched together."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        sp = SamplingParams(n=params.beam_width, use_beam_search=True, temperature=0.0, max_tokens=params.max_tokens,
                            ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
                            output_kind="final_only")
        tok = self.engine.tokenizer
        results = []
        for out in self.generate(prompts, sp, use_tqdm=use_tqdm):
            seqs = []
            for o in out.outputs:
                tokens = list(out.prompt_token_ids) + list(o.token_ids)
                seqs.append(BeamSearchSequence(tokens=tokens, cum_logprob=o.cumulative_logprob or 0.0,
                                               finish_reason=o.finish_reason or "length", text=tok.decode(tokens),
                                               num_prompt_tokens=len(out.prompt_token_ids)))
            results.append(BeamSearchOutput(sequences=seqs))
        return results

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one request, yielding its outputs as they come: cumulative ones by default, what is new since
        the previous one with output_kind="delta" (see SamplingParams.output_kind)."""
        rid = uuid.uuid4().hex[:12]
        self.engine.add_request(rid, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)
                self.engine.step()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        start = self.engine.stats().generation_tokens_total
        t0 = time.perf_counter()
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            toks = self.engine.stats().generation_tokens_total - start
                            bar.set_postfix_str(f"{toks / max(time.perf_counter() - t0, 1e-9):.1f} tok/s")
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            left = [i for i in ids if i not in done and self.engine.has_request(i)]
            for rid in left:  # interrupted (Ctrl-C, an exception): leave the engine clean
                self.engine.abort_request(rid)
            if left:
                self.engine.step()
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's; KV-event subscribers get AllBlocksCleared). False if a request
        still holds blocks (never between generate calls)."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.engine.close()
