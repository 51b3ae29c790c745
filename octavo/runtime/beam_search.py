"""Beam search over the paged KV cache (vLLM's semantics), the beams sharing blocks by reference count.

The algorithm (vLLM's `beam_search`): every live beam is an engine Request decoding greedily with the top
2 x width logprobs of its next token. When every live beam of a search has its logprobs for this step, each
(beam, candidate token) pair is a candidate with cumulative logprob = beam's + token's. A candidate ending in
EOS (unless ignore_eos) is a finished hypothesis; the others are ranked and the best `width` become the live
beams. After max_tokens steps (or when no beam is left) the finished hypotheses and the live beams are
ranked by `beam_score` (cumulative logprob / length ** length_penalty, the length counting the prompt and
not a final EOS) and the best `width` are the result.

Memory: a new beam is a child Request FORKED from its parent — it takes the parent's block table by
reference (every block's refcount goes up), so the prompt and every common prefix stay in one copy however
many beams read them. Only a block that is still being filled (the last, partial one) would be written by
two beams at once, so a second child of the same parent gets its own copy of that one block (copy on
write, through the backend's `copy_blocks`); the first child simply inherits the parent's. Beams that are
dropped release their references; a block is freed when no beam reads it any more.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from octavo.errors import InvalidRequestError
from octavo.runtime.outputs import CompletionOutput, RequestOutput
from octavo.runtime.request import Request, RequestStatus

MAX_BEAM_WIDTH = 64


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. temperature is accepted for compatibility: beams are ranked by the
    log-softmax of the model's logits, which a temperature would only rescale per step."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width must be an integer between 1 and {MAX_BEAM_WIDTH}, "
                                      f"got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis. tokens: prompt + generated (vLLM's layout); text: the generated text (no final EOS)."""

    tokens: list[int]
    cum_logprob: float
    finish_reason: str  # "stop" (ended in EOS) or "length"
    text: str = ""
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(num_tokens: int, cum_logprob: float, ends_in_eos: bool, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: cumulative logprob / length ** length_penalty, where the length counts
    the prompt and not a final EOS."""
    length = num_tokens - 1 if ends_in_eos else num_tokens
    return cum_logprob / (max(length, 1) ** length_penalty)


@dataclass(slots=True)
class Candidate:
    parent: Request
    token: int
    cum_logprob: float


@dataclass(slots=True)
class BeamSearch:
    """The state of one search inside the engine: live beams (Requests), their scores, finished hypotheses."""

    params: BeamSearchParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    live: list[Request] = field(default_factory=list)
    cum_logprob: dict[Request, float] = field(default_factory=dict)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    reported: dict[Request, dict[int, float]] = field(default_factory=dict)
    steps: int = 0

    def report(self, req: Request, logprobs: dict[int, float]) -> bool:
        """A live beam's next-token logprobs of this step; True once every live beam has reported."""
        self.reported[req] = logprobs
        return len(self.reported) == len(self.live)

    def choose(self) -> list[Candidate]:
        """This step's new beams (best first); finished hypotheses are recorded on the way. Call once every
        live beam has reported."""
        p = self.params
        candidates: list[Candidate] = []
        for req in self.live:  # deterministic order: beam rank, then logprob, then token id
            base = self.cum_logprob[req]
            for tok, lp in sorted(self.reported[req].items(), key=lambda kv: (-kv[1], kv[0])):
                if not math.isfinite(lp):
                    continue  # masked (logit bias, min_tokens): never a candidate
                cand = Candidate(req, tok, base + lp)
                if tok in self.eos_token_ids and not p.ignore_eos:
                    self.finished.append(self._sequence(req, tok, cand.cum_logprob, "stop"))
                else:
                    candidates.append(cand)
        self.reported.clear()
        self.steps += 1
        candidates.sort(key=lambda c: -c.cum_logprob)  # stable: ties keep beam and token order
        return candidates[:p.beam_width]

    def done(self, chosen: list[Candidate]) -> bool:
        """Is the search over once CHOSEN became the beams (max_tokens steps, or nothing left to extend)?"""
        return self.steps >= self.params.max_tokens or not chosen

    def result(self, chosen: list[Candidate], decode: Callable[[list[int]], str]) -> list[BeamSearchSequence]:
        """The best beam_width hypotheses among the finished ones and the last chosen beams, best first."""
        pool = self.finished + [self._sequence(c.parent, c.token, c.cum_logprob, "length") for c in chosen]
        pool.sort(key=lambda s: -beam_score(len(s.tokens), s.cum_logprob, s.finish_reason == "stop",
                                            self.params.length_penalty))
        best = pool[:self.params.beam_width]
        for s in best:
            out = s.output_token_ids
            s.text = decode(out[:-1] if s.finish_reason == "stop" else out)
        return best

    def _sequence(self, req: Request, token: int | None, cum: float, reason: str) -> BeamSearchSequence:
        out = list(req.output_token_ids) + ([token] if token is not None else [])
        return BeamSearchSequence(tokens=list(self.prompt_token_ids) + out, cum_logprob=cum, finish_reason=reason,
                                  num_prompt_tokens=len(self.prompt_token_ids))


# ---------------------------------------------------------------------------------------------------
# the engine side: beams are Requests in the scheduler, forked on the block tables


class BeamSearchManager:
    """The engine's running beam searches. Every step, the rows of beam Requests are taken out of the normal
    commit (`split`); once a search has the logprobs of all its live beams, it advances (`advance`): the
    beams that have no candidate left are finished (their blocks released), each surviving beam continues
    with its best candidate and forks a child per further one (blocks shared, the partial last block copied).
    A finished search becomes one RequestOutput with its n best hypotheses."""

    def __init__(self, scheduler: Any, block_manager: Any, backend: Any, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.copy_blocks: Callable[[list[tuple[int, int]]], None] | None = getattr(backend, "copy_blocks", None)
        self.backend_name = type(backend).__name__.removesuffix("Backend").lower() or "this"
        self.tokenizer = tokenizer
        self.searches: dict[str, _Search] = {}  # user request id -> its search
        self._of: dict[Request, _Search] = {}  # live beam -> its search

    # -- lifecycle --------------------------------------------------------------------------------------
    @property
    def refusal(self) -> str | None:
        """Why this engine cannot run beam search (the input processor refuses such requests), or None."""
        if self.copy_blocks is None:
            return ("beam search needs a backend that can copy KV blocks (copy-on-write of the beams' partial last "
                    f"block); the {self.backend_name} backend cannot: use backend='onnxruntime'")
        return None

    def check_supported(self) -> None:
        if self.refusal is not None:
            raise InvalidRequestError(self.refusal)

    def add(self, group: Any) -> Request:
        """Take over GROUP (made by the input processor, SamplingParams.use_beam_search): its first child
        becomes the first beam, its other children are dropped. Returns that beam, for the waiting queue."""
        self.check_supported()
        first = group.children[0]
        sp = first.params
        params = BeamSearchParams(beam_width=sp.beam_width, max_tokens=first.max_tokens, ignore_eos=sp.ignore_eos,
                                  length_penalty=sp.length_penalty)
        first.followers = []  # the other n - 1 children never run: beams are forked instead
        # top 2 x width candidates per beam (vLLM's choice); set past SamplingParams' user-facing cap of 20
        first.params.logprobs = min(2 * params.beam_width, self.tokenizer.vocab_size)
        search = _Search(group, BeamSearch(params, first.prompt_token_ids, tuple(self.tokenizer.eos_token_ids)))
        search.beams.live = [first]
        search.beams.cum_logprob[first] = 0.0
        self.searches[group.request_id] = search
        self._of[first] = search
        return first

    def has(self, request_id: str) -> bool:
        return request_id in self.searches

    def is_beam(self, req: Request) -> bool:
        return req in self._of

    # -- a step -----------------------------------------------------------------------------------------
    def split(self, sampled: list[Request], token_ids: list[list[int]], logprobs: list[list[dict[int, float]] | None]
              ) -> tuple[list[Request], list[list[int]], list[list[dict[int, float]] | None],
                         list[tuple[Request, dict]]]:
        """The step's sampled rows without those of beams (for the normal commit), and the beams' rows."""
        if not self._of:
            return sampled, token_ids, logprobs, []
        keep_r, keep_t, keep_l, beams = [], [], [], []
        for req, tok, lp in zip(sampled, token_ids, logprobs):
            if req in self._of:  # (a beam never has drafts: one token and one logprobs entry)
                beams.append((req, lp[0] if lp else {}))
            else:
                keep_r.append(req)
                keep_t.append(tok)
                keep_l.append(lp)
        return keep_r, keep_t, keep_l, beams

    def advance(self, rows: list[tuple[Request, dict[int, float]]]) -> list[RequestOutput]:
        """Hand the beams their logprobs; advance every search that has them all. Returns finished outputs."""
        ready: dict[str, _Search] = {}
        for req, lp in rows:
            search = self._of[req]
            if search.beams.report(req, lp):
                ready[search.group.request_id] = search
        outs = []
        now = time.time()
        for search in ready.values():
            chosen = search.beams.choose()
            search.first_token_time = search.first_token_time or now
            search.last_token_time = now
            if search.beams.done(chosen):
                outs.append(self._finish(search, chosen))
            else:
                self._fork(search, chosen)
        return outs

    def _fork(self, search: _Search, chosen: list[Candidate]) -> None:
        """Make CHOSEN the live beams: each parent's first candidate continues the parent itself, each further
        one is a child forked from the parent; parents without a candidate are finished first, so their
        blocks are free for the copies."""
        by_parent: dict[Request, list[Candidate]] = {}
        for c in chosen:
            by_parent.setdefault(c.parent, []).append(c)
        for parent in search.beams.live:
            if parent not in by_parent:
                self._drop(parent)
        live, copies = [], []
        for parent, cands in by_parent.items():
            for c in cands[1:]:  # children first: they fork the parent's state before it takes its own token
                child = self._child(search, parent)
                pair = self.block_manager.fork(parent, child, copy_partial=True)
                if pair is not None:
                    copies.append(pair)
                self._extend(search, child, c, live)
            self._extend(search, parent, cands[0], live)
        if copies:
            self.copy_blocks(copies)
        search.beams.live = live

    def _child(self, search: _Search, parent: Request) -> Request:
        search.forks += 1
        child = dataclasses.replace(
            parent, request_id=f"{search.group.request_id}#beam{search.forks}", status=RequestStatus.RUNNING,
            output_token_ids=list(parent.output_token_ids), block_table=[], block_hashes=[], num_computed_tokens=0,
            num_registered_blocks=0, num_promised_blocks=0, followers=[], spec_token_ids=[],
            metrics=dataclasses.replace(parent.metrics))
        self.scheduler.adopt(child)  # it holds blocks: a running request (docs/architecture.md)
        self._of[child] = search
        return child

    def _extend(self, search: _Search, req: Request, c: Candidate, live: list[Request]) -> None:
        # beams get their tokens from the search, not from a stop rule: appended through the scheduler's one
        # writer of output tokens, without its token stops
        self.scheduler.append_output(req, [c.token], stops=False)
        search.beams.cum_logprob[req] = c.cum_logprob
        live.append(req)

    def _drop(self, req: Request, reason: str = "pruned") -> None:
        self._of.pop(req, None)
        if not req.finished:
            self.scheduler.finish(req, reason)

    def _finish(self, search: _Search, chosen: list[Candidate]) -> RequestOutput:
        p = search.group.children[0].params
        best = search.beams.result(
            chosen, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens))
        for req in search.beams.live:
            self._drop(req, "stop")
        del self.searches[search.group.request_id]
        outputs = [CompletionOutput(index=i, text=s.text, token_ids=s.output_token_ids, finish_reason=s.finish_reason,
                                    cumulative_logprob=s.cum_logprob) for i, s in enumerate(best[:p.n])]
        return self._output(search, outputs, finished=True)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput:
        """End a search now (all its beams' blocks freed); its output: no text, the reason."""
        search = self.searches.pop(request_id)
        for req in search.beams.live:
            self._of.pop(req, None)
            if not req.finished:
                self.scheduler.finish(req, reason, error=error)
        n = search.group.children[0].params.n
        return self._output(search, [CompletionOutput(index=i, text="", token_ids=[], finish_reason=reason,
                                                      error=error) for i in range(n)], finished=True)

    def fail(self, reqs: list[Request], error: str) -> list[RequestOutput]:
        """A step failed: the searches with a beam among REQS end with finish_reason "error"."""
        ids = {self._of[r].group.request_id for r in reqs if r in self._of}
        return [self.abort(i, "error", error) for i in ids]

    def _output(self, search: _Search, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        g, first = search.group, search.group.children[0]
        metrics = dataclasses.replace(first.metrics, first_token_time=search.first_token_time,
                                      last_token_time=search.last_token_time, finished_time=time.time())
        return RequestOutput(request_id=g.request_id, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
                             outputs=outputs, finished=finished, metrics=metrics,
                             num_cached_tokens=first.metrics.num_cached_tokens)


@dataclass(slots=True)
class _Search:
    group: Any  # the RequestGroup the input processor made
    beams: BeamSearch
    forks: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
