"""Naive serving: HF transformers behind an OpenAI-compatible /v1/completions, one request at a time.

The baseline the "N x more users than naive serving" claim is measured against (benchmarks/slo_capacity.py):
requests run strictly one after another in arrival order, each with transformers' own greedy decoding
(one forward over the prompt, then one forward per token on its KV cache: what `model.generate` does
for greedy, written out so every token can be streamed and a disconnected client's request stopped).
No batching, no paging, nothing shared between requests. The HTTP side is asyncio (aiohttp); the model
runs in one worker thread, so a queued request waits while /health and /metrics still answer.

    python -m benchmarks.peers.hf_naive_server MODEL [--port 8000] [--threads 2]

MODEL: an HF checkpoint folder or a .gguf file (loaded with transformers' own GGUF loader, dequantized
to fp32). Routes: POST /v1/completions (prompt: str or token ids; max_tokens; ignore_eos; stream with
stream_options.include_usage; return_token_ids as vLLM's; greedy only), GET /v1/models, /health,
/metrics (Prometheus gauges hf_naive:num_requests_running and hf_naive:num_requests_waiting).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from octavo.errors import InvalidRequestError, ModelFormatError

log = logging.getLogger(__name__)
MAX_QUEUE = 1024  # requests waiting at most; more are refused with 503 (memory per request stays bounded)


def load_model(model: str | Path, threads: int) -> tuple[Any, Any]:
    """(model, tokenizer) in fp32 from an HF folder or a .gguf file (transformers' GGUF dequantization;
    the weights are loaded by hand, since from_pretrained(gguf_file=...) wants `accelerate`)."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    path = Path(model)
    if path.is_dir():
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
        tok = transformers.AutoTokenizer.from_pretrained(path, use_safetensors=True)
    elif path.is_file() and path.suffix == ".gguf":
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name, use_safetensors=True)
        m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=m)["tensors"]
        missing, unexpected = m.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()},
                                                strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ModelFormatError(f"{path}: transformers' GGUF loader left weights unmatched "
                                   f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
        m.tie_weights()
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, use_safetensors=True)
    else:
        raise ModelFormatError(f"{model}: expected an HF checkpoint folder or a .gguf file")
    m.eval()
    return m, tok


@dataclass(slots=True)
class Job:
    """One request: what to generate and the channel its tokens go back through."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    emit: Callable[[int | None], None]  # a token id, or None at the end (called from the worker thread)
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class NaiveRunner:
    """Runs jobs one at a time in submission (= arrival) order on a single worker thread."""

    def __init__(self, model: Any, eos_ids: set[int], context_len: int) -> None:
        self.model = model
        self.eos_ids = eos_ids
        self.context_len = context_len
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-naive")
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.waiting >= MAX_QUEUE:
                raise OverflowError("queue full")
            self.waiting += 1
        self._pool.submit(self._run, job)

    def _run(self, job: Job) -> None:
        with self._lock:
            self.waiting -= 1
            self.running += 1
        try:
            if not job.cancelled.is_set():
                self._generate(job)
        except Exception as exc:  # noqa: BLE001 - reported to this request's client, the server goes on
            log.exception("generation failed")
            job.error = exc
        finally:
            with self._lock:
                self.running -= 1
            job.emit(None)

    def _generate(self, job: Job) -> None:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([job.prompt]), use_cache=True)
            for step in range(job.max_tokens):
                token = int(out.logits[0, -1].argmax())
                job.emit(token)
                if job.cancelled.is_set() or step + 1 == job.max_tokens or (
                        not job.ignore_eos and token in self.eos_ids):
                    return
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                                 use_cache=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class IncrementalText:
    """Text of a growing token list, emitted as deltas; an incomplete UTF-8 character waits for the next token."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._sent = 0

    def add(self, token: int) -> str:
        self._ids.append(token)
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self._sent = text[self._sent:], len(text)
        return delta


def _parse(body: Any, tokenizer: Any, context_len: int) -> tuple[list[int], int, bool]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        vocab = len(tokenizer)
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
    else:
        raise InvalidRequestError("prompt must be a non-empty string or a non-empty list of token ids (one prompt)")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequestError("max_tokens must be an integer >= 1")
    if len(ids) + max_tokens > context_len:
        raise InvalidRequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                  f"({context_len})")
    temperature = body.get("temperature", 0.0)
    if temperature not in (0, 0.0, None):
        raise InvalidRequestError("this naive baseline decodes greedily only: send temperature 0")
    if body.get("n", 1) != 1:
        raise InvalidRequestError("n must be 1")
    return ids, max_tokens, bool(body.get("ignore_eos", False))


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def make_app(model: Any, tokenizer: Any, model_name: str) -> web.Application:
    config = model.config
    context_len = int(getattr(config, "max_position_embeddings", 2048))
    eos = getattr(config, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    runner = NaiveRunner(model, eos_ids, context_len)
    ids = itertools.count()

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            prompt, max_tokens, ignore_eos = _parse(body, tokenizer, context_len)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON")
        except InvalidRequestError as exc:
            return _error(400, str(exc))
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        job = Job(prompt, max_tokens, ignore_eos, lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t))
        try:
            runner.submit(job)
        except OverflowError:
            return _error(503, f"{MAX_QUEUE} requests already waiting; retry later")
        rid, created = f"cmpl-{next(ids)}", int(time.time())
        try:
            with_ids = bool(body.get("return_token_ids"))
            if body.get("stream"):
                return await _stream(request, job, tokens, rid, created, model_name, tokenizer, len(prompt),
                                     bool((body.get("stream_options") or {}).get("include_usage")), with_ids)
            out: list[int] = []
            async for t in _drain(tokens):
                out.append(t)
            if job.error is not None:
                return _error(500, f"generation failed: {job.error}")
            choice: dict[str, Any] = {"index": 0, "text": tokenizer.decode(out, skip_special_tokens=True),
                                      "logprobs": None, "finish_reason": _finish(out, max_tokens)}
            if with_ids:  # vLLM's return_token_ids
                choice.update(prompt_token_ids=prompt, token_ids=out)
            return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                      "choices": [choice], "usage": _usage(len(prompt), len(out))})
        finally:
            job.cancelled.set()  # a client gone mid-request (the handler is cancelled) stops its job

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model",
                                                              "owned_by": "hf-naive", "created": 0}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        text = (f"# TYPE hf_naive:num_requests_running gauge\nhf_naive:num_requests_running {runner.running}\n"
                f"# TYPE hf_naive:num_requests_waiting gauge\nhf_naive:num_requests_waiting {runner.waiting}\n")
        return web.Response(text=text, content_type="text/plain")

    async def on_cleanup(_: web.Application) -> None:
        runner.close()

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/health", health), web.get("/metrics", metrics)])
    app.on_cleanup.append(on_cleanup)
    return app


async def _drain(tokens: asyncio.Queue[int | None]) -> AsyncIterator[int]:
    while (t := await tokens.get()) is not None:
        yield t


def _finish(out: list[int], max_tokens: int) -> str:
    return "length" if len(out) >= max_tokens else "stop"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _stream(request: web.Request, job: Job, tokens: asyncio.Queue[int | None], rid: str, created: int,
                  model_name: str, tokenizer: Any, prompt_len: int, include_usage: bool,
                  with_ids: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

    def chunk(text: str, finish: str | None, token: int | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if with_ids:
            choice["token_ids"] = [] if token is None else [token]
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": [choice]}

    text = IncrementalText(tokenizer)
    out: list[int] = []
    async for t in _drain(tokens):
        out.append(t)
        await send(chunk(text.add(t), None, t))  # one chunk per token, as vLLM streams
    if job.error is not None:
        await send({"error": {"message": f"generation failed: {job.error}", "type": "server_error", "code": 500}})
    else:
        await send(chunk("", _finish(out, job.max_tokens)))
        if include_usage:
            await send({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [], "usage": _usage(prompt_len, len(out))})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="HF checkpoint folder or .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL as given)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, tokenizer = load_model(args.model, args.threads)
    # handler_cancellation: a client that disconnects cancels its handler, whose `finally` stops the job
    web.run_app(make_app(model, tokenizer, args.served_model_name or args.model), host=args.host, port=args.port,
                print=lambda msg: log.info("%s", msg), handler_cancellation=True)


if __name__ == "__main__":
    main()
