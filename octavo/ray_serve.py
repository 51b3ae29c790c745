"""Ray Serve: octavo replicas across a Ray cluster, behind Ray Serve's HTTP proxy, with Ray's autoscaling.

    pip install 'octavo[ray]'
    ray start --head                      # or an existing cluster
    serve run octavo.ray_serve:build_app model=out/ num_replicas=2 block_size=16
    # then the OpenAI API on Ray Serve's proxy: http://127.0.0.1:8000/v1/...

`build_app(args)` is a Ray Serve application builder: `serve run` passes its `key=value` words as ARGS, Python
callers a dict (`serve.run(build_app({...}))`). Keys: `model` (required: an export folder, HF folder or .gguf that
every node can read), the deployment's `num_replicas` (default 1) or Ray's autoscaling (`min_replicas`,
`max_replicas`, `target_ongoing_requests`; with any of them the deployment autoscales), `max_ongoing_requests`
(default 64: per replica, Ray queues beyond), `num_cpus` (per replica, default 1), `served_model_name`, `api_key`;
every other key is an engine argument under its EngineArgs name, given as text (`block_size=16`,
`kv_cache_memory=2G`, `kv_events_config={...}`), converted as Triton's config.pbtxt parameters are
(serving/engine_params.py).

Each replica is an `OctavoReplica`: it runs octavo's own OpenAI server (serving/server.py: every route, SSE streaming,
errors, /metrics) on a loopback port inside the replica and relays Ray Serve's requests to it, streaming the body
both ways; a client that goes away closes the relay, and octavo aborts its request. Ray's health check calls
`check_health` (the server's /health), so a replica whose engine died is replaced. Responses carry
`x-octavo-replica` (the replica's id), to see which replica answered.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from octavo.errors import InvalidRequestError
from octavo.runtime.async_engine import AsyncEngine
from octavo.serving.background import ServerThread
from octavo.serving.engine_params import engine_args_from_strings
from octavo.serving.server import OpenAIServer
from octavo.serving.state import ServerConfig

log = logging.getLogger(__name__)

DEPLOYMENT_KEYS = ("num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests",
                   "num_cpus", "served_model_name", "api_key")
HOP_BY_HOP = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
                        "proxy-connection", "te", "trailer"})
READY_S = 600.0  # a replica's model load (an HF / GGUF export on first use can take minutes)


class OctavoReplica:
    """One octavo engine + OpenAI server in a Ray Serve replica; Ray Serve's proxy hands it the HTTP requests."""

    def __init__(self, model: str, engine_parameters: Mapping[str, str], served_model_names: tuple[str, ...],
                 api_key: str | None) -> None:
        args = engine_args_from_strings(model, engine_parameters, where="ray_serve argument")
        config = ServerConfig(served_model_names=served_model_names, api_key=api_key)
        self.replica_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._thread = ServerThread(OpenAIServer(config, lambda: AsyncEngine(args))).start(timeout=READY_S)
        self._base = self._thread.base_url
        self._session: aiohttp.ClientSession | None = None
        log.info("octavo replica %s serving %s on %s", self.replica_id, served_model_names[0], self._base)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # made on Ray's event loop, at first use
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        return self._session

    async def __call__(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = await self._client().request(request.method, self._base + request.url.path,
                                                params=list(request.query_params.multi_items()), headers=headers,
                                                data=await request.body(), allow_redirects=False)
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        out["x-octavo-replica"] = self.replica_id

        async def body() -> AsyncIterator[bytes]:
            complete = False
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
                complete = True
            finally:
                if complete:
                    upstream.release()
                else:  # the client left early: closing the connection makes octavo abort the request
                    upstream.close()

        return StreamingResponse(body(), status_code=upstream.status, headers=out)

    async def check_health(self) -> None:
        """Ray Serve's periodic health check: the replica is unhealthy unless octavo's /health says 200."""
        async with self._client().get(self._base + "/health") as r:
            if r.status != 200:
                raise RuntimeError(f"octavo replica {self.replica_id} unhealthy: /health {r.status} "
                                   f"{(await r.text())[:200]}")

    def __del__(self) -> None:  # Ray Serve's replica shutdown: drain octavo's server, stop its engine
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.stop()


def deployment_options(args: Mapping[str, str]) -> dict[str, Any]:
    """Ray Serve deployment options from the builder's ARGS (see the module docstring)."""
    def number(key: str, kind: type = int) -> Any:
        try:
            return kind(args[key])
        except ValueError:
            raise InvalidRequestError(f"ray_serve argument {key} must be a number, got {args[key]!r}") from None

    options: dict[str, Any] = {"max_ongoing_requests": number("max_ongoing_requests") if "max_ongoing_requests" in args
                               else 64,
                               "ray_actor_options": {"num_cpus": number("num_cpus", float) if "num_cpus" in args
                                                     else 1.0}}
    scaling = {k: number(k, float if k == "target_ongoing_requests" else int)
               for k in ("min_replicas", "max_replicas", "target_ongoing_requests") if k in args}
    if scaling:
        if "num_replicas" in args:
            raise InvalidRequestError("ray_serve arguments: num_replicas is a fixed count; with min_replicas / "
                                      "max_replicas / target_ongoing_requests Ray autoscales (give one or the other)")
        options["autoscaling_config"] = scaling
    else:
        options["num_replicas"] = number("num_replicas") if "num_replicas" in args else 1
    return options


def build_app(args: Mapping[str, str]) -> serve.Application:
    """The Ray Serve application (`serve run octavo.ray_serve:build_app model=... num_replicas=2 ...`)."""
    args = {str(k): str(v) for k, v in args.items()}
    model = args.pop("model", None)
    if not model:
        raise InvalidRequestError("ray_serve needs model=PATH (an export folder, HF folder or .gguf every node can read)")
    deployment = {k: args.pop(k) for k in DEPLOYMENT_KEYS if k in args}
    engine_args_from_strings(model, args, where="ray_serve argument")  # refuse bad engine arguments here, not per replica
    names = tuple(deployment.get("served_model_name", model).split(","))
    app = serve.deployment(OctavoReplica, name="octavo", **deployment_options(deployment))
    return app.bind(model, args, names, deployment.get("api_key"))
