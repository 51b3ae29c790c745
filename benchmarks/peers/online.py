"""Online latency: start a server process, replay a workload with Poisson arrivals through
`octavo bench serve`'s client (/v1/completions, streaming), report TTFT / TPOT percentiles."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.peers.memory import ServerPeak
from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server_process(cmd: list[str], base_url: str, timeout_s: float = 300.0,
                   env: dict[str, str] | None = None, peak: ServerPeak | None = None) -> Iterator[subprocess.Popen]:
    """Run CMD until GET {base_url}/health answers 200; stop it (SIGTERM, then SIGKILL) afterwards.
    PEAK, if given, gets the server's own peak RSS (its process tree's VmHWM, read just before the stop)."""
    log = tempfile.NamedTemporaryFile("w+", prefix="peer-server-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode} before it was ready: "
                                   f"{_tail(log.name)}")
            try:
                with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{Path(cmd[0]).name} not ready after {timeout_s:.0f} s: {_tail(log.name)}")
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            if peak is not None:
                peak.read(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if peak is not None:
            peak.after_wait()
        log.close()
        os.unlink(log.name)


def _tail(path: str, lines: int = 3) -> str:
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def poisson_run(peer: str, base_url: str, workload: IdWorkload, rate: float, seed: int = 0,
                model: str | None = None) -> PeerResult:
    """Send the workload at RATE requests/s (Poisson); TTFT/TPOT/E2E p50 and p99 go to extra."""
    from octavo.bench.report import summarize
    from octavo.bench.serve_client import ServeBenchConfig, run_serve_bench
    from octavo.bench.workloads import BenchRequest

    reqs = [BenchRequest(r.prompt, r.max_tokens, True, f"{workload.name}-{i}") for i, r in enumerate(workload.requests)]
    cfg = ServeBenchConfig(base_url=base_url, model=model, request_rate=rate, seed=seed, temperature=0.0)
    results, duration, _ = asyncio.run(run_serve_bench(cfg, reqs))
    s = summarize(results, duration, percentiles=(50.0, 99.0))
    failed = [e for e in s["errors"] if e]
    res = PeerResult(peer, f"{workload.name}@{rate:g}rps", len(reqs), workload.prompt_tokens,
                     output_tokens=int(s["total_output_tokens"]), elapsed_s=float(duration),
                     generated_tokens=int(s["total_output_tokens"]))
    keys = [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "e2el") for stat in ("p50", "p99", "mean")]
    res.extra: dict[str, Any] = {k: s[k] for k in keys if k in s}
    res.extra.update(request_rate=rate, completed=s["completed"], failed=s["failed"])
    if failed:
        res.extra["first_error"] = failed[0]
    return res
