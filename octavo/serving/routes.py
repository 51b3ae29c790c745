"""The generation routes: POST /v1/completions, POST /v1/chat/completions, vLLM's POST
/v1/chat/completions/batch (several conversations, one choice each) and POST /invocations (SageMaker's, either
by its body). Each reads the body (within --body-timeout; 503 while the engine cannot take requests),
parses it (serving/protocol.py), compiles its output constraint, starts a Generation and answers with its
Shape (serving/shapes.py): one JSON response, or an SSE stream. An error before the first byte is a plain JSON
error; after the headers went out it is an in-band error event.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any

from aiohttp import web

from octavo.errors import OctavoError
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.reasoning import prompt_ends_reasoning
from octavo.serving import responses as R
from octavo.serving import sse
from octavo.serving.api_error import ApiError, bad_request, from_exception
from octavo.serving.body import parse_json_body
from octavo.serving.generation import ChoiceUpdate, Generation
from octavo.serving.batch_chat import parse_batch_chat
from octavo.serving.lora_models import resolve_model
from octavo.serving.protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion
from octavo.serving.shapes import BatchChatShape, ChatShape, CompletionShape, Shape
from octavo.serving.state import CLOSE_AFTER, STATE, ServerState
from octavo.serving.tools import template_messages
from octavo.structured.params import CONSTRAINT_FAILED
from octavo.structured.params import StructuredOutputError

log = logging.getLogger(__name__)


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
    resolve_model(st, engine, req.model, req.params)  # a LoRA adapter's name: runs with it
    await _prepare_constraint(engine, req)
    if req.truncation is not None:  # vLLM's truncate_prompt_tokens: the kept token ids are the prompt
        req.prompts = await asyncio.to_thread(_truncated, st, req)
    rid = R.new_id("cmpl")
    gen = Generation(engine, st.metrics, req.prompts, req.params, rid, req.options.priority)
    return await _run(request, st, gen, CompletionShape(st, req, gen, rid))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st, engine, body = await _generation_body(request)
    return await _chat(request, st, engine, parse_chat(body, st.limits))


def _truncated(st: ServerState, req: CompletionRequest) -> list[str | list[int]]:
    """Each prompt's token ids (a string tokenized as the engine would), cut to req.truncation."""
    assert req.truncation is not None
    return [req.truncation.apply(st.tokenizer.encode(p) if isinstance(p, str) else p) for p in req.prompts]


async def _chat(request: web.Request, st: ServerState, engine: AsyncEngine, req: ChatRequest) -> web.StreamResponse:
    resolve_model(st, engine, req.model, req.params)
    await _prepare_constraint(engine, req)
    ids = await _chat_ids(st, req, req.messages)
    answering = False  # with a reasoning parser: the prompt closed the thinking (all of the output is answer)
    if st.reasoning is not None:
        answering = await asyncio.to_thread(prompt_ends_reasoning, st.reasoning, st.tokenizer, ids)
        if st.reasoning_keeps_specials:  # the markers are special tokens: the split must see them in the text
            req.params.skip_special_tokens = False
    rid = R.new_id("chatcmpl")
    gen = Generation(engine, st.metrics, [{"prompt_token_ids": ids}], req.params, rid, req.options.priority)
    return await _run(request, st, gen, ChatShape(st, req, gen, rid, answering=answering))


async def _chat_ids(st: ServerState, req: ChatRequest, messages: list[dict[str, Any]]) -> list[int]:
    """MESSAGES rendered with the chat template and tokenized (off the event loop: a long conversation takes a
    while), then truncated as the request asks (vLLM's truncate_prompt_tokens / truncation_side)."""
    c = req.chat
    try:
        tools = {"tools": req.tools} if req.tools else {}  # as transformers' apply_chat_template(tools=...)
        ids = await asyncio.to_thread(
            st.tokenizer.encode_chat, template_messages(messages), c.add_generation_prompt,
            add_special_tokens=c.add_special_tokens, special_tokens_in_content=st.config.special_tokens_in_content,
            chat_template=c.chat_template, continue_final_message=c.continue_final_message, **c.chat_template_kwargs,
            **tools)
    except Exception as exc:  # noqa: BLE001 - no template, or a template that rejects these messages
        param = "chat_template" if c.chat_template is not None else "messages"
        raise bad_request(f"cannot apply the chat template to these messages: {exc}", param) from None
    return req.truncation.apply(ids) if req.truncation is not None else ids


async def batch_chat_completions(request: web.Request) -> web.StreamResponse:
    """vLLM's POST /v1/chat/completions/batch: `messages` is a list of conversations, each answered by one
    choice (index = its position), with the body's other fields for all; never streamed."""
    st, engine, body = await _generation_body(request)
    req, conversations = parse_batch_chat(body, st.limits)
    resolve_model(st, engine, req.model, req.params)  # a LoRA adapter's name: runs with it
    await _prepare_constraint(engine, req)
    prompts = [{"prompt_token_ids": await _chat_ids(st, req, conv)} for conv in conversations]
    rid = R.new_id("chatcmpl")
    gen = Generation(engine, st.metrics, prompts, req.params, rid, req.options.priority)
    return await _run(request, st, gen, BatchChatShape(st, req, gen, rid, conversations))


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


def _step_failed(u: ChoiceUpdate) -> ApiError:
    """The error of a choice the engine finished with "error": a 500 for a failed step, a 400 when the output's
    constraint could not be followed (the request's grammar, not the server) — before any header went out;
    an in-band error event after."""
    if u.error is not None and u.error.startswith(CONSTRAINT_FAILED):
        return ApiError(400, u.error, param="structured_outputs", code="constraint_failed")
    return ApiError(500, f"generation failed: {u.error or 'the engine step failed'}", code="step_failed")


async def _run(request: web.Request, st: ServerState, gen: Generation,
               shape: Shape) -> web.StreamResponse:
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


async def _whole(shape: Shape, first: list[ChoiceUpdate] | None,
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


async def _stream(request: web.Request, shape: Shape, first: list[ChoiceUpdate] | None,
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


# for the other API modules (embeddings, responses, messages): a body read and an engine error mapped the same way
read_request = _generation_body
read_json = _read_json
engine_error = _engine_error
prepare_constraint = _prepare_constraint
step_failed = _step_failed

__all__ = ["batch_chat_completions", "chat_completions", "completions", "engine_error", "invocations", "prepare_constraint", "read_json", "read_request",
           "step_failed"]
