"""The aiohttp application: OpenAI-compatible routes over one shared AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE), GET /v1/models,
/health, /version, /metrics, /openapi.json. Errors leave in OpenAI's JSON shape. Every route except /health needs the
API key when one is set. While the model loads (or the server drains) the API answers 503.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

import octavo
from octavo.errors import OctavoError
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.outputs import Logprob
from octavo.serving import responses as R
from octavo.serving import sse
from octavo.serving.api_error import ApiError, bad_request, from_exception
from octavo.serving.generation import ChoiceUpdate, Generation
from octavo.serving.metrics import CONTENT_TYPE, ServerMetrics
from octavo.serving.openapi import add_openapi_route, server_schema
from octavo.serving.protocol import ChatRequest, CompletionRequest, Limits, check_model, parse_chat, parse_completion
from octavo.serving.tokenize_routes import add_tokenize_routes
from octavo.serving.tool_output import ToolStream, tool_message, whole_message
from octavo.serving.tools import template_messages
from octavo.structured.manager import CONSTRAINT_FAILED
from octavo.structured.params import StructuredOutputError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    served_model_names: tuple[str, ...]  # the first is the name responses carry
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_tokens_cap: int | None = None
    max_n: int = 16
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics: "metrics" in every response
    header_timeout: float = 30.0  # seconds to send complete headers, from connect or the previous response
    body_timeout: float = 60.0  # seconds to send the whole body once the headers are in (408 after)
    max_connections: int = 1024  # open connections; more get 503 too_many_connections at once
    special_tokens_in_content: bool = False  # parse special-token strings in chat messages as control tokens
    tool_call_parser: str | None = None  # --tool-call-parser (hermes, llama3_json): enables tool_choice "auto"


@dataclass(slots=True)
class ServerState:
    """What the routes share. `engine` and the model facts are set once the model is loaded and started."""

    config: ServerConfig
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    engine: AsyncEngine | None = None
    tokenizer: Any | None = None
    limits: Limits | None = None
    max_model_len: int | None = None
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0  # requests whose handler is running (the drain waits for them)
    stop_reading: asyncio.Event = field(default_factory=asyncio.Event)  # set when the drain ends: bodies still
    # being received get 503 (a body that never ends must not hold shutdown)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        if self.engine is None:
            raise ApiError(503, "the model is still loading; retry when /health returns 200", code="loading")
        if self.engine.dead_reason is not None:  # the step loop died: /health must say so, for a supervisor
            raise ApiError(503, f"the engine is not running: {self.engine.dead_reason}", code="engine_dead")
        return self.engine


STATE = web.AppKey("octavo_state", ServerState)
CLOSE_AFTER = web.RequestKey("octavo_close_after", bool)  # request key: answer, then close the connection (a body left unread)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_count, _errors, _auth], client_max_size=state.config.max_body_bytes)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/invocations", invocations)
    add_tokenize_routes(app, STATE)  # /tokenize, /detokenize, /tokenizer_info (vLLM's)
    add_openapi_route(app, lambda: server_schema(state))
    return app


# ---------------------------------------------------------------------------------------------------
# middlewares


def _json_error(err: ApiError, request: web.Request | None = None) -> web.Response:
    resp = web.json_response(err.body(), status=err.status, headers=err.headers)
    if request is not None and request.get(CLOSE_AFTER):
        resp.force_close()
    return resp


@web.middleware
async def _count(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[STATE]
    st.in_flight += 1
    try:
        return await handler(request)
    finally:
        st.in_flight -= 1


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _json_error(err, request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].config.max_body_bytes
        return _json_error(ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                         "(--max-body-bytes)", code="request_too_large"))
    except web.HTTPException as exc:  # unknown route, wrong method, ...
        if exc.status < 400:
            raise
        return _json_error(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except Exception as exc:  # noqa: BLE001 - a bug must still answer in the API's error shape
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _json_error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].config.api_key
    if key is not None and request.path != "/health":
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # bytes compared: a header with bytes that are not UTF-8 reaches us with surrogate escapes
        given_key = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_key, key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return await handler(request)


# ---------------------------------------------------------------------------------------------------
# small routes


async def health(request: web.Request) -> web.Response:
    request.app[STATE].ready_engine()
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": octavo.__version__})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()  # engine.stats() is a snapshot: never waits for a step
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(R.model_list(st.config.served_model_names, st.created, st.max_model_len))


# ---------------------------------------------------------------------------------------------------
# completions


async def _read_json(request: web.Request) -> Any:
    st = request.app[STATE]
    limit = st.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    return parse_json_body(await _read_body(request, st))


async def _read_body(request: web.Request, st: ServerState) -> bytes:
    """The whole body within config.body_timeout (408 after), or 503 if shutdown's drain ends first; an
    undecodable Content-Encoding is a 400."""
    read = asyncio.ensure_future(request.read())
    stop = asyncio.ensure_future(st.stop_reading.wait())
    try:
        done, _ = await asyncio.wait((read, stop), timeout=st.config.body_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not read.done():
            read.cancel()
    if read in done:
        try:
            return read.result()
        except web.RequestPayloadError as exc:  # gzip/deflate/br that does not decode, a broken chunked body
            raise bad_request(f"the request body cannot be read: {exc} (check Content-Encoding and "
                              "Transfer-Encoding)") from None
    request[CLOSE_AFTER] = True  # the rest of the body is not wanted: the connection ends after the answer
    if stop in done:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    raise ApiError(408, f"the request body did not arrive within {st.config.body_timeout:g} s (--body-timeout)",
                   code="request_timeout")


# Surrogate escapes (\\uD800-\\uDFFF) in a JSON text. SUSPECT finds, in one scan, every escape that may stand alone
# (a high half not followed by a low one, a low half not preceded by a high one, a high half after another
# backslash, which may escape it) and some that do not; an exact look follows only then. The exact look reads
# escapes left to right as the decoder does: escaped backslashes and valid pairs removed, any surrogate escape
# left is a real one, and unpaired.
_SUSPECT = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                      r"|\\u[dD][c-fC-F](?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F])"
                      r"|\\\\u[dD][89abAB]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_BACKSLASH_OR_PAIR = re.compile(r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON in strict UTF-8, or a 400. Checked on the raw text, never by re-serialising:
    strict decoding rejects encoded surrogates, so a lone surrogate can only come from a \\uD800-style escape
    not paired with the next one (json.loads joins a pair into one character)."""
    try:  # strict UTF-8 (json.loads(bytes) would let encoded surrogates through)
        text = raw.decode("utf-8")
        body = json.loads(text)
    except (ValueError, UnicodeError, RecursionError) as exc:  # JSONDecodeError, int digits limit, nesting
        raise bad_request(f"the request body is not valid JSON in UTF-8: {str(exc)[:200]}",
                          code="invalid_json") from None
    lone = _lone_surrogate_escape(text)
    if lone is not None:
        raise bad_request(f"the request body is not valid JSON in UTF-8: it holds the lone surrogate {lone} "
                          "(a \\uD800-\\uDFFF escape that is not part of a high-low pair): surrogates not allowed",
                          code="invalid_json")
    return body


def _lone_surrogate_escape(text: str) -> str | None:
    """The first unpaired surrogate escape of a valid JSON text (backslashes occur only in its strings' escapes),
    else None."""
    if _SUSPECT.search(text) is None:  # the common case, escaped pairs (emoji from ASCII-only clients) included
        return None
    found = _SURROGATE_ESCAPE.search(_BACKSLASH_OR_PAIR.sub("", text))
    return None if found is None else found.group()


def _engine_error(exc: BaseException) -> ApiError:
    api = from_exception(exc)
    if api.status == 500 and not isinstance(exc, OctavoError):
        log.exception("unexpected engine error", exc_info=exc)
    return api


async def _generation_body(request: web.Request) -> tuple[ServerState, AsyncEngine, Any]:
    """The server state, its engine (a 503 while it cannot take requests, before the body is read) and the
    request's JSON body, for the routes that generate."""
    st = request.app[STATE]
    engine = st.ready_engine()
    assert st.limits is not None
    return st, engine, await _read_json(request)


async def completions(request: web.Request) -> web.StreamResponse:
    st, engine, body = await _generation_body(request)
    return await _completions(request, st, engine, parse_completion(body, st.limits))


async def _completions(request: web.Request, st: ServerState, engine: AsyncEngine,
                       req: CompletionRequest) -> web.StreamResponse:
    check_model(req.model, st.config.served_model_names)
    await _prepare_constraint(engine, req)
    rid = R.new_id("cmpl")
    gen = Generation(engine, st.metrics, req.prompts, req.params, rid, req.options.priority)
    return await _run(request, st, gen, _CompletionShape(st, req, gen, rid))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st, engine, body = await _generation_body(request)
    return await _chat(request, st, engine, parse_chat(body, st.limits))


async def _chat(request: web.Request, st: ServerState, engine: AsyncEngine, req: ChatRequest) -> web.StreamResponse:
    check_model(req.model, st.config.served_model_names)
    await _prepare_constraint(engine, req)
    c = req.chat
    try:  # off the event loop: a long conversation takes a while to render and tokenize
        tools = {"tools": req.tools} if req.tools else {}  # as transformers' apply_chat_template(tools=...)
        ids = await asyncio.to_thread(
            st.tokenizer.encode_chat, template_messages(req.messages), c.add_generation_prompt,
            add_special_tokens=c.add_special_tokens, special_tokens_in_content=st.config.special_tokens_in_content,
            chat_template=c.chat_template, continue_final_message=c.continue_final_message, **c.chat_template_kwargs,
            **tools)
    except Exception as exc:  # noqa: BLE001 - no template, or a template that rejects these messages
        param = "chat_template" if c.chat_template is not None else "messages"
        raise bad_request(f"cannot apply the chat template to these messages: {exc}", param) from None
    rid = R.new_id("chatcmpl")
    gen = Generation(engine, st.metrics, [{"prompt_token_ids": ids}], req.params, rid, req.options.priority)
    return await _run(request, st, gen, _ChatShape(st, req, gen, rid))


async def _prepare_constraint(engine: AsyncEngine, req: ChatRequest | CompletionRequest) -> None:
    """Compile the request's output constraint (on the engine's grammar workers) before anything is queued: a
    400 naming the field it came from if it is unusable or too large, a 503 if too many are compiling."""
    so = req.params.structured_outputs
    if so is None:
        return
    try:
        await engine.prepare_constraint(so)
    except StructuredOutputError as exc:
        where = req.constraint_where or "structured_outputs"
        raise bad_request(f"'{where}': {exc}", where.split("[")[0].split(".")[0]) from None
    except Exception as exc:  # noqa: BLE001 - overloaded (503), or a compiler bug (500, logged)
        raise _engine_error(exc) from None


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's POST /invocations (as vLLM routes it): a body with 'messages' is a chat completion, one
    with 'prompt' a completion."""
    st, engine, body = await _generation_body(request)
    if isinstance(body, dict) and "messages" in body:
        return await _chat(request, st, engine, parse_chat(body, st.limits))
    if isinstance(body, dict) and "prompt" in body:
        return await _completions(request, st, engine, parse_completion(body, st.limits))
    raise bad_request("/invocations takes a chat completion body (with 'messages') or a completion body (with "
                      "'prompt')")


class _Shape:
    """How a route renders a Generation's updates, as a whole response and as SSE chunks (shared parts)."""

    envelope: Any  # R.completion | R.chat: (rid, created, model, choices, usage, *, chunk, with_usage_field)

    def __init__(self, st: ServerState, req: Any, gen: Generation, rid: str) -> None:
        self.st, self.req, self.gen, self.rid = st, req, gen, rid
        self.created = int(time.time())
        self.opts = req.options
        self.streamed_tokens = 0  # completion tokens the stream has carried so far (continuous usage)
        self.prompt_ids_sent: set[int] = set()  # choices whose chunk carried prompt_token_ids

    @property
    def _with_metrics(self) -> bool:
        return self.opts.include_metrics or self.st.config.per_request_metrics

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        use = None
        if self.opts.continuous_usage:  # usage so far on every chunk (vLLM's continuous_usage_stats)
            use = R.usage(self.gen.prompt_tokens, self.streamed_tokens, self.gen.cached_tokens)
        return self.envelope(self.rid, self.created, self.st.model_name, choices, use, chunk=True,
                             with_usage_field=self.req.include_usage)

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.req.include_usage:
            return None
        out = self.envelope(self.rid, self.created, self.st.model_name, [], self._usage(), chunk=True,
                            with_usage_field=True)
        if self._with_metrics:  # as vLLM: the metrics of a stream ride on its final usage chunk
            out["metrics"] = self.gen.timing()
        return out

    def _usage(self) -> dict[str, Any]:
        return R.usage(self.gen.prompt_tokens, self.gen.completion_tokens, self.gen.cached_tokens)

    def _response(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.envelope(self.rid, self.created, self.st.model_name, choices, self._usage())
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


class _CompletionShape(_Shape):
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
        lp = R.completion_logprobs(entries, ids, self.req.logprobs, _decoder(self.st), off,
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
            legacy, self.offsets[index] = R.echo_logprobs(ids, entries, self.req.logprobs, _decoder(self.st),
                                                          as_ids=self.opts.tokens_as_ids)
        vllm = None
        if self.req.prompt_logprobs is not None:
            vllm = R.prompt_logprobs_json(ids, entries, self.req.prompt_logprobs)
        return legacy, vllm

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        p = self.req.prompts[index // self.req.params.n]
        return p if isinstance(p, str) else self.st.tokenizer.decode(p)

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
        if self.opts.return_token_ids:
            choice["prompt_token_ids"] = self.gen.prompt_token_ids(i)
            choice["token_ids"] = ids
        return choice


class _ChatShape(_Shape):
    """/v1/chat/completions."""

    envelope = staticmethod(R.chat)
    req: ChatRequest

    def __init__(self, st: ServerState, req: ChatRequest, gen: Generation, rid: str) -> None:
        super().__init__(st, req, gen, rid)
        self.tool_streams: dict[int, ToolStream] = {}  # per choice, when tool calls are read from the text

    def _tool_stream(self, index: int) -> ToolStream:
        ts = self.tool_streams.get(index)
        if ts is None:
            ts = self.tool_streams[index] = ToolStream(self.req.tool_choice, self.st.config.tool_call_parser,
                                                       self.req.parallel_tool_calls)
        return ts

    def _logprobs(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        if not self.req.logprobs or u.logprobs is None:
            return None
        return R.chat_logprobs(u.logprobs, u.token_ids, self.req.top_logprobs, _decoder(self.st),
                               as_ids=self.opts.tokens_as_ids)

    @property
    def _echo(self) -> str:
        """With echo, the reply starts with the last message's content when that message is the assistant's
        (vLLM's rule: the echoed message must have the role of the reply)."""
        last = self.req.messages[-1]
        return last["content"] if self.req.chat.echo and last["role"] == "assistant" else ""

    def first_chunks(self) -> list[dict[str, Any]]:
        out = []
        for i in range(self.gen.num_choices):
            chunk = self._chunk([R.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)])
            if self.opts.return_token_ids:
                chunk["prompt_token_ids"] = self.gen.prompt_token_ids(i)
            out.append(chunk)
        if self._echo:
            out += [self._chunk([R.chat_chunk_choice(i, {"content": self._echo}, None)])
                    for i in range(self.gen.num_choices)]
        return out

    def chunk(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        self._counted(u)
        if not self._wants_chunk(u, self.req.logprobs):
            return None
        ts = self._tool_stream(u.index)
        delta, reason = self._tool_delta(ts, u) if ts.active else ({"content": u.text} if u.text else {}, u.finish_reason)
        if ts.active and not delta and reason is None and not (u.token_ids and (self.req.logprobs
                                                                               or self.opts.return_token_ids)):
            return None  # text held back (a call being assembled)
        choice = R.chat_chunk_choice(u.index, delta, reason, self._logprobs(u))
        if self.opts.return_token_ids:
            choice["token_ids"] = u.token_ids
        return self._chunk([choice])

    @staticmethod
    def _tool_delta(ts: ToolStream, u: ChoiceUpdate) -> tuple[dict[str, Any], str | None]:
        """A choice whose text may be tool calls: its content / tool-call deltas merged into one delta."""
        deltas = ts.feed(u.text)
        reason = u.finish_reason
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
            lp = R.chat_logprobs(entries, ids, self.req.top_logprobs, _decoder(self.st),
                                 as_ids=self.opts.tokens_as_ids)
        text = self._echo + text
        choice = R.chat_choice(i, text, reason, lp)
        if self.req.tools is not None and self.req.tool_choice.mode != "none":
            m = whole_message(self.req.tool_choice, self.st.config.tool_call_parser, text, reason,
                              self.req.parallel_tool_calls)
            choice["message"] = tool_message(m.content, m.tool_calls)
            choice["finish_reason"] = m.finish_reason
        if self.opts.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def whole(self, texts: dict[int, list[str]], updates: dict[int, list[ChoiceUpdate]],
              reasons: dict[int, str | None]) -> dict[str, Any]:
        out = super().whole(texts, updates, reasons)
        if self.opts.return_token_ids:
            out["prompt_token_ids"] = self.gen.prompt_token_ids(0)
        return out


def _decoder(st: ServerState) -> Any:
    tok = st.tokenizer
    return lambda tid: tok.decode([tid])


def _step_failed(u: ChoiceUpdate) -> ApiError:
    """The error of a choice the engine finished with "error": a 500 for a failed step, a 400 when the output's
    constraint could not be followed (the request's grammar, not the server) — before any header went out;
    an in-band error event after."""
    if u.error is not None and u.error.startswith(CONSTRAINT_FAILED):
        return ApiError(400, u.error, param="structured_outputs", code="constraint_failed")
    return ApiError(500, f"generation failed: {u.error or 'the engine step failed'}", code="step_failed")


async def _run(request: web.Request, st: ServerState, gen: Generation,
               shape: _Shape) -> web.StreamResponse:
    async with aclosing(gen.updates()) as updates:
        it = aiter(updates)
        try:  # the first output (or the prompt's rejection) before any header goes out
            first = await anext(it, None)
        except Exception as exc:  # noqa: BLE001
            raise _engine_error(exc) from None
        failed = next((u for u in first or () if u.finish_reason == "error"), None)
        if failed is not None:  # nothing sent yet: a plain error rather than an event stream
            raise _step_failed(failed)
        if shape.req.stream:
            return await _stream(request, shape, first, it)
        return await _whole(shape, first, it)


async def _whole(shape: _Shape, first: list[ChoiceUpdate] | None,
                 it: Any) -> web.Response:
    texts: dict[int, list[str]] = {}
    ups: dict[int, list[ChoiceUpdate]] = {}
    reasons: dict[int, str | None] = {}

    def take(batch: list[ChoiceUpdate]) -> None:
        for u in batch:
            texts.setdefault(u.index, []).append(u.text)
            ups.setdefault(u.index, []).append(u)
            if u.finish_reason is not None:
                reasons[u.index] = u.finish_reason
                if u.finish_reason == "error":
                    raise _step_failed(u)

    if first is not None:
        take(first)
    try:
        async for batch in it:
            take(batch)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _engine_error(exc) from None
    return web.json_response(shape.whole(texts, ups, reasons), dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def _stream(request: web.Request, shape: _Shape, first: list[ChoiceUpdate] | None,
                  it: Any) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    try:
        for c in shape.first_chunks():
            await resp.write(sse.event(c))
        batch = first
        while batch is not None:
            for u in batch:
                if u.finish_reason == "error":
                    await resp.write(sse.event(_step_failed(u).body()))
                    await resp.write(sse.DONE)
                    return resp
                chunk = shape.chunk(u)
                if chunk is not None:
                    await resp.write(sse.event(chunk))
            try:
                batch = await anext(it, None)
            except Exception as exc:  # noqa: BLE001 - headers are out: report in-band
                await resp.write(sse.event(_engine_error(exc).body()))
                await resp.write(sse.DONE)
                return resp
        usage = shape.usage_chunk()
        if usage is not None:
            await resp.write(sse.event(usage))
        await resp.write(sse.DONE)
    except ConnectionResetError:  # client went away: gen is closed by the caller, which aborts the request
        log.debug("client disconnected from %s", request.path)
    return resp


__all__ = ["STATE", "ServerConfig", "ServerState", "build_app"]
