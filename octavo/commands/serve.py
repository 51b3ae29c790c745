"""`octavo serve MODEL`: the OpenAI-compatible HTTP server (completions, chat, models, health, metrics)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from typing import TYPE_CHECKING

from octavo.export.embedded import EMBEDDED_NAME
from octavo.commands.engine_flags import add_engine_arguments, engine_args
from octavo.errors import InvalidRequestError
from octavo.serving.engine_params import parse_bytes

if TYPE_CHECKING:
    from octavo.serving.server import OpenAIServer

HELP = "serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)"
log = logging.getLogger(__name__)


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="export folder, HF checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct, "
                        f"served as {EMBEDDED_NAME!r})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback; 0.0.0.0 "
                                                      "exposes it)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                                                   "(default: $OCTAVO_API_KEY if set)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (repeatable; the first is the one responses carry; default: "
                        f"MODEL as given, or {EMBEDDED_NAME!r} for the embedded model)")
    p.add_argument("--max-body-bytes", type=_bytes, default=4 << 20,
                   help="largest request body (413 above; default: %(default)s = 4M)")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="refuse max_tokens above this; also the default when a request sets none (default: none, "
                        "up to the context)")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="every response carries vLLM's per-request timing 'metrics' (a request may ask for them "
                        "with include_metrics: true without this)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--header-timeout", type=_positive_seconds, default=30.0,
                   help="seconds a connection may take to send complete request headers (from connect, and idle "
                        "between requests on a kept-alive connection); then it is closed")
    p.add_argument("--body-timeout", type=_positive_seconds, default=60.0,
                   help="seconds a request may take to send its whole body once its headers are in (408 after)")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="parse special-token strings inside chat messages (<|im_start|>, ...) as control tokens; "
                        "by default they are plain text, so a user cannot open a system turn. Only for clients "
                        "that put raw template markup in messages on purpose and trust whoever wrote them")
    p.add_argument("--max-connections", type=_positive_int, default=1024,
                   help="open connections at most; more are refused at once with 503 (also kept below the "
                        "open-file limit, which serve raises to its hard maximum)")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"),
                   default=None,
                   help="read tool calls out of the model's text (enables tool_choice 'auto'; vLLM's names): hermes = "
                        "<tool_call>{...}</tool_call>, llama3_json = Llama 3's JSON calls, mistral = [TOOL_CALLS], "
                        "pythonic = [f(a=1)] (Llama 3.2/4), qwen3_coder = <tool_call><function=f><parameter=a>")
    p.add_argument("--metric-names", choices=("both", "vllm", "octavo"), default="both",
                   help="what /metrics shows: octavo:* and vLLM's vllm:* names and labels (what llm-d, production-stack "
                        "and KServe read), or one set (default: %(default)s)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; they read a folder "
                        "the client names: keep --api-key on); needs --enable-lora or --lora-modules")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility (--tool-call-parser alone enables 'auto')")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    import os

    from octavo.export.embedded import model_argument
    from octavo.runtime.async_engine import AsyncEngine
    from octavo.serving.state import ServerConfig
    from octavo.serving.connections import raise_open_file_limit
    from octavo.serving.server import OpenAIServer

    model, name = model_argument(args.model)
    ea = engine_args(args, model)
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [name]),
        api_key=args.api_key or os.environ.get("OCTAVO_API_KEY") or None,
        max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap,
        per_request_metrics=args.enable_per_request_metrics,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout, max_connections=args.max_connections,
        special_tokens_in_content=args.special_tokens_in_content, tool_call_parser=args.tool_call_parser,
        metric_names=args.metric_names,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
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
