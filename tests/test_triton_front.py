"""`octavo triton` with a REAL tritonserver: it binds loopback by default, a body nested 100,000 deep is refused by
octavo's HTTP front (tritonserver's own parser dies of SIGSEGV on it; 30,000 still gets a 400 there), normal
requests (generate, generate_stream) pass through unchanged, taken ports are named before anything starts, and
a server that fails to start shows its error lines."""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from engine_helpers import exported

from octavo.triton_server.front import MAX_JSON_DEPTH, json_depth
from octavo.triton_server.launcher import pytriton_installed

needs_triton = pytest.mark.skipif(not pytriton_installed(),
                                  reason="tritonserver is not installed: pip install --no-deps nvidia-pytriton==0.7.0")
PROMPT = "The quick brown fox"


def test_json_depth_counts_brackets_outside_strings() -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}', 10) == 3
    assert json_depth(b'"\\"[[[["', 10) == 0  # an escaped quote does not end the string
    assert json_depth(b"[" * 100_000, 64) == 65  # stops counting once past the limit
    assert json_depth(b'{"inputs": [{"name": "x", "data": [[1, 2], [3, 4]]}]}', MAX_JSON_DEPTH) == 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _address(hexaddr: str) -> str:
    """/proc/net/tcp's address (32-bit words in host order, little-endian here) as text; ::ffff:a.b.c.d as a.b.c.d."""
    raw = b"".join(bytes.fromhex(hexaddr[i:i + 8])[::-1] for i in range(0, len(hexaddr), 8))
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw))
    v6 = ipaddress.IPv6Address(raw)
    return str(v6.ipv4_mapped or v6)


def _listening(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on PORT (from /proc/net/tcp and tcp6)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:  # 0A = LISTEN
                found.add(_address(addr))
    return found


def _post(url: str, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _deep(depth: int) -> bytes:
    return b'{"text_input": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 4}'


@pytest.fixture(scope="module")
def model(hf_model_dir) -> Path:  # noqa: ANN001
    return exported(hf_model_dir("llama"))


@pytest.fixture(scope="module")
def triton_cli(model: Path, tmp_path_factory):  # noqa: ANN001, ANN201
    """`octavo triton MODEL` as a user runs it (default --host), on free ports; yields (ports, process)."""
    if not pytriton_installed():
        pytest.skip("tritonserver is not installed: pip install --no-deps nvidia-pytriton==0.7.0")
    tmp = tmp_path_factory.mktemp("triton_front")
    ports = {"http": _free_port(), "grpc": _free_port(), "metrics": _free_port()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo", "triton", str(model), "--num-threads", "1", "--num-blocks", "64",
         "--repo-out", str(tmp / "repo"), "--workdir", str(tmp / "work"), "--install-numpy",
         "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "tritonserver ready" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(240) and proc.poll() is None, "".join(lines)[-4000:]
    try:
        yield ports, proc, lines, tmp
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@needs_triton
def test_binds_loopback_only_by_default(triton_cli) -> None:  # noqa: ANN001
    ports, proc, lines, tmp = triton_cli
    for name, port in ports.items():
        assert _listening(port) == {"127.0.0.1"}, (name, _listening(port))
    log = (tmp / "work" / "tritonserver.log").read_text(errors="replace")
    assert "0.0.0.0" not in log, [ln for ln in log.splitlines() if "0.0.0.0" in ln]  # tritonserver's own port too
    assert f"HTTP 127.0.0.1:{ports['http']}" in "".join(lines)


@needs_triton
def test_a_100k_deep_body_is_refused_and_the_server_keeps_serving(triton_cli) -> None:  # noqa: ANN001
    ports, proc, _, _ = triton_cli
    url = f"http://127.0.0.1:{ports['http']}/v2/models/octavo/generate"
    status, body = _post(url, _deep(100_000))
    assert status == 400 and b"nests deeper than" in body, (status, body[:300])
    status, body = _post(url, b"[" * 100_000)  # not even valid JSON: refused the same way
    assert status == 400, status
    assert proc.poll() is None
    status, body = _post(url, _deep(MAX_JSON_DEPTH - 2))  # within the limit: Triton itself answers (a 400)
    assert status == 400 and b"nests deeper" not in body, body[:300]
    good = json.dumps({"text_input": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}).encode()
    status, body = _post(url, good)
    assert status == 200 and json.loads(body)["num_output_tokens"] == 6, body[:300]
    assert proc.poll() is None


@needs_triton
def test_generate_stream_passes_through_the_front_as_server_sent_events(triton_cli, model: Path) -> None:  # noqa: ANN001
    from octavo import LLM, SamplingParams

    ports, _, _, _ = triton_cli
    body = json.dumps({"text_input": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "exclude_input_in_output": True}).encode()
    status, raw = _post(f"http://127.0.0.1:{ports['http']}/v2/models/octavo/generate_stream", body)
    assert status == 200, raw[:300]
    events = [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]
    assert len(events) >= 2, raw[:500]
    llm = LLM(str(model), num_threads=1, num_blocks=64)
    try:
        want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        llm.close()
    assert "".join(e["text_output"] for e in events) == want


@needs_triton
def test_a_taken_port_is_named_before_tritonserver_starts(model: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "octavo", "triton", str(model), "--repo-out", str(tmp_path / "repo"),
             "--workdir", str(tmp_path / "work"), "--http-port", str(_free_port()), "--grpc-port", str(port),
             "--metrics-port", str(_free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"gRPC 127.0.0.1:{port} (Address already in use)" in proc.stderr, proc.stderr
    assert not (tmp_path / "work" / "tritonserver.log").exists()  # refused before starting anything


@needs_triton
def test_a_failed_start_shows_tritonservers_error_lines(tmp_path: Path) -> None:
    from octavo.errors import BackendUnavailableError
    from octavo.triton_server.launcher import TritonServer

    srv = TritonServer(tmp_path / "no-such-repo", tmp_path / "work", http_port=_free_port(), grpc_port=_free_port(),
                       metrics_port=_free_port(), auto_install_numpy=True)
    with pytest.raises(BackendUnavailableError) as err:
        srv.start(timeout_s=120)
    message = str(err.value)
    head = message.split("the end of its log")[0]
    assert "its errors:" in head and "no-such-repo" in head, message[:2000]
