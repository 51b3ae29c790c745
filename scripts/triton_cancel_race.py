"""Minimal reproduction of tritonserver 2.51's stuck unload after cancelled streams — no octavo engine.

A trivial decoupled python-backend model (one thread sends one response per live request every 5 ms, then the
final flag; a cancelled request gets the final flag at once) is served by the same tritonserver that
`octavo triton` runs, and driven the way tests/test_reliability_triton.py drives octavo: N requests on gRPC
streams of 1-8, a share of the streams closed with `stop_stream(cancel_requests=True)` after 0-3 responses
(`--transport http`: the same over HTTP generate_stream, a cancel = the client hangs up after 1-3 events).
Then SIGTERM. Each round prints tritonserver's exit code, whether the model's finalize() ran and how many models
were still loaded when its exit timeout ran out.

`--count-objects` compiles scripts/triton_refcount_shim.c (needs cc) and preloads it into tritonserver: each
round then also prints how many of the objects that keep a model loaded were never deleted — InferenceRequests
(made and deleted by the gRPC / HTTP frontend), response factories (python backend), responses — and, with
--log-verbose >= 1, the request ids of the leaked requests.

    PYTHONPATH=. .venv/bin/python scripts/triton_cancel_race.py --rounds 3 --count-objects --log-verbose 1
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import re
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from octavo.triton_server.launcher import TritonServer, free_port

CONFIG = """name: "trivial"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL = '''import threading
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.live, self.lock, self.stop = [], threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            with self.lock:
                self.live.append([request, request.get_response_sender(), n])
        return None

    def _loop(self):
        out = pb_utils.Tensor("text_output", np.array([b"x"], dtype=np.object_))
        while not self.stop.wait(0.005):
            with self.lock:
                live = list(self.live)
            for item in live:
                request, sender, n = item
                if request.is_cancelled():
                    sender.send(flags=FINAL)
                elif n > 1:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                    item[2] -= 1
                    continue
                else:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=FINAL)
                with self.lock:
                    self.live.remove(item)

    def finalize(self):
        self.stop.set()
        self.thread.join()
        pb_utils.Logger.log_warn("trivial: finalize ran")
'''


def write_repository(root: Path) -> Path:
    (root / "trivial" / "1").mkdir(parents=True, exist_ok=True)
    (root / "trivial" / "config.pbtxt").write_text(CONFIG)
    (root / "trivial" / "1" / "model.py").write_text(MODEL)
    return root


def grpc_round(srv: TritonServer, rng: random.Random, requests: int, share: float) -> None:
    import tritonclient.grpc as grpcclient

    def inputs(i: int, n: int) -> list:
        a = grpcclient.InferInput("text_input", [1], "BYTES")
        a.set_data_from_numpy(np.array([f"hello {i}".encode()], dtype=np.object_))
        b = grpcclient.InferInput("max_tokens", [1], "INT32")
        b.set_data_from_numpy(np.array([n], np.int32))
        return [a, b]

    sent = 0
    while sent < requests:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put(error))
        k = rng.randint(1, 8)
        for i in range(k):
            client.async_stream_infer("trivial", inputs(sent + i, rng.choice([2, 8, 64, 400])), request_id=str(sent + i))
        sent += k
        cancel = rng.random() < share
        if cancel:
            for _ in range(min(rng.randint(0, 3), k)):  # every request answers at least once
                got.get(timeout=60)
        client.stop_stream(cancel_requests=cancel)
        client.close()


def http_round(srv: TritonServer, rng: random.Random, requests: int, share: float) -> None:
    def one(i: int, n: int, keep: int | None) -> None:
        body = json.dumps({"text_input": f"hello {i}", "max_tokens": n}).encode()
        with socket.create_connection(("127.0.0.1", srv.http_port), timeout=60) as s:
            s.sendall(b"POST /v2/models/trivial/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            events = 0
            while keep is None or events < keep:
                data = s.recv(65536)
                if not data or b"0\r\n\r\n" in data:
                    break
                events += data.count(b"data:")
            # leaving the block closes the socket: tritonserver cancels the request if it still runs

    sent = 0
    while sent < requests:
        k = rng.randint(1, 8)
        cancel = rng.random() < share
        threads = [threading.Thread(target=one, args=(sent + i, rng.choice([2, 8, 64, 400]),
                                                      rng.randint(1, 3) if cancel else None)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sent += k


def build_shim(work: Path) -> Path:
    out = work / "librefcount.so"
    source = Path(__file__).with_name("triton_refcount_shim.c")
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(out), str(source), "-ldl", "-lpthread"], check=True)
    return out


def object_counts(log: str) -> str:
    """The shim's exit report: 'InferenceRequest live=1 (request ids 257)' and the like."""
    parts = []
    for name, live, addresses in re.findall(r"refcount-shim: (\w+) made=\d+ deleted=\d+ live=(\d+)(.*)", log):
        ids = [m[-1] for a in addresses.split() for m in [re.findall(rf"prepared: \[0x{a}\] request id: (\S+?),", log)]
               if m]
        parts.append(f"{name} live={live}" + (f" (request ids {' '.join(ids)})" if ids else ""))
    return " objects: " + ", ".join(parts) if parts else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--cancel-share", type=float, default=0.7)
    ap.add_argument("--transport", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--log-verbose", type=int, default=0, help="tritonserver's; 1 lets --count-objects name requests")
    ap.add_argument("--exit-timeout", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--count-objects", action="store_true", help="preload scripts/triton_refcount_shim.c")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="triton-cancel-race-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = write_repository(work / "repo")
    if args.count_objects:
        os.environ["LD_PRELOAD"] = str(build_shim(work))  # tritonserver's environment is a copy of ours
    stuck = 0
    for r in range(args.rounds):
        srv = TritonServer(repo, work / f"round{r}", http_port=free_port(), grpc_port=free_port(),
                           metrics_port=free_port(), auto_install_numpy=True, log_verbose=args.log_verbose,
                           exit_timeout_s=args.exit_timeout)
        srv.start(timeout_s=180)
        try:
            (grpc_round if args.transport == "grpc" else http_round)(srv, random.Random(r), args.requests,
                                                                     args.cancel_share)
        finally:
            code = srv.stop(timeout_s=60)
        log = srv.log_path.read_text(errors="replace")
        left = srv.models_left_loaded()
        stuck += left > 0
        print(f"round {r}: {args.transport} exit={code} finalize_ran={'trivial: finalize ran' in log} "
              f"models_left_loaded={left}{object_counts(log)} log={srv.log_path}", flush=True)
    print(f"{stuck} of {args.rounds} rounds left the model loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
