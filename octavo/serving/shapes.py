"""How the generation routes render a Generation's updates: Shape and its two kinds, CompletionShape
(/v1/completions) and ChatShape (/v1/chat/completions), each as a whole response (`whole`) and as SSE chunks
(`first_chunks`, `chunk`, `usage_chunk`), in OpenAI's JSON with vLLM's extensions (echo, logprobs, prompt
logprobs, token ids, continuous usage, per-request metrics, tool-call deltas). The JSON pieces come from
serving/responses.py; serving/routes.py drives a Shape over a request's updates.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from octavo.runtime.outputs import Logprob
from octavo.serving import responses as R
from octavo.serving.generation import ChoiceUpdate, Generation
from octavo.serving.protocol import ChatRequest, CompletionRequest
from octavo.serving.state import ServerState
from octavo.serving.reasoning_output import ChatReasoning, with_reasoning
from octavo.serving.tool_output import ToolStream, tool_message, whole_message


class Shape:
    """How a route renders a Generation's updates, as a whole response and as SSE chunks (shared parts)."""

    envelope: Any  # R.completion | R.chat: (rid, created, model, choices, usage, *, chunk, with_usage_field)

    def __init__(self, st: ServerState, req: Any, gen: Generation, rid: str) -> None:
        self.st, self.req, self.gen, self.rid = st, req, gen, rid
        self.created = int(time.time())
        self.model_name = req.params.lora_name or st.model_name  # a LoRA adapter answers under its own name
        self.opts = req.options
        self.streamed_tokens = 0  # completion tokens the stream has carried so far (continuous usage)
        self.prompt_ids_sent: set[int] = set()  # choices whose chunk carried prompt_token_ids

    @property
    def _top_k(self) -> int | None:
        """Top logprobs shown per generated token; None: every entry the engine returned (logprob_token_ids)."""
        if self.req.params.logprob_token_ids is not None:
            return None
        return self.req.logprobs if isinstance(self.req, CompletionRequest) else self.req.top_logprobs

    @property
    def _with_metrics(self) -> bool:
        return self.opts.include_metrics or self.st.config.per_request_metrics

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        use = None
        if self.opts.continuous_usage:  # usage so far on every chunk (vLLM's continuous_usage_stats)
            use = R.usage(self.gen.prompt_tokens, self.streamed_tokens, self.gen.cached_tokens)
        return self.envelope(self.rid, self.created, self.model_name, choices, use, chunk=True,
                             with_usage_field=self.req.include_usage)

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.req.include_usage:
            return None
        out = self.envelope(self.rid, self.created, self.model_name, [], self._usage(), chunk=True,
                            with_usage_field=True)
        if self._with_metrics:  # as vLLM: the metrics of a stream ride on its final usage chunk
            out["metrics"] = self.gen.timing()
        return out

    def _usage(self) -> dict[str, Any]:
        return R.usage(self.gen.prompt_tokens, self.gen.completion_tokens, self.gen.cached_tokens)

    def _response(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.envelope(self.rid, self.created, self.model_name, choices, self._usage())
        if self._with_metrics:
            out["metrics"] = self.gen.timing()
        return out

    def _counted(self, u: ChoiceUpdate) -> None:
        self.streamed_tokens += len(u.token_ids)

    def _wants_chunk(self, u: ChoiceUpdate, logprobs_on: bool) -> bool:
        """An update without text still gets a chunk when it ends the choice or carries tokens the client asked
        to see (their logprobs, or their ids)."""
        return bool(u.text or u.finish_reason is not None
                    or (u.token_ids and (logprobs_on or self.opts.return_token_ids)))

    def first_chunks(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def chunk(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        raise NotImplementedError

    def whole(self, texts: dict[int, list[str]], updates: dict[int, list[ChoiceUpdate]],
              reasons: dict[int, str | None]) -> dict[str, Any]:
        """The non-streamed response: every choice's text, finish reason, token ids and logprob entries."""
        choices = []
        for i in range(self.gen.num_choices):
            ids, entries = self._joined(updates.get(i, []))
            choices.append(self._whole_choice(i, "".join(texts.get(i, [])), reasons.get(i), ids, entries))
        return self._response(choices)

    def _whole_choice(self, i: int, text: str, reason: str | None, ids: list[int],
                      entries: list[dict[int, Logprob]]) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _joined(updates: list[ChoiceUpdate]) -> tuple[list[int], list[dict[int, Logprob]]]:
        """One choice's token ids and logprob entries over all its updates."""
        return [t for u in updates for t in u.token_ids], [e for u in updates for e in (u.logprobs or [])]


class CompletionShape(Shape):
    """/v1/completions. With prompt logprobs asked for (echo + logprobs, or vLLM's prompt_logprobs) the echo goes
    out with each choice's first chunk, once the engine has scored the prompt; otherwise before any token.
    Score only (echo, max_tokens 0): the one token the engine sampled is not shown nor counted."""

    envelope = staticmethod(R.completion)
    req: CompletionRequest

    def __init__(self, st: ServerState, req: CompletionRequest, gen: Generation, rid: str) -> None:
        super().__init__(st, req, gen, rid)
        self.offsets: dict[int, int] = {}
        self.started: set[int] = set()  # choices whose first chunk went out (lazy echo)
        self.lazy_echo = req.params.prompt_logprobs is not None

    def _usage(self) -> dict[str, Any]:
        completion = 0 if self.req.score_only else self.gen.completion_tokens
        return R.usage(self.gen.prompt_tokens, completion, self.gen.cached_tokens)

    def _logprobs(self, index: int, ids: list[int], entries: list[dict[int, Logprob]] | None) -> dict[str, Any] | None:
        if self.req.logprobs is None or entries is None:
            return None
        off = self.offsets.get(index, 0)
        lp = R.completion_logprobs(entries, ids, self._top_k, _decoder(self.st), off,
                                   as_ids=self.opts.tokens_as_ids)
        self.offsets[index] = off + R.text_length(entries, ids, _decoder(self.st))
        return lp

    def _prompt_part(self, index: int) -> tuple[dict[str, Any] | None, list[dict[str, Any] | None] | None]:
        """(legacy logprobs of the echoed prompt, vLLM's prompt_logprobs) of choice INDEX, as far as asked for."""
        scores = self.gen.prompt_scores(index) if self.lazy_echo else None
        if scores is None:
            return None, None
        ids, entries = scores
        legacy = None
        if self.req.echo and self.req.logprobs is not None:
            # a token-id prompt is echoed with its special tokens: its first token's text counts them too
            keep = not isinstance(self.req.prompts[index // self.req.params.n], str)
            legacy, self.offsets[index] = R.echo_logprobs(ids, entries, self.req.logprobs, _decoder(self.st, keep),
                                                          as_ids=self.opts.tokens_as_ids)
        vllm = None
        if self.req.prompt_logprobs is not None:
            vllm = R.prompt_logprobs_json(ids, entries, self.req.prompt_logprobs)
        return legacy, vllm

    def _echo(self, index: int) -> str:
        """The prompt as sent, or the text of its token ids with their special tokens (so that the echo and the
        prompt tokens' text_offset agree; a truncated prompt is echoed as the tokens that were kept)."""
        if not self.req.echo:
            return ""
        p = self.req.prompts[index // self.req.params.n]
        return p if isinstance(p, str) else self.st.tokenizer.decode(p, skip_special_tokens=False)

    def _stream_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None,
                       token_ids: list[int], prompt_logprobs: list[dict[str, Any] | None] | None = None
                       ) -> dict[str, Any]:
        """A chunk's choice; with return_token_ids its new token ids, and its prompt's ids the first time
        they are known."""
        choice = R.completion_choice(index, text, finish_reason, logprobs, prompt_logprobs)
        if self.opts.return_token_ids:
            ids = self.gen.prompt_token_ids(index)
            if ids is not None and index not in self.prompt_ids_sent:
                choice["prompt_token_ids"] = ids
                self.prompt_ids_sent.add(index)
            choice["token_ids"] = token_ids
        return choice

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.req.echo or self.lazy_echo:
            return []
        return [self._chunk([self._stream_choice(i, self._echo(i), None, None, [])])
                for i in range(self.gen.num_choices)]

    def chunk(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        if self.req.score_only:
            u = replace(u, text="", token_ids=[], logprobs=[] if u.logprobs is not None else None)
        self._counted(u)
        first = self.lazy_echo and u.index not in self.started
        self.started.add(u.index)
        if not first and not self._wants_chunk(u, self.req.logprobs is not None):
            return None
        legacy, prompt_lp = self._prompt_part(u.index) if first else (None, None)
        lp = self._logprobs(u.index, u.token_ids, u.logprobs)
        if legacy is not None:
            lp = R.joined_logprobs(legacy, lp) if lp is not None else legacy
        text = (self._echo(u.index) if first else "") + u.text
        return self._chunk([self._stream_choice(u.index, text, u.finish_reason, lp, u.token_ids, prompt_lp)])

    def _whole_choice(self, i: int, text: str, reason: str | None, ids: list[int],
                      entries: list[dict[int, Logprob]]) -> dict[str, Any]:
        if self.req.score_only:
            ids, entries, text = [], [], ""
        legacy, prompt_lp = self._prompt_part(i)
        lp = self._logprobs(i, ids, entries)
        if legacy is not None:
            lp = R.joined_logprobs(legacy, lp) if lp is not None else legacy
        choice = R.completion_choice(i, self._echo(i) + text, reason, lp, prompt_lp)
        choice.setdefault("prompt_logprobs", None)  # vLLM always sends the key in a whole response
        if self.opts.return_token_ids:
            choice["prompt_token_ids"] = self.gen.prompt_token_ids(i)
            choice["token_ids"] = ids
        return choice


class ChatShape(Shape):
    """/v1/chat/completions."""

    envelope = staticmethod(R.chat)
    req: ChatRequest

    def __init__(self, st: ServerState, req: ChatRequest, gen: Generation, rid: str, *,
                 answering: bool = False) -> None:
        super().__init__(st, req, gen, rid)
        self.tool_streams: dict[int, ToolStream] = {}  # per choice, when tool calls are read from the text
        # with a reasoning parser: each choice's thinking apart from its answer (ANSWERING: the prompt closed it)
        self.reasoning = None if st.reasoning is None or st.token_pieces is None else ChatReasoning(
            st.reasoning, st.token_pieces, answering, st.reasoning.thinking_disabled(req.chat.chat_template_kwargs))

    def _usage(self) -> dict[str, Any]:
        use = super()._usage()
        if self.reasoning is not None:
            use["completion_tokens_details"] = {"reasoning_tokens": self.reasoning.reasoning_tokens}
        return use

    def _tool_stream(self, index: int) -> ToolStream:
        ts = self.tool_streams.get(index)
        if ts is None:
            ts = self.tool_streams[index] = ToolStream(self.req.tool_choice, self.st.config.tool_call_parser,
                                                       self.req.parallel_tool_calls, self.req.tools)
        return ts

    def _logprobs(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        if not self.req.logprobs or u.logprobs is None:
            return None
        return R.chat_logprobs(u.logprobs, u.token_ids, self._top_k, _decoder(self.st),
                               as_ids=self.opts.tokens_as_ids)

    def _messages(self, index: int) -> list[dict[str, Any]]:
        """The conversation choice INDEX answers."""
        return self.req.messages

    def _echo(self, index: int) -> str:
        """With echo, the reply starts with the last message's content when that message is the assistant's
        (vLLM's rule: the echoed message must have the role of the reply)."""
        last = self._messages(index)[-1]
        return last["content"] if self.req.chat.echo and last["role"] == "assistant" else ""

    def first_chunks(self) -> list[dict[str, Any]]:
        out = []
        for i in range(self.gen.num_choices):
            chunk = self._chunk([R.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)])
            if self.opts.return_token_ids:
                chunk["prompt_token_ids"] = self.gen.prompt_token_ids(i)
            out.append(chunk)
        out += [self._chunk([R.chat_chunk_choice(i, {"content": self._echo(i)}, None)])
                for i in range(self.gen.num_choices) if self._echo(i)]
        return out

    def chunk(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        self._counted(u)
        if not self._wants_chunk(u, self.req.logprobs):
            return None
        text, thought = u.text, ""
        if self.reasoning is not None:  # the thinking goes out as reasoning deltas, the answer as content
            thought, text = self.reasoning.choice(u.index).feed(u.text, u.token_ids, u.finish_reason is not None)
        ts = self._tool_stream(u.index)
        delta, reason = self._tool_delta(ts, text, u.finish_reason) if ts.active else (
            {"content": text} if text else {}, u.finish_reason)
        if thought and self.req.include_reasoning:
            delta = with_reasoning({}, thought) | delta
        if not delta and reason is None and not (u.token_ids and (self.req.logprobs or self.opts.return_token_ids)):
            return None  # text held back (a call being assembled, a tail that may be a thinking marker)
        choice = R.chat_chunk_choice(u.index, delta, reason, self._logprobs(u))
        if self.opts.return_token_ids:
            choice["token_ids"] = u.token_ids
        return self._chunk([choice])

    @staticmethod
    def _tool_delta(ts: ToolStream, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A choice whose text may be tool calls: its content / tool-call deltas merged into one delta."""
        deltas = ts.feed(text)
        if reason is not None:
            last, reason = ts.finish(reason)
            deltas += last
        delta: dict[str, Any] = {}
        for d in deltas:  # content pieces concatenate; tool-call items list in order
            if "content" in d:
                delta["content"] = delta.get("content", "") + d["content"]
            for item in d.get("tool_calls", ()):
                delta.setdefault("tool_calls", []).append(item)
        return delta, reason

    def _whole_choice(self, i: int, text: str, reason: str | None, ids: list[int],
                      entries: list[dict[int, Logprob]]) -> dict[str, Any]:
        lp = None
        if self.req.logprobs:
            lp = R.chat_logprobs(entries, ids, self._top_k, _decoder(self.st),
                                 as_ids=self.opts.tokens_as_ids)
        thought: str | None = None
        answer: str | None = text
        if self.reasoning is not None:  # the thinking apart; content, tool calls: the answer only
            thought, answer = self.reasoning.whole(i, text, ids)
        echo = self._echo(i)
        answer = echo + answer if answer is not None else (echo or None)
        choice = R.chat_choice(i, answer, reason, lp)
        if self.req.tools is not None and self.req.tool_choice.mode != "none" and answer is not None:
            m = whole_message(self.req.tool_choice, self.st.config.tool_call_parser, answer, reason,
                              self.req.parallel_tool_calls, self.req.tools)
            choice["message"] = tool_message(m.content, m.tool_calls)
            choice["finish_reason"] = m.finish_reason
        if self.reasoning is not None:
            with_reasoning(choice["message"], thought if self.req.include_reasoning else None)
        if self.opts.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def whole(self, texts: dict[int, list[str]], updates: dict[int, list[ChoiceUpdate]],
              reasons: dict[int, str | None]) -> dict[str, Any]:
        out = super().whole(texts, updates, reasons)
        out["prompt_logprobs"] = None  # vLLM's field: always present, the templated prompt's logprobs when asked
        scores = self.gen.prompt_scores(0) if self.req.prompt_logprobs is not None else None
        if scores is not None:
            out["prompt_logprobs"] = R.prompt_logprobs_json(*scores, self.req.prompt_logprobs)
        if self.opts.return_token_ids:
            out["prompt_token_ids"] = self.gen.prompt_token_ids(0)
        return out


class BatchChatShape(ChatShape):
    """/v1/chat/completions/batch (vLLM's): one choice per conversation, index = its position; no stream."""

    def __init__(self, st: ServerState, req: ChatRequest, gen: Generation, rid: str,
                 conversations: list[list[dict[str, Any]]]) -> None:
        super().__init__(st, req, gen, rid)
        self.conversations = conversations

    def _messages(self, index: int) -> list[dict[str, Any]]:
        return self.conversations[index]

    def whole(self, texts: dict[int, list[str]], updates: dict[int, list[ChoiceUpdate]],
              reasons: dict[int, str | None]) -> dict[str, Any]:
        out = super().whole(texts, updates, reasons)
        out.pop("prompt_token_ids", None)  # several prompts: not one list (each choice has its token_ids)
        return out


def _decoder(st: ServerState, keep_special: bool = False) -> Any:
    tok = st.tokenizer
    return lambda tid: tok.decode([tid], skip_special_tokens=not keep_special)


__all__ = ["BatchChatShape", "ChatShape", "CompletionShape", "Shape"]
