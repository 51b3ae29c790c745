"""OutputProcessor: the one owner of what a user sees of a request — its detokenizers and what was emitted.

The engine's native output is a DELTA: per step, for each child of a request with something new, the token
ids, text and logprobs added since the previous output, and the finish reason once (vLLM's
RequestOutputKind.DELTA). Nothing is copied that is not new, so a step's output cost does not grow with
the output's length. `SamplingParams.output_kind` picks what a request gets:
- "delta": those deltas (the server, Triton);
- "cumulative": everything so far after every step that sampled for it (copies: O(length) per step);
- "final_only": one output, finished, with everything (LLM.generate).

Stop strings are properties of the text, so they are found here (`detokenize`), and the engine then asks
the scheduler to finish those requests. A request group is dropped once its final output is made.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from octavo.runtime.detokenizer import IncrementalDetokenizer
from octavo.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from octavo.runtime.prompt_logprobs import logprob_dicts, reduce_logprob_rows
from octavo.runtime.request import Request
from octavo.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestGroup:
    """One user request: n children sharing one prompt, and, per child, what has been emitted so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float
    output_kind: str
    detokenizers: list[IncrementalDetokenizer]
    sent_tokens: list[int] = field(default_factory=list)  # per child: output tokens already emitted
    sent_chars: list[int] = field(default_factory=list)  # per child: text characters already emitted
    sent_final: list[bool] = field(default_factory=list)  # per child: its finish reason was emitted
    # per child: logprob entries not emitted yet ("delta") or all of them (other kinds); None if not asked
    logprobs: list[list[dict[int, Logprob]]] | None = None
    # SamplingParams.prompt_logprobs: None first, then one entry per scored prompt token (child 0 scores them)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False
    embedding: np.ndarray | None = None  # an embedding request's vector, once pooled (runtime/pooling.py)

    def __post_init__(self) -> None:
        n = len(self.children)
        self.sent_tokens, self.sent_chars, self.sent_final = [0] * n, [0] * n, [False] * n
        if self.children[0].params.logprobs is not None:
            self.logprobs = [[] for _ in range(n)]
        if self.children[0].params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def prompt_scored(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}  # live user requests
        self.ready: list[RequestOutput] = []  # final outputs made between steps (aborts): the next step returns them

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group

    def detokenize(self, sampled: list[Request], counts: list[int], logprobs: list[list[dict[int, float]] | None]
                   ) -> tuple[list[tuple[Request, str, int]], list[tuple[Request, str]]]:
        """Feed each sampled request's new tokens (its last COUNTS[i] output tokens, committed by the scheduler:
        one, or a run of accepted drafts) to its detokenizer, one by one. Returns (requests whose text hit a
        stop string, with it and how many output tokens to keep: up to the token that completed it; requests
        that failed, with the error)."""
        stopped, failed = [], []
        for req, count, lps in zip(sampled, counts, logprobs):
            group = self.groups[req.parent_id]
            first = req.num_output_tokens - count
            for at in range(first, req.num_output_tokens):
                try:
                    lp = lps[at - first] if lps is not None else None
                    if lp is not None and group.logprobs is not None:
                        group.logprobs[req.index].append(
                            {t: Logprob(t, v, self._decode_one(t)) for t, v in lp.items()})
                    stop = self._add_token(req, at, group.detokenizers[req.index], self.tokenizer.eos_token_ids)
                except Exception as exc:  # noqa: BLE001 - e.g. a token the tokenizer cannot decode: end only this one
                    logger.exception("request %s failed after sampling token %d", req.request_id,
                                     req.output_token_ids[at])
                    failed.append((req, f"{type(exc).__name__}: {exc}"))
                    break
                if stop is not None:
                    stopped.append((req, stop, at + 1))
                    break
        return stopped, failed

    def score_prompts(self, rows: dict[Request, tuple[int, int]], logits: np.ndarray) -> list[tuple[Request, str]]:
        """Reduce this step's prompt-logprob rows (LOGITS, in the order of ROWS: per request, COUNT rows from
        position FIRST) into the requests' prompt logprobs. Returns the requests that failed, with the error."""
        failed, at = [], 0
        for req, (first, count) in rows.items():
            chunk, at = logits[at:at + count], at + count
            group = self.groups.get(req.parent_id)
            if group is None or group.prompt_logprobs is None:  # (it may have finished in this step: still scored)
                continue
            try:
                if first != req.prompt_logprobs_next:  # positions are scored once, in order
                    raise RuntimeError(f"prompt logprobs of {req.request_id}: rows from position {first}, "
                                       f"expected {req.prompt_logprobs_next}")
                reduced = reduce_logprob_rows(chunk, req.prompt_token_ids[first + 1:first + 1 + count],
                                              req.params.prompt_logprobs or 0)
                group.prompt_logprobs.extend(logprob_dicts(reduced, self._decode_one))
                req.prompt_logprobs_next = first + count
            except Exception as exc:  # noqa: BLE001 - end only this request
                logger.exception("prompt logprobs of %s failed", req.request_id)
                failed.append((req, f"{type(exc).__name__}: {exc}"))
        return failed

    def set_embedding(self, req: Request, vector: np.ndarray) -> None:
        """REQ's pooled vector, reported on its final output."""
        group = self.groups.get(req.parent_id)
        if group is not None:
            group.embedding = vector

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def _add_token(req: Request, at: int, detok: IncrementalDetokenizer, eos_token_ids: list[int]) -> str | None:
        tok, p, last = req.output_token_ids[at], req.params, at == req.num_output_tokens - 1
        # ended by this (last) token as a stop token or EOS: EOS is never text, a stop token only if asked (a
        # request whose grammar this token completed ended "stop" too, and the token is text)
        if last and req.finish_reason == "stop" and (req.stop_reason == tok or tok in eos_token_ids):
            if req.stop_reason is not None and p.include_stop_str_in_output:
                detok.add(tok)
            return None
        return detok.add(tok, check_stop=at + 1 >= p.min_tokens)

    def make_outputs(self, reqs: Iterable[Request]) -> list[RequestOutput]:
        """The outputs of the requests of REQS (those a step touched); finished groups are dropped."""
        groups = {r.parent_id: self.groups[r.parent_id] for r in reqs if r.parent_id in self.groups}
        outs = []
        for group in groups.values():
            out = self._output(group)
            if out is not None:
                outs.append(out)
            if group.finished:
                del self.groups[group.request_id]
        return outs

    def close(self, request_id: str) -> None:
        """The group has just been ended (aborted): queue its final output for the next step."""
        group = self.groups.pop(request_id)
        out = self._output(group)
        if out is not None:
            self.ready.append(out)

    def take_ready(self) -> list[RequestOutput]:
        ready, self.ready = self.ready, []
        return ready

    def end_all(self, error: str, more: Iterable[RequestGroup] = ()) -> list[RequestOutput]:
        """After an engine failure, without touching its requests: the final output of every group (the
        live ones and MORE, never added), unfinished children reported with finish_reason "error" and
        ERROR; outputs made before (aborts) come first."""
        outs = self.take_ready()
        for group in [*self.groups.values(), *more]:
            out = self._output(group, error)
            if out is not None:
                outs.append(out)
        self.groups.clear()
        return outs

    # -- one output -------------------------------------------------------------------------------------
    def _output(self, group: RequestGroup, end_error: str | None = None) -> RequestOutput | None:
        finished = end_error is not None or group.finished
        if group.output_kind == "final_only" and not finished:
            return None
        comps = []
        for c in group.children:
            comp = self._completion(group, c, end_error)
            if comp is not None:
                comps.append(comp)
        if not comps and not finished:
            return None
        prompt_lps = None  # once the whole prompt is scored: in every output, or the first one only ("delta")
        if group.prompt_scored() and not (group.output_kind == "delta" and group.sent_prompt_logprobs):
            prompt_lps, group.sent_prompt_logprobs = group.prompt_logprobs, True
        return RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             outputs=comps, finished=finished, metrics=_merged_metrics(group, finished),
                             num_cached_tokens=group.children[0].metrics.num_cached_tokens,
                             prompt_logprobs=prompt_lps, embedding=group.embedding if finished else None)

    def _completion(self, group: RequestGroup, c: Request, end_error: str | None) -> CompletionOutput | None:
        i, detok = c.index, group.detokenizers[c.index]
        done = c.finished or end_error is not None
        if done:
            try:
                detok.flush()
            except Exception:  # noqa: BLE001 - the output must still be made
                logger.exception("detokenizer flush failed for %s", c.request_id)
        reason, stop_reason, error = c.finish_reason, c.stop_reason, c.error
        if not c.finished and done:
            reason, stop_reason, error = "error", None, end_error
        visible = detok.visible_length(done)
        lps = group.logprobs[i] if group.logprobs is not None else None
        if group.output_kind != "delta":
            return CompletionOutput(index=i, text=detok.slice(0, visible), token_ids=list(c.output_token_ids),
                                    finish_reason=reason, stop_reason=stop_reason,
                                    logprobs=list(lps) if lps is not None else None, error=error)
        new_ids = c.output_token_ids[group.sent_tokens[i]:]
        text = detok.slice(group.sent_chars[i], visible)  # only the new text: no copy of what was sent
        newly_done = done and not group.sent_final[i]
        if not new_ids and not text and not newly_done:
            return None
        group.sent_tokens[i] = len(c.output_token_ids)
        group.sent_chars[i] = max(group.sent_chars[i], visible)
        group.sent_final[i] = done
        if lps is not None:
            group.logprobs[i] = []  # type: ignore[index]
        return CompletionOutput(index=i, text=text, token_ids=new_ids, finish_reason=reason if done else None,
                                stop_reason=stop_reason if done else None, logprobs=lps, error=error if done else None)


def _merged_metrics(group: RequestGroup, finished: bool) -> RequestMetrics:
    ms = [c.metrics for c in group.children]

    def earliest(vals: list[float | None]) -> float | None:
        present = [v for v in vals if v is not None]
        return min(present) if present else None

    return RequestMetrics(
        arrival_time=group.arrival_time,
        first_scheduled_time=earliest([m.first_scheduled_time for m in ms]),
        first_token_time=earliest([m.first_token_time for m in ms]),
        last_token_time=max((m.last_token_time for m in ms if m.last_token_time is not None), default=None),
        finished_time=max(m.finished_time or 0.0 for m in ms) if finished else None,
        num_cached_tokens=ms[0].num_cached_tokens,
        num_preemptions=sum(m.num_preemptions for m in ms),
    )
