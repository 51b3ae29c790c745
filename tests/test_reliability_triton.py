"""`octavo triton` shutdown after many cancelled gRPC streams (issue 17 item 7), against a real tritonserver.

600 requests on ~134 gRPC streams, 70% of the streams closed with `stop_stream(cancel_requests=True)` at a
random moment, then SIGTERM: tritonserver must unload the model (octavo's finalize() runs) and exit 0.
With the tritonserver 2.51 that nvidia-pytriton bundles it does not in about half the runs ("Found 1 live
models" until --exit-timeout-secs, exit 1) although octavo sent a final response for every request and
holds nothing Python can see; the cause is not found (docs/reliability.md, "Known, not fixed"): hence
xfail(strict=False), and slow (~30-60 s)."""
from __future__ import annotations

import queue
import random
import time
from pathlib import Path

import numpy as np
import pytest

from octavo.serving.triton_launcher import pytriton_installed  # noqa: E402

if not pytriton_installed():
    pytest.skip("tritonserver is not installed: make setup (or pip install --no-deps nvidia-pytriton==0.7.0)",
                allow_module_level=True)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc,http]'")

from octavo.commands.triton import write_model_repository  # noqa: E402
from octavo.serving.triton_launcher import TritonServer, free_port  # noqa: E402

REQUESTS = 600
CANCEL_SHARE = 0.7


def _inputs(prompt: str, max_tokens: int) -> list:
    out = []
    for name, arr, kind in (("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                            ("max_tokens", np.array([max_tokens], np.int32), "INT32"),
                            ("stream", np.array([True]), "BOOL"), ("ignore_eos", np.array([True]), "BOOL")):
        t = grpcclient.InferInput(name, list(arr.shape), kind)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="tritonserver 2.51 keeps a model reference after cancelled gRPC streams "
                   "in about half the runs; cause not found (docs/reliability.md, 'Known, not fixed')")
def test_shutdown_after_many_cancelled_streams_unloads_the_model(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    from octavo.export import export_model

    exported = tmp_path / "export"
    export_model(hf_model_dir("llama"), exported, progress=False)
    repo = write_model_repository(tmp_path / "repo", exported,
                                  parameters={"num_threads": "1", "num_blocks": "256", "block_size": "16"})
    srv = TritonServer(repo, tmp_path / "work", http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port(), auto_install_numpy=True)
    srv.start(timeout_s=180)
    rng = random.Random(0)
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
            time.sleep(rng.random() * 0.05)  # a random moment: some requests still queued, some mid-stream
            client.stop_stream(cancel_requests=rng.random() < CANCEL_SHARE)
            client.close()
    finally:
        code = srv.stop(timeout_s=60)
    log = srv.log_tail(20000)
    assert code == 0, log[-3000:]
    assert "octavo: instance" in log and "stopped" in log  # finalize() ran
