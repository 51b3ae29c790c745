"""The tokenizer routes, in vLLM's shapes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

    POST /tokenize    {"prompt": str, "add_special_tokens": true}                      (a completion prompt)
                      {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
                       "continue_final_message": false, "chat_template", "chat_template_kwargs"}  (a chat)
                      optional "model", "return_token_strs"
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int, ...]}  -> {"prompt": str}   (special tokens kept: round-trips a chat)
    GET  /tokenizer_info -> the special tokens, chat template and context length

The ids are exactly what the generation routes feed the engine: a prompt is encoded as /v1/completions
encodes it (special tokens added unless told), a chat as /v1/chat/completions renders and encodes it, so
`count` equals those routes' usage.prompt_tokens. lm-evaluation-harness's `local-completions` model finds
/tokenizer_info and /tokenize by itself and then tokenizes through the server (no tokenizer download).
"""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from octavo.errors import InvalidRequestError
from octavo.serving.api_error import bad_request
from octavo.serving.body import Body, parse_json_body
from octavo.serving.chat_messages import chat_options, parse_messages
from octavo.serving.protocol import check_model

__all__ = ["add_tokenize_routes"]


def add_tokenize_routes(app: web.Application, state_key: web.AppKey) -> None:
    """Register the three routes on APP; STATE_KEY finds the server's ServerState in it."""

    async def tokenize(request: web.Request) -> web.Response:
        st = request.app[state_key]
        st.ready_engine()
        b, tokens = await _tokenize(_body(await request.read()), st)
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": st.max_model_len, "tokens": tokens}
        if b.boolean("return_token_strs", False):
            out["token_strs"] = [st.tokenizer.id_to_token(t) or "" for t in tokens]
        else:
            out["token_strs"] = None
        return web.json_response(out)

    async def detokenize(request: web.Request) -> web.Response:
        st = request.app[state_key]
        st.ready_engine()
        b = _body(await request.read())
        check_model(b.string("model", None), _models(st))
        if b.d.get("tokens") is None:
            raise bad_request("'tokens' is required: a list of token ids", "tokens")
        tokens = b.int_list("tokens")
        vocab = st.limits.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise bad_request(f"'tokens' must be token ids in [0, {vocab})", "tokens")
        text = await asyncio.to_thread(st.tokenizer.decode, tokens, False)
        return web.json_response({"prompt": text})

    async def tokenizer_info(request: web.Request) -> web.Response:
        st = request.app[state_key]
        st.ready_engine()
        tok = st.tokenizer
        return web.json_response({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token or None,
            "eos_token": tok.eos_token or None,
            "pad_token": None,
            "unk_token": None,
            "add_bos_token": False,  # prompt ids carry what the tokenizer's own post-processor adds, nothing more
            "chat_template": tok.chat_template,
            "model_max_length": st.max_model_len,
            "vocab_size": st.limits.vocab_size,
        })

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)


def _models(st: Any) -> tuple[str, ...]:
    """The names a request may give: the served ones and the LoRA adapters' (same tokenizer)."""
    return (*st.config.served_model_names, *(st.engine.loras.slots if st.engine is not None else ()))


def _body(raw: bytes) -> Body:
    return Body(parse_json_body(raw))


async def _tokenize(b: Body, st: Any) -> tuple[Body, list[int]]:
    check_model(b.string("model", None), _models(st))
    has_prompt, has_messages = b.d.get("prompt") is not None, b.d.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("send exactly one of 'prompt' (a string) and 'messages' (a chat)",
                          "prompt" if has_prompt else None)
    tok = st.tokenizer
    if has_prompt:
        prompt = b.string("prompt", None)
        assert prompt is not None
        add_special = b.boolean("add_special_tokens", True)
        return b, await _run("prompt", tok.encode, prompt, add_special)
    messages = parse_messages(b)
    c = chat_options(b, messages)  # the chat route's own options and checks: the same ids as it

    def render_and_encode() -> list[int]:
        return tok.encode_chat(messages, c.add_generation_prompt, add_special_tokens=c.add_special_tokens,
                               special_tokens_in_content=st.config.special_tokens_in_content,
                               chat_template=c.chat_template, continue_final_message=c.continue_final_message,
                               **c.chat_template_kwargs)

    return b, await _run("chat_template" if c.chat_template is not None else "messages", render_and_encode)


async def _run(param: str, fn: Any, *args: Any) -> list[int]:
    try:  # off the event loop: a long text takes a while to tokenize
        return await asyncio.to_thread(fn, *args)
    except InvalidRequestError as exc:  # text that cannot be tokenized, no template, a template that rejects the chat
        raise bad_request(str(exc), param) from None
