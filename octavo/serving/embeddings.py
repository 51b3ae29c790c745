"""POST /v1/embeddings (OpenAI's, with vLLM's extensions) over an embedding export (runtime/pooling.py).

    {"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64", "dimensions": int,
     "user", vLLM's "normalize": bool, "add_special_tokens": bool (default true), "priority": int}
 -> {"id", "object": "list", "created", "model", "data": [{"object": "embedding", "index", "embedding"}],
     "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0, "prompt_tokens_details": null}}

Each input is one engine request (they run batched with whatever else the engine is doing); "base64" is the
float32 little-endian bytes of each vector (what the openai SDK asks for by default and decodes with numpy).
`dimensions` keeps the first values (Matryoshka), then the vector is normalized as the model's pooling config
says (or as "normalize" asks). A model exported without pooling answers 400 (`model_not_embedding`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import base64
import logging
import time
from typing import Any

import numpy as np
from aiohttp import web

from octavo.errors import EngineDeadError, InvalidRequestError, OverloadedError
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.pooling_params import PoolingParams
from octavo.runtime.sampling_params import SamplingParams
from octavo.serving import responses as R
from octavo.serving.api_error import ApiError, bad_request
from octavo.serving.body import Body
from octavo.serving.metrics import RequestTimer, ServerMetrics
from octavo.serving.lora_models import resolve_model
from octavo.serving.routes import engine_error, read_request
from octavo.serving.state import ServerState

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)
_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "normalize", "add_special_tokens",
                     "priority"})
_INT64 = 2**63


async def embeddings(request: web.Request) -> web.Response:
    st, engine, body = await read_request(request)
    b = Body(body)
    for name in b.d:
        if name not in _FIELDS and name not in st.limits.warned_fields:  # type: ignore[union-attr]
            st.limits.warned_fields.add(name)  # type: ignore[union-attr]
            log.warning("ignoring unknown request field %r (logged once)", name[:80])
    base = SamplingParams(max_tokens=1, output_kind="final_only")
    model_name = resolve_model(st, engine, b.string("model", None), base)  # a LoRA adapter's name: with it
    model = engine.embedding_model
    if model.config is None:
        raise ApiError(400, f"the model {st.model_name!r} was exported without pooling, so it makes no embeddings: "
                            "export it with `octavo export --pooling last` (or mean, cls), or serve an embedding "
                            "model", param="model", code="model_not_embedding")
    fmt = b.string("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    normalize = b.boolean("normalize", True) if b.present("normalize") else None  # None: the model's config
    params = PoolingParams(normalize=normalize, dimensions=b.integer("dimensions", None, lo=1, hi=model.hidden_size))
    b.string("user", None)
    priority = b.integer("priority", 0, lo=-_INT64, hi=_INT64 - 1) or 0
    inputs = await _token_ids(b, st)
    vectors = await _run(engine, st.metrics, inputs, dataclasses.replace(base, pooling=params), priority)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)]
    used = sum(len(ids) for ids in inputs)
    return web.json_response({
        "id": R.new_id("embd"), "object": "list", "created": int(time.time()), "model": model_name, "data": data,
        "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0, "prompt_tokens_details": None},
    })


async def _token_ids(b: Body, st: ServerState) -> list[list[int]]:
    """The inputs as token ids: strings tokenized (off the event loop), id lists checked against the vocabulary."""
    v = b.d.get("input")
    msg = "'input' must be a string, a list of strings, a list of token ids or a list of token id lists"
    is_ids = lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
    if isinstance(v, str):
        items: list[Any] = [v]
    elif isinstance(v, list) and v and is_ids(v):
        items = [v]
    elif isinstance(v, list) and v and (all(isinstance(x, str) for x in v) or all(is_ids(x) for x in v)):
        items = list(v)
    else:
        raise bad_request(msg if v != [] and v is not None else "'input' must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(items)}", "input")
    if any(isinstance(x, str) and not x for x in items) or any(isinstance(x, list) and not x for x in items):
        raise bad_request("'input' must not contain empty strings or empty token lists", "input")
    vocab = st.limits.vocab_size  # type: ignore[union-attr]
    for x in items:
        if isinstance(x, list) and any(not 0 <= t < vocab for t in x):
            raise bad_request(f"'input' holds token ids outside the vocabulary (0 to {vocab - 1})", "input")
    special = b.boolean("add_special_tokens", True)
    texts = [i for i, x in enumerate(items) if isinstance(x, str)]
    if texts:
        encoded = await asyncio.to_thread(lambda: [st.tokenizer.encode(items[i], special) for i in texts])  # type: ignore[union-attr]
        for i, ids in zip(texts, encoded):
            items[i] = ids
    return items


async def _run(engine: AsyncEngine, metrics: ServerMetrics, inputs: list[list[int]], params: SamplingParams,
               priority: int) -> list[np.ndarray]:
    """One engine request per input, all submitted at once; their vectors in input order. Leaving early (an
    error, the client gone) aborts those still running. Each counts in the request metrics (latency, queue
    time, finished reason) like a generation."""
    rid = R.new_id("embd")

    async def one(i: int, ids: list[int]) -> np.ndarray:
        vector, timer, reason = None, RequestTimer(metrics, time.monotonic()), "abort"
        try:
            async for out in engine.generate({"prompt_token_ids": ids}, params, f"{rid}-{i}", priority=priority):
                if out.finished:
                    if out.embedding is None:
                        reason = "error"
                        error = next((o.error for o in out.outputs if o.error), None)
                        raise ApiError(500, f"embedding failed: {error or 'the engine step failed'}",
                                       code="step_failed")
                    vector, m = out.embedding, out.metrics
                    queued = m.first_scheduled_time - m.arrival_time if m.first_scheduled_time is not None else None
                    timer.finish(time.monotonic(), "stop", queued)
        except (InvalidRequestError, EngineDeadError, OverloadedError):
            reason = "rejected"  # never ran: not an abort
            raise
        finally:
            if vector is None and reason != "rejected":
                timer.finish(time.monotonic(), reason, None)
        if vector is None:
            raise ApiError(500, "embedding failed: the request ended without a vector", code="step_failed")
        return vector

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(inputs)]
    try:
        return list(await asyncio.gather(*tasks))
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a prompt too long (400), the engine gone (503), ...
        raise engine_error(exc) from None
    finally:
        for t in tasks:  # cancelled tasks' generators abort their engine requests
            t.cancel()


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


__all__ = ["MAX_INPUTS", "embeddings"]
