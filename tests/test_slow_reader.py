"""Issue 17.2: a client that stops reading costs bounded memory. What an AsyncEngine.generate consumer has
not read is coalesced into one pending output; one that falls more than max_unread_entries behind is
aborted. Checked on the engine (exact: one coalesced output, then the abort) and through the HTTP server
with a socket that never reads (RSS flat, the request aborted, other clients served)."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from toy_backend import ToyBackend, make_toy_model_dir, toy_greedy

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.sampling_params import SamplingParams
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _wait(cond, what: str, timeout: float = 300.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_unread_deltas_are_coalesced_into_one_output_then_aborted(tmp_path) -> None:  # noqa: ANN001
    toy = make_toy_model_dir(tmp_path, max_context=4096)
    prompt = [5, 6, 7]
    cap = 400

    async def main() -> None:
        eng = AsyncEngine(EngineArgs(model=str(toy), block_size=4), ToyBackend(2048, 4), max_unread_entries=cap)
        await eng.start()
        params = SamplingParams(n=2, temperature=0.0, max_tokens=4000, ignore_eos=True, logprobs=2, output_kind="delta")
        gen = eng.generate({"prompt_token_ids": prompt}, params, "slow")
        first = await gen.__anext__()
        # the consumer stops reading; wait (for the state, not for a time) until the engine has let go of it
        await asyncio.to_thread(_wait, lambda: eng.stats().generation_tokens_total > 0
                                and eng.stats().num_running == 0 and eng.stats().num_waiting == 0, "the abort")
        rest = [o async for o in gen]
        assert len(rest) == 1, "unread outputs are coalesced into one"
        last = rest[0]
        assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
        unread = sum(len(c.token_ids) + sum(len(d) for d in c.logprobs or []) for c in last.outputs)
        assert unread <= cap + 2 * 4, unread  # the cap, plus at most the step that crossed it
        for i in range(2):
            ids = [t for o in [first, last] for c in o.outputs if c.index == i for t in c.token_ids]
            assert ids == toy_greedy(prompt, len(ids)) and len(ids) < 4000
        await eng.shutdown()

    asyncio.run(main())


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):  # noqa: ANN001, ANN201
    from models import make_random_model

    from octavo.export import export_model

    root = tmp_path_factory.mktemp("long_context")
    src = make_random_model(root / "hf", "llama", max_position_embeddings=8192)
    export_model(src, root / "octavo", progress=False)
    return root / "octavo"


def test_a_client_that_never_reads_its_stream_keeps_server_memory_flat(long_folder) -> None:  # noqa: ANN001
    """n=8, logprobs=5, 4,000 tokens each, and a socket that never reads: before, every step queued a full
    cumulative copy for it (hundreds of MiB here, GiB in the attack run); now the server's socket buffer
    fills, its handler waits, the unread deltas are coalesced and the request is aborted at the cap."""
    ea = EngineArgs(model=str(long_folder), num_blocks=2200, block_size=16, max_num_seqs=16, num_threads=1)
    srv = OpenAIServer(ServerConfig(served_model_names=("tiny",)),
                       lambda: AsyncEngine(ea, max_unread_entries=5_000), shutdown_timeout=5)
    with ServerThread(srv) as s:
        eng = srv.state.engine
        httpx.post(s.base_url + "/v1/completions", json={"prompt": "warm", "max_tokens": 4}, timeout=60)
        rss0 = _rss_mib()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((s.host, s.port))
        body = json.dumps({"model": "tiny", "prompt": "tell me everything", "max_tokens": 4000, "n": 8, "logprobs": 5,
                           "stream": True, "ignore_eos": True, "temperature": 1.0, "seed": 1}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            start = eng.stats().generation_tokens_total
            _wait(lambda: eng.stats().generation_tokens_total > start and eng.stats().num_running == 0
                  and eng.stats().num_waiting == 0, "the never-reading request to end")
            generated = eng.stats().generation_tokens_total - start
            assert generated < 8 * 4000, "it ran to the end: nothing bounded what it buffered"
            grown = _rss_mib() - rss0
            assert grown < 100, f"RSS grew {grown:.0f} MiB"
            r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "still there?", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200  # everyone else is still served
        finally:
            sock.close()
        _wait(lambda: eng.stats().num_free_blocks == eng.stats().num_total_blocks, "its blocks to be freed")
