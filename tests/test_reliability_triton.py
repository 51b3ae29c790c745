"""`octavo triton` shutdown after many cancelled gRPC streams (issue 17 item 7), against a real tritonserver.

600 requests on ~134 gRPC streams; 70% of the streams are closed with `stop_stream(cancel_requests=True)` after a
random number (0-3) of responses, the rest are drained. Then octavo must hold nothing (its gauges: 0 running,
0 waiting, every KV block free) and SIGTERM must end tritonserver within its exit timeout: with the model
unloaded (octavo's finalize() ran, exit 0), or — the known tritonserver 2.51 defect, docs/triton.md "Shutdown
after cancelled streams" — exit 1 with exactly one model left loaded, which `TritonServer.stop()` names,
after which no stub process and no shared-memory region is left and a fresh server on the same repository
serves. Only that exact signature is an xfail; anything else fails. Slow (~40-60 s).

The degradation itself (a model left loaded at exit is named, bounded by the exit timeout, cleaned up, and the
same ports serve again at once) is also checked deterministically, without the race, by a tiny decoupled model
that never sends its final response: `test_a_model_left_loaded_at_exit_is_named_and_cleaned_up` (default suite)."""
from __future__ import annotations

import logging
import queue
import random
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from octavo.triton_server.launcher import pytriton_installed  # noqa: E402

if not pytriton_installed():
    pytest.skip("tritonserver is not installed: make setup (or pip install --no-deps nvidia-pytriton==0.7.0)",
                allow_module_level=True)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc,http]'")

from octavo.triton_server.model_repository import write_model_repository  # noqa: E402
from octavo.triton_server.launcher import TritonServer, free_port  # noqa: E402

REQUESTS = 600
CANCEL_SHARE = 0.7
FINALIZED = "stopped; max batch size seen"  # the line octavo's finalize() logs
EXIT_TIMEOUT_S = 3  # tritonserver's own wait on SIGTERM; short, since octavo holds nothing by then
KNOWN_DEFECT = ("tritonserver 2.51's frontend kept a request of a cancelled stream, so the model "
                "never unloaded (reproduced with a trivial decoupled model, no octavo; "
                "docs/triton.md, 'Shutdown after cancelled streams')")


def _inputs(prompt: str, max_tokens: int) -> list:
    out = []
    for name, arr, kind in (("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                            ("max_tokens", np.array([max_tokens], np.int32), "INT32"),
                            ("stream", np.array([True]), "BOOL"), ("ignore_eos", np.array([True]), "BOOL")):
        t = grpcclient.InferInput(name, list(arr.shape), kind)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _gauges(srv: TritonServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split("{")[0][len("octavo_"):]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("octavo_")}


def _wait_until(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _octavo_idle(srv: TritonServer) -> bool:
    g = _gauges(srv)
    return bool(g) and g["num_running"] == 0 and g["num_waiting"] == 0 and g["free_blocks"] == g["total_blocks"]


def _group_alive(pgid: int) -> bool:
    """Whether a process of group PGID still runs (a killed one that is only waiting to be reaped does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _one_stream(srv: TritonServer) -> str:
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("octavo", _inputs("hello again", 8), request_id="after")
    client.stop_stream()  # drains: waits for the final response
    client.close()
    texts = []
    while not got.empty():
        result, error = got.get()
        assert error is None, error
        texts.append(result.as_numpy("text_output")[0].decode())
    return "".join(texts)


@pytest.mark.slow
def test_shutdown_after_many_cancelled_streams(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    from octavo.export import export_model

    exported = tmp_path / "export"
    export_model(hf_model_dir("llama"), exported, progress=False)
    repo = write_model_repository(tmp_path / "repo", exported,
                                  parameters={"num_threads": "1", "num_blocks": "256", "block_size": "16"})
    srv = TritonServer(repo, tmp_path / "work", http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port(), auto_install_numpy=True, exit_timeout_s=EXIT_TIMEOUT_S)
    srv.start(timeout_s=180)
    rng = random.Random(0)
    cancelled = 0
    try:
        sent = 0
        while sent < REQUESTS:
            client = grpcclient.InferenceServerClient(srv.grpc_url)
            got: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            k = rng.randint(1, 8)
            for i in range(k):
                client.async_stream_infer("octavo", _inputs(f"hello {sent + i}", rng.choice([2, 8, 64, 400])),
                                          request_id=str(sent + i))
            sent += k
            cancel = rng.random() < CANCEL_SHARE
            if cancel:  # a random moment, counted in responses: some requests still queued, some mid-stream
                for _ in range(min(rng.randint(0, 3), k)):  # every request answers at least once
                    got.get(timeout=60)
                cancelled += 1
            client.stop_stream(cancel_requests=cancel)
            client.close()
        # octavo's side is done: nothing running or waiting, every block back (the watcher aborted the rest)
        _wait_until(lambda: _octavo_idle(srv), 60, "octavo to hold no request and no block")
    except BaseException:
        srv.stop(timeout_s=60)
        raise
    pgid = srv.process.pid
    shm = srv.shm_prefix
    started = time.monotonic()
    code = srv.stop(timeout_s=60)
    took = time.monotonic() - started
    log = srv.log_path.read_text(errors="replace")
    assert cancelled > 50
    if code == 0:
        assert srv.models_left_loaded() == 0
        assert FINALIZED in log, log[-3000:]  # octavo's finalize() ran
        return
    # The only accepted failure is the known one, and octavo's side must degrade as documented.
    assert code == 1 and srv.models_left_loaded() == 1, log[-3000:]
    assert FINALIZED not in log  # finalize() never ran: Triton never unloaded the model
    assert took < EXIT_TIMEOUT_S + 30, took  # bounded by the exit timeout, not by our 60 s kill
    _wait_until(lambda: not _group_alive(pgid), 10, "the killed stubs to end")  # SIGKILL lands asynchronously
    assert not list(Path("/dev/shm").glob(f"{shm}*"))  # its shared memory removed
    # what recovers: a fresh server on the same repository serves at once
    again = TritonServer(repo, tmp_path / "work2", http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), auto_install_numpy=True, exit_timeout_s=EXIT_TIMEOUT_S)
    again.start(timeout_s=180)
    try:
        assert _one_stream(again).startswith("hello again")
    finally:
        assert again.stop(timeout_s=60) == 0, again.log_tail(3000)
    pytest.xfail(KNOWN_DEFECT)


HOLDER_CONFIG = """name: "holder"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
HOLDER_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.held = []  # response senders never closed: each keeps its response factory, hence the model

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([b"held"], dtype=np.object_))]))
            self.held.append(sender)
        return None
"""


def test_a_model_left_loaded_at_exit_is_named_and_cleaned_up(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """What a user sees when tritonserver cannot unload a model on SIGTERM (here: a model that keeps a response
    sender open, the same symptom as the 2.51 frontend defect): stop() returns tritonserver's exit 1 within its exit
    timeout, names the model left loaded in a warning, leaves no stub and no shared memory, and the same ports
    serve again at once."""
    (tmp_path / "repo" / "holder" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "holder" / "config.pbtxt").write_text(HOLDER_CONFIG)
    (tmp_path / "repo" / "holder" / "1" / "model.py").write_text(HOLDER_MODEL)
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    srv = TritonServer(tmp_path / "repo", tmp_path / "work", **ports, auto_install_numpy=True, exit_timeout_s=2)
    srv.start(timeout_s=180)

    def one_response(server: TritonServer) -> str:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        text = np.array([b"x"], dtype=np.object_)
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(text)
        client.async_stream_infer("holder", [t])
        result, error = got.get(timeout=60)  # the one response the model sends
        client.stop_stream(cancel_requests=True)
        client.close()
        assert error is None, error
        return result.as_numpy("text_output")[0].decode()

    try:
        assert one_response(srv) == "held"
    except BaseException:
        srv.stop()
        raise
    pgid, shm = srv.process.pid, srv.shm_prefix
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="octavo.triton_server.launcher"):
        code = srv.stop(timeout_s=60)
    took = time.monotonic() - started
    assert code == 1 and srv.models_left_loaded() == 1, srv.log_tail(3000)
    assert took < 2 + 20, took  # tritonserver's exit timeout, not stop()'s 60 s kill
    assert any("still loaded" in r.getMessage() and "finalize() did not run" in r.getMessage()
               for r in caplog.records), caplog.text
    _wait_until(lambda: not _group_alive(pgid), 10, "the killed stubs to end")  # SIGKILL lands asynchronously
    assert not list(Path("/dev/shm").glob(f"{shm}*"))
    again = TritonServer(tmp_path / "repo", tmp_path / "work2", **ports, auto_install_numpy=True, exit_timeout_s=2)
    again.start(timeout_s=180)  # the very same ports: nothing of the stuck server lingers
    try:
        assert one_response(again) == "held"
    finally:
        again.stop()
