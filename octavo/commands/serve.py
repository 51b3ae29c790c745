"""`octavo serve MODEL`: the OpenAI-compatible HTTP server (completions, chat, models, health, metrics)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from typing import TYPE_CHECKING

from octavo.runtime.engine_args import EngineArgs

if TYPE_CHECKING:
    from octavo.serving.server import OpenAIServer

HELP = "serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)"
log = logging.getLogger(__name__)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's knobs (shared with `octavo bench throughput`)."""
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (wins over --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=_bytes, default=None, help="KV pool size in bytes (e.g. 2G, 512M)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step's batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--num-threads", type=int, default=None, help="backend threads (default: all cores)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime")
    g.add_argument("--trace", metavar="FILE", default=None, help="write one JSON line per engine step here")
    g.add_argument("--engine-seed", type=int, default=0, help="seed of sampled requests that bring none (default 0)")
    g.add_argument("--weights", choices=("fp32", "int8", "int4"), default=None,
                   help="export an HF folder / .gguf with int8 or int4 linear weights (own cache folder; default fp32)")
    g.add_argument("--quant-block-size", type=int, default=None,
                   help="with --weights int8/int4: values per scale / zero point (power of two >= 16; default 32)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --weights int8/int4: quantize the LM head too (default: it stays float32)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "float16"), default="auto",
                   help="KV pool element type: auto = the model's (float32 on onnxruntime); float16 halves the KV "
                        "memory (twice the blocks for the same --kv-cache-memory)")


def engine_args(args: argparse.Namespace) -> EngineArgs:
    ea = EngineArgs(
        model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.num_threads, backend=args.backend,
        trace_path=args.trace, weights=args.weights, kv_cache_dtype=args.kv_cache_dtype,
        quant_block_size=args.quant_block_size, quantize_lm_head=args.quantize_lm_head, seed=args.engine_seed,
    )
    ea.validate()
    return ea


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1073741824, 512M, 2G)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="export folder, HF checkpoint folder or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                                                   "(default: $OCTAVO_API_KEY if set)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (repeatable; default: MODEL as given)")
    p.add_argument("--max-body-bytes", type=_bytes, default=4 << 20, help="largest request body (413 above)")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="refuse max_tokens above this; also the default when a request sets none")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="every response carries vLLM's per-request timing 'metrics' (a request may ask for them "
                        "with include_metrics: true without this)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection may take to send complete request headers (from connect, and idle "
                        "between requests on a kept-alive connection); then it is closed")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request may take to send its whole body once its headers are in (408 after)")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="parse special-token strings inside chat messages (<|im_start|>, ...) as control tokens; "
                        "by default they are plain text, so a user cannot open a system turn. Only for clients "
                        "that put raw template markup in messages on purpose and trust whoever wrote them")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections at most; more are refused at once with 503 (also kept below the "
                        "open-file limit, which serve raises to its hard maximum)")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    import os

    from octavo.runtime.async_engine import AsyncEngine
    from octavo.serving.app import ServerConfig
    from octavo.serving.connections import raise_open_file_limit
    from octavo.serving.server import OpenAIServer

    ea = engine_args(args)
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [args.model]),
        api_key=args.api_key or os.environ.get("OCTAVO_API_KEY") or None,
        max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap,
        per_request_metrics=args.enable_per_request_metrics,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout, max_connections=args.max_connections,
        special_tokens_in_content=args.special_tokens_in_content,
    )
    raise_open_file_limit()
    server = OpenAIServer(config, lambda: AsyncEngine(ea), shutdown_timeout=args.shutdown_timeout)
    return asyncio.run(_serve(server, args.host, args.port))


async def _serve(server: OpenAIServer, host: str, port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = await server.start(host, port)
    print(f"octavo serve: listening on http://{bound[0]}:{bound[1]} (loading the model; /health is 503 until ready)",
          flush=True)
    ready = asyncio.create_task(server.wait_ready())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([ready, stopper], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and ready.exception() is None:
        print(f"octavo serve: model {server.state.model_name!r} ready", flush=True)
        await stopper
        print("octavo serve: shutting down (finishing in-flight requests)", flush=True)
    elif ready.done():
        print(f"octavo serve: error: {server.state.load_error}", flush=True)
        code = 1
    stopper.cancel()
    ready.cancel()
    await server.shutdown()
    return code
