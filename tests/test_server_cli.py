"""`octavo serve` as a real process: loopback bind, readiness, graceful drain on SIGTERM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest
from engine_helpers import exported
from serve_process import serving, start_serve



@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))  # exported once per session, shared with the engine tests


def test_serve_sigterm_finishes_in_flight_stream_then_exits(model_dir) -> None:  # noqa: ANN001
    proc, url = start_serve([str(model_dir), "--port", "0", "--num-blocks", "64", "--num-threads", "1",
                             "--served-model-name", "tiny", "--shutdown-timeout", "20"])
    try:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for ln in lines:
                if ln.startswith("data: "):
                    events.append(ln[6:])
                    break
            proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still finish
            events += [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 300
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "shutting down" in out
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_a_bad_model_folder_exits_1_with_the_reason(tmp_path) -> None:  # noqa: ANN001
    """No hang and no traceback for a user error: the reason is printed and the process exits 1 promptly."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    proc = subprocess.run([sys.executable, "-m", "octavo", "serve", str(bad), "--port", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: ModelFormatError" in proc.stdout and str(bad) in proc.stdout and "is not a model" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_serve_with_no_model_serves_the_embedded_model_by_name(tmp_path) -> None:  # noqa: ANN001
    """`octavo serve` alone: the embedded SmolLM2-135M-Instruct, listed and answered as 'smollm2-135m-instruct'
    (exported once into $OCTAVO_CACHE; the cache of a session that ran the demo is reused)."""
    from octavo.export.embedded import EMBEDDED_NAME

    # a first export of the 135M model takes a while on a loaded machine
    with serving(["--port", "0", "--num-threads", "1", "--max-model-len", "512"], ready_s=600) as (_, url):
        assert [d["id"] for d in httpx.get(url + "/v1/models").json()["data"]] == [EMBEDDED_NAME]
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == EMBEDDED_NAME, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]

