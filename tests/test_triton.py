"""octavo behind a REAL Triton Inference Server (the tritonserver bundled by nvidia-pytriton), queried with
NVIDIA's tritonclient over gRPC streaming and HTTP generate/generate_stream. The reference is octavo.LLM run
in this process on the same exported model (itself checked against HF transformers by the engine's tests)."""
from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from octavo.triton_server.launcher import pytriton_installed  # noqa: E402

# only its files are used (not importable without its deps); `make setup` puts it in its own --target folder
if not pytriton_installed():
    pytest.skip("tritonserver is not installed: make setup (or pip install --no-deps nvidia-pytriton==0.7.0)",
                allow_module_level=True)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc,http]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[grpc,http]'")

from octavo.triton_server.model_repository import render_config, write_model_repository  # noqa: E402
from octavo.errors import BackendUnavailableError, InvalidRequestError  # noqa: E402
from octavo.triton_server.launcher import TritonServer, free_port  # noqa: E402

MODEL = "octavo"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
MAX_CANCEL_TOKENS = 900  # far more than the ~1 s the cancellation test lets it run
LONG_TOKENS = 48  # the 16 concurrent streams run long enough to overlap however the arrivals are spread
NUM_BLOCKS = 128
PROMPTS16 = [f"{w} request {i}: the capital of France" for i, w in enumerate(
    ["Paris", "Once upon", "Translate", "def fib", "Write an", "Solve", "memory", "engine",
     "Hello", "naive", "emoji", "lazy dog", "history", "paging", "quick", "today"])]

TYPES = {"text_input": "BYTES", "stop_words": "BYTES", "max_tokens": "INT32", "top_k": "INT32", "min_tokens": "INT32",
         "seed": "INT64", "stream": "BOOL", "ignore_eos": "BOOL", "exclude_input_in_output": "BOOL"}


# ---- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(hf_model_dir, tmp_path_factory) -> Path:  # noqa: ANN001
    from octavo.export import export_model

    out = tmp_path_factory.mktemp("triton_export") / "model"
    export_model(hf_model_dir("llama"), out, progress=False)
    return out


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:  # noqa: ANN001
    """The engine's per-step trace rows (EngineArgs.trace_path, a config.pbtxt parameter) land here."""
    return tmp_path_factory.mktemp("triton_trace") / "trace.jsonl"


@pytest.fixture(scope="module")
def server(exported: Path, trace: Path, tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("triton")
    repo = write_model_repository(root / "repo", exported, parameters={
        "num_threads": "1", "num_blocks": str(NUM_BLOCKS), "block_size": "16", "trace_path": str(trace)})
    for attempt in (1, 2):  # on a loaded machine the python backend's 1 s stub health check can miss once
        srv = TritonServer(repo, root / f"work{attempt}", http_port=free_port(), grpc_port=free_port(),
                           metrics_port=free_port(), auto_install_numpy=True)
        try:
            srv.start(timeout_s=120)
            break
        except BackendUnavailableError as exc:
            if attempt == 2 or "is not healthy" not in str(exc):
                raise
            print(f"tritonserver start failed once, retrying: {exc}")
    try:
        yield srv
    finally:
        code = srv.stop()
        print(srv.log_tail(3000))
        assert code is not None


@pytest.fixture(scope="module")
def offline(exported: Path):  # noqa: ANN201
    """octavo.LLM on the same export, in this process (no Triton): the reference."""
    from octavo import LLM

    llm = LLM(str(exported), num_threads=1, num_blocks=NUM_BLOCKS)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def reference(offline) -> dict[str, str]:  # noqa: ANN001
    """Greedy text of octavo.LLM: PROMPT with MAX_TOKENS, PROMPTS16 with LONG_TOKENS."""
    from octavo import SamplingParams

    prompts = [PROMPT, *PROMPTS16]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS if p == PROMPT else LONG_TOKENS, ignore_eos=True)
              for p in prompts]
    outs = offline.generate(prompts, params, use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(prompts, outs)}


# ---- helpers -------------------------------------------------------------------------------------------
def grpc_inputs(**values) -> list:  # noqa: ANN003
    inputs = []
    for name, value in values.items():
        kind = TYPES.get(name, "FP32")
        if kind == "BYTES":
            items = value if isinstance(value, list) else [value]
            array = np.array([s.encode() for s in items], dtype=np.object_)
        else:
            array = np.array([value], dtype={"INT32": np.int32, "INT64": np.int64, "BOOL": bool, "FP32": np.float32}[kind])
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def greedy(prompt: str, **extra) -> dict:  # noqa: ANN003
    return dict(text_input=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **extra)


class Stream:
    """A gRPC bidirectional stream collecting (request id, text, num_output_tokens, final, error) per response."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._on_result)

    def _on_result(self, result, error) -> None:  # noqa: ANN001
        if error is not None:
            self.results.put({"id": None, "error": str(error)})
            return
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        text = result.as_numpy("text_output")
        n_out = result.as_numpy("num_output_tokens")
        self.results.put({
            "id": response.id, "error": None, "final": bool(final.bool_param) if final is not None else False,
            "text": text.reshape(-1)[0].decode() if text is not None else None,
            "n_out": int(n_out.reshape(-1)[0]) if n_out is not None else None,
            "reason": (result.as_numpy("finish_reason").reshape(-1)[0].decode()
                       if result.as_numpy("finish_reason") is not None else None),
            "time": time.monotonic(),
        })

    def send(self, request_id: str, **values) -> None:  # noqa: ANN003
        self.client.async_stream_infer(MODEL, grpc_inputs(**values), request_id=request_id,
                                       enable_empty_final_response=True)

    def collect(self, ids: set[str], timeout_s: float = 60.0) -> dict[str, list[dict]]:
        """Responses per request id until every id in IDS saw its final response."""
        got: dict[str, list[dict]] = {i: [] for i in ids}
        open_ids = set(ids)
        deadline = time.monotonic() + timeout_s
        while open_ids:
            item = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            assert item["error"] is None, item["error"]
            got[item["id"]].append(item)
            if item["final"]:
                open_ids.discard(item["id"])
        return got

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def http_post(server: TritonServer, endpoint: str, body: dict) -> tuple[int, str]:
    url = f"http://{server.http_url}/v2/models/{MODEL}/{endpoint}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:  # no answer at all: the server's log says why
        raise AssertionError(f"POST {url} got no response ({exc}); {server_log_tail(server)}") from exc


def server_log_tail(server: TritonServer, lines: int = 40) -> str:
    """The last LINES of the server's log, and whether its process still runs (for a failure message)."""
    state = "running" if server.process is not None and server.process.poll() is None else "not running"
    path = server.log_path
    if path is None or not Path(path).is_file():
        return f"tritonserver is {state}; no log"
    tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
    return f"tritonserver is {state}; the end of {path}:\n" + "\n".join(tail)


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in body.splitlines() if line.startswith("data:")]


def trace_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def engine_metrics(server: TritonServer) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise AssertionError(f"/metrics got no response ({exc}); {server_log_tail(server)}") from exc
    out = {}
    for line in text.splitlines():
        if line.startswith("octavo_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0][len("octavo_"):]] = float(value)
    return out


def wait_for(predicate, timeout_s: float = 120.0, interval_s: float = 0.05):  # noqa: ANN001, ANN201
    """PREDICATE's first truthy value, or its last one at the deadline (which only bounds a failure: a loaded
    2-core machine is slow). A refused or reset connection counts as "not yet": the metrics port may open a
    moment after the server reports ready (seen once in CI: URLError, connection refused)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except OSError:  # urllib's URLError included
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# ---- tests ---------------------------------------------------------------------------------------------
def test_health_and_ready_endpoints(server: TritonServer) -> None:
    http = httpclient.InferenceServerClient(server.http_url)
    assert http.is_server_live() and http.is_server_ready() and http.is_model_ready(MODEL)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready(MODEL)
    config = grpc.get_model_config(MODEL, as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert int(config.get("max_batch_size", 0)) == 0
    grpc.close()
    http.close()


def test_grpc_stream_is_incremental_and_matches_llm(server: TritonServer, reference: dict[str, str]) -> None:
    stream = Stream(server.grpc_url)
    try:
        stream.send("g1", **greedy(PROMPT, stream=True, exclude_input_in_output=True))
        responses = stream.collect({"g1"})["g1"]
    finally:
        stream.close()
    assert len(responses) > 1, "tokens must arrive in several responses"
    assert [r["final"] for r in responses] == [False] * (len(responses) - 1) + [True]
    counts = [r["n_out"] for r in responses]
    assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
    assert responses[-1]["reason"] == "length"
    assert "".join(r["text"] for r in responses) == reference[PROMPT]


def test_http_generate_matches_llm(server: TritonServer, reference: dict[str, str]) -> None:
    status, body = http_post(server, "generate", greedy(PROMPT))
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"] == PROMPT + reference[PROMPT]  # exclude_input_in_output defaults to false
    assert out["num_output_tokens"] == MAX_TOKENS and out["finish_reason"] == "length"
    status, body = http_post(server, "generate", greedy(PROMPT, exclude_input_in_output=True))
    assert status == 200 and json.loads(body)["text_output"] == reference[PROMPT]


def test_num_cached_tokens_reports_prefix_cache_hits(server: TritonServer) -> None:
    """The second request with the same 40-word prompt finds its full 16-token blocks in the prefix cache;
    num_cached_tokens says how many prompt tokens that was (the engine's count for this request)."""
    prompt = " ".join(f"cached{i}" for i in range(40))
    outs = []
    for _ in range(2):
        status, body = http_post(server, "generate", greedy(prompt, exclude_input_in_output=True))
        assert status == 200, body
        outs.append(json.loads(body))
    first, second = outs
    assert first["num_cached_tokens"] == 0
    n = second["num_input_tokens"]
    assert second["num_cached_tokens"] == (n - 1) // 16 * 16 > 0  # every full block but the last prompt token's
    assert second["text_output"] == first["text_output"]


def test_http_generate_stream(server: TritonServer, reference: dict[str, str]) -> None:
    status, body = http_post(server, "generate_stream", greedy(PROMPT, stream=True))
    assert status == 200, body
    events = sse_events(body)
    assert len(events) > 1
    assert events[0]["text_output"].startswith(PROMPT)
    assert "".join(e["text_output"] for e in events) == PROMPT + reference[PROMPT]
    assert events[-1]["finish_reason"] == "length" and all(e["finish_reason"] == "" for e in events[:-1])


def test_16_concurrent_streams_are_batched_in_flight(server: TritonServer, reference: dict[str, str],
                                                    trace: Path) -> None:
    before = len(trace_rows(trace))
    stream = Stream(server.grpc_url)
    try:
        for i, prompt in enumerate(PROMPTS16):
            stream.send(f"c{i}", **{**greedy(prompt, stream=True, exclude_input_in_output=True),
                                    "max_tokens": LONG_TOKENS})
        got = stream.collect({f"c{i}" for i in range(16)}, timeout_s=90)
    finally:
        stream.close()
    for i, prompt in enumerate(PROMPTS16):  # batch invariance: same text as the offline engine
        assert "".join(r["text"] for r in got[f"c{i}"]) == reference[prompt], prompt
    rows = trace_rows(trace)[before:]
    max_batch = max(r["batch_size"] for r in rows)
    assert max_batch >= 4, f"requests were not batched in flight (max batch size {max_batch})"
    mixed = [r for r in rows if {q["phase"] for q in r["requests"]} == {"prefill", "decode"}]
    assert rows[-1]["free_blocks"] == rows[-1]["total_blocks"] == NUM_BLOCKS
    assert wait_for(lambda: engine_metrics(server).get("max_batch_size", 0) >= max_batch)
    print(f"max batch {max_batch}, {len(rows)} steps, {len(mixed)} mixing prefill and decode")


def test_cancelled_stream_frees_its_blocks(server: TritonServer, trace: Path) -> None:
    stream = Stream(server.grpc_url)
    try:
        stream.send("long", text_input=PROMPT * 4, max_tokens=MAX_CANCEL_TOKENS, ignore_eos=True, stream=True)
        first = [stream.results.get(timeout=30) for _ in range(3)]
        assert all(r["error"] is None and not r["final"] for r in first), first
    finally:
        stream.close(cancel=True)
    freed = wait_for(lambda: (m := engine_metrics(server)).get("num_running") == 0
                     and m.get("free_blocks") == NUM_BLOCKS)
    assert freed, f"blocks not freed after cancellation: {engine_metrics(server)}"
    rows = [r for r in trace_rows(trace) if any(q["id"].endswith("-long") for q in r["requests"])]
    mine = [q for r in rows for q in r["requests"] if q["id"].endswith("-long")]
    assert max(q["blocks"] for q in mine) >= 2, "the running request should have held KV blocks"
    assert max(q["output_len"] for q in mine) < MAX_CANCEL_TOKENS, "the cancelled request must stop early"
    print(f"cancelled after {max(q['output_len'] for q in mine)} tokens")


def test_bad_request_errors_while_a_good_one_completes(server: TritonServer, reference: dict[str, str]) -> None:
    stream = Stream(server.grpc_url)
    try:
        stream.send("good", **greedy(PROMPT, stream=True, exclude_input_in_output=True))
        status, body = http_post(server, "generate", dict(text_input=PROMPT, top_p=5.0))
        assert status == 400 and "top_p" in body, body
        status, body = http_post(server, "generate", dict(max_tokens=3))
        assert status == 400, body  # text_input missing
        stream.send("bad", text_input=PROMPT, temperature=-1.0)
        good, errors = [], []
        deadline = time.monotonic() + 60
        while not (errors and good and good[-1]["final"]) and time.monotonic() < deadline:
            item = stream.results.get(timeout=30)
            (errors if item["error"] is not None else good).append(item)
        assert len(errors) == 1 and "temperature" in errors[0]["error"], errors
        assert good and good[-1]["final"] and {r["id"] for r in good} == {"good"}
        assert "".join(r["text"] for r in good) == reference[PROMPT]
    finally:
        stream.close()


def test_sampling_inputs_reach_the_engine(server: TritonServer, offline, reference: dict[str, str]) -> None:  # noqa: ANN001
    from octavo import SamplingParams

    knobs = dict(temperature=0.9, top_k=40, top_p=0.9, seed=1234, repetition_penalty=1.2, presence_penalty=0.5,
                 frequency_penalty=0.4)
    want = offline.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **knobs),
                            use_tqdm=False)[0].outputs[0].text
    status, body = http_post(server, "generate", dict(text_input=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      exclude_input_in_output=True, **knobs))
    assert status == 200, body
    assert json.loads(body)["text_output"] == want  # seeded sampling is reproducible across both paths
    assert want != reference[PROMPT]  # and the knobs did change the text
    greedy_text = reference[PROMPT]
    stop = greedy_text[len(greedy_text) // 2:len(greedy_text) // 2 + 2]
    want_stop = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                        stop=[stop]), use_tqdm=False)[0].outputs[0]
    status, body = http_post(server, "generate", greedy(PROMPT, stop_words=[stop], exclude_input_in_output=True))
    out = json.loads(body)
    assert status == 200 and out["text_output"] == want_stop.text and out["finish_reason"] == "stop", body
    assert len(out["text_output"]) < len(greedy_text)


def test_repository_generator(tmp_path: Path) -> None:
    repo = write_model_repository(tmp_path / "repo", tmp_path / "model", parameters={"max_num_seqs": 8},
                                  instance_count=2)
    config = (repo / MODEL / "config.pbtxt").read_text()
    assert f'key: "model_path" value: {{ string_value: "{(tmp_path / "model").resolve()}" }}' in config
    assert 'key: "max_num_seqs" value: { string_value: "8" }' in config
    assert "count: 2" in config and (repo / MODEL / "1" / "model.py").is_file()
    with pytest.raises(InvalidRequestError):
        render_config(config, {"no_such_knob": "1"})


def test_cli_writes_a_repository(exported: Path, tmp_path: Path) -> None:
    from octavo.cli import main

    assert main(["triton", str(exported), "--repo-out", str(tmp_path / "r"), "--no-serve", "--num-threads", "2",
                 "--instances", "3"]) == 0
    config = (tmp_path / "r" / MODEL / "config.pbtxt").read_text()
    assert f'string_value: "{exported.resolve()}"' in config and "count: 3" in config
    assert 'key: "num_threads" value: { string_value: "2" }' in config


# ---- engine parameters: every EngineArgs field is a config.pbtxt parameter ----------------------------------
def _lines_until(proc, marker: str, timeout_s: float) -> list[str]:  # noqa: ANN001
    """Lines of PROC's stdout until one contains MARKER (read on a thread; fails on exit or timeout)."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout_s) and any(marker in ln for ln in lines), "".join(lines)[-4000:]
    return lines


def test_cli_weights_int4_serves_the_int4_export(hf_model_dir, reference: dict[str, str], tmp_path: Path,  # noqa: ANN001
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`octavo triton HF --weights int4` (weights was not a parameter before: the fp32 export was served, or the
    load failed) exports the int4 variant and serves it: config.pbtxt points at an export whose manifest says
    int4, and Triton's greedy text equals octavo.LLM's on that export, not the fp32 model's. (int4, not int8:
    on BlockMatMul int8's greedy text equals fp32's on this prompt, so int8 could not tell them apart.)"""
    import os
    import signal
    import subprocess
    import sys

    from octavo import LLM, SamplingParams
    from octavo.export.manifest import Manifest

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))  # the CLI and the reference share one export
    hf = hf_model_dir("llama")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo", "triton", str(hf), "--weights", "int4", "--num-threads", "1",
         "--num-blocks", str(NUM_BLOCKS), "--repo-out", str(tmp_path / "repo"), "--workdir", str(tmp_path / "work"),
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
         "--install-numpy"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _lines_until(proc, "tritonserver ready", 240)
        config = (tmp_path / "repo" / MODEL / "config.pbtxt").read_text()
        assert 'key: "weights" value: { string_value: "int4" }' in config
        model_path = Path(config.split('key: "model_path" value: { string_value: "')[1].split('"')[0])
        assert Manifest.load(model_path).weights == "int4"
        srv = TritonServer(tmp_path / "repo", tmp_path / "work", http_port=http_port)
        status, body = http_post(srv, "generate", greedy(PROMPT, exclude_input_in_output=True))
        assert status == 200, body
        served = json.loads(body)["text_output"]
    finally:
        proc.send_signal(signal.SIGTERM)  # = Ctrl-C: the command stops its tritonserver
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    llm = LLM(str(hf), weights="int4", num_threads=1, num_blocks=NUM_BLOCKS)
    try:
        assert llm.engine.model_dir == model_path
        want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        llm.close()
    assert want != reference[PROMPT], "int4 and fp32 agree on this prompt: the check could not tell them apart"
    assert served == want


def test_unknown_parameter_fails_the_load_naming_it(exported: Path, tmp_path: Path) -> None:
    repo = write_model_repository(tmp_path / "repo", exported, parameters={"num_threads": "1", "num_blocks": "16"})
    config = repo / MODEL / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "no_such_knob" value: { string_value: "1" } }\n')
    srv = TritonServer(repo, tmp_path / "work", http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port(), auto_install_numpy=True)
    with pytest.raises(BackendUnavailableError) as err:
        srv.start(timeout_s=120)
    assert "unknown config.pbtxt parameter 'no_such_knob'" in str(err.value), str(err.value)[-3000:]


# ---- a client that drops its HTTP stream -----------------------------------------------------------------
def test_dropped_http_generate_stream_cancels_and_frees_blocks(server: TritonServer, trace: Path) -> None:
    """A raw HTTP client reads three SSE events of a 900-token generate_stream and closes its socket."""
    import socket

    wait_for(lambda: engine_metrics(server).get("num_running") == 0)
    before = len(trace_rows(trace))
    body = json.dumps(dict(text_input=PROMPT * 4, max_tokens=MAX_CANCEL_TOKENS, ignore_eos=True, stream=True,
                           exclude_input_in_output=True)).encode()
    head = (f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: {server.http_url}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(head + body)
        got = b""
        while got.count(b"data:") < 3:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    assert b" 200 " in got.split(b"\r\n", 1)[0], got[:200]
    freed = wait_for(lambda: (m := engine_metrics(server)).get("num_running") == 0
                     and m.get("free_blocks") == NUM_BLOCKS, timeout_s=60)
    assert freed, f"blocks not freed after the client left: {engine_metrics(server)}"
    mine = [q for r in trace_rows(trace)[before:] for q in r["requests"]]
    assert mine and max(q["blocks"] for q in mine) >= 2
    generated = max(q["output_len"] for q in mine)
    print(f"dropped HTTP stream: the engine generated {generated} of {MAX_CANCEL_TOKENS} tokens")
    assert generated < MAX_CANCEL_TOKENS, "the request ran to max_tokens after its client left"


def test_a_field_added_to_engine_args_later_reaches_the_engine(exported: Path, tmp_path: Path) -> None:
    """kv_cache_dtype was added to EngineArgs after the Triton model was written; as a derived parameter it
    reaches the engine: the same kv_cache_memory holds twice the blocks with float16 pools (octavo_total_blocks,
    against the byte count the manifest gives)."""
    from octavo.export.manifest import Manifest

    manifest = Manifest.load(exported)
    fp32_blocks = 40
    memory = fp32_blocks * manifest.kv_bytes_per_block(16, "float32")
    assert memory // manifest.kv_bytes_per_block(16, "float16") == 2 * fp32_blocks
    repo = write_model_repository(tmp_path / "repo", exported, parameters={
        "num_threads": "1", "kv_cache_memory": str(memory), "kv_cache_dtype": "float16"})
    srv = TritonServer(repo, tmp_path / "work", http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port(), auto_install_numpy=True)
    srv.start(timeout_s=120)
    try:
        assert wait_for(lambda: engine_metrics(srv).get("total_blocks") == 2 * fp32_blocks), engine_metrics(srv)
        status, body = http_post(srv, "generate", greedy(PROMPT))
        assert status == 200 and json.loads(body)["num_output_tokens"] == MAX_TOKENS, body
    finally:
        srv.stop()


def test_structured_output_request_parameters(server: TritonServer) -> None:
    """The output constraint as a request parameter (the generate body's extra fields), as on the HTTP API."""
    import re

    for extra, ok in [({"guided_regex": "[0-9]{4}-[a-c]{2}"}, lambda t: re.fullmatch("[0-9]{4}-[a-c]{2}", t)),
                      ({"structured_outputs": json.dumps({"choice": ["red", "green"]})}, lambda t: t in ("red", "green")),
                      ({"guided_json": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                   "required": ["a"], "additionalProperties": False})},
                       lambda t: set(json.loads(t)) == {"a"})]:
        status, body = http_post(server, "generate", dict(text_input=PROMPT, max_tokens=40, temperature=1.0, seed=3,
                                                          exclude_input_in_output=True, **extra))
        out = json.loads(body)
        assert status == 200 and out["finish_reason"] == "stop" and ok(out["text_output"]), body
    status, body = http_post(server, "generate", dict(text_input=PROMPT, guided_regex="[a-"))
    assert status == 400 and "guided_regex" in body, body
