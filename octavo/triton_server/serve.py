"""Serve a written Triton model repository: a tritonserver whose HTTP listens on a private loopback port, and octavo's
checking front (front.py) on the public HTTP port, until Ctrl-C / SIGTERM or until tritonserver exits."""
from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path

from octavo.errors import BackendUnavailableError
from octavo.triton_server.front import MAX_BODY_BYTES, MAX_JSON_DEPTH, FrontConfig, start_front
from octavo.triton_server.launcher import TritonServer, free_port


@dataclass(slots=True)
class ServeOptions:
    """Where the server listens and what the front lets through (the `octavo triton` flags of the same names)."""

    host: str = "127.0.0.1"  # address the HTTP front, gRPC and metrics bind
    http_port: int = 8000  # octavo's checking front
    grpc_port: int = 8001  # tritonserver
    metrics_port: int = 8002  # tritonserver
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    log_verbose: int = 0  # tritonserver's --log-verbose level
    install_numpy: bool = False  # pip-install numpy<2 for the python-backend stub if it is missing


def serve_repository(repo: Path, workdir: Path, options: ServeOptions) -> int:
    """Start tritonserver on REPO (its stub environment and log in WORKDIR) behind the front; the exit code."""
    # tritonserver's HTTP listens on a private loopback port; the public one is octavo's checking front
    server = TritonServer(repo, workdir, http_port=free_port(), grpc_port=options.grpc_port,
                          metrics_port=options.metrics_port, http_host="127.0.0.1", grpc_host=options.host,
                          metrics_host=options.host, log_verbose=options.log_verbose,
                          auto_install_numpy=options.install_numpy)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM = Ctrl-C: stop the server, also while it starts
    try:
        print(f"starting tritonserver (its log: {workdir / 'tritonserver.log'})", flush=True)
        server.start()
        return asyncio.run(_serve_front(server, options))
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


async def _serve_front(server: TritonServer, options: ServeOptions) -> int:
    config = FrontConfig(upstream=f"http://{server.http_url}", max_body_bytes=options.max_body_bytes,
                         max_json_depth=options.max_json_depth)
    try:
        runner = await start_front(config, options.host, options.http_port)
    except OSError as exc:  # taken since the check
        raise BackendUnavailableError(f"cannot serve HTTP on {options.host}:{options.http_port}: "
                                      f"{exc.strerror or exc}; pick another --http-port") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C / SIGTERM: leave the loop, then stop tritonserver
        loop.add_signal_handler(sig, stop.set)
    print(f"tritonserver ready: HTTP {options.host}:{options.http_port}  gRPC {options.host}:{options.grpc_port}  "
          f"metrics {options.host}:{options.metrics_port}  (Ctrl-C stops it)", flush=True)
    try:
        while not stop.is_set() and server.process is not None and server.process.poll() is None:
            try:  # the process has no awaitable exit here; look again twice a second
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        if stop.is_set() or server.process is None:
            return 0
        code = server.process.returncode
        print(f"tritonserver exited with code {code}; its log: {server.log_path}", flush=True)
        return 0 if code in (0, -signal.SIGTERM) else 1
    finally:
        await runner.cleanup()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
