"""Ray Serve (octavo/ray_serve.py): the application builder's arguments, and two octavo replicas started by the one
command `serve run CONFIG` (Serve's config file naming `octavo.ray_serve:build_app` with model=... num_replicas=2, and the
proxy on a free loopback port; serve run starts a local Ray instance of its own), driven through Ray Serve's proxy by the openai client: every request answered exactly once, both replicas
used, streaming equal to the whole response. Needs `pip install 'octavo[ray]'` (skipped without Ray: it is not in
`make test`'s extras)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import exported

pytest.importorskip("ray.serve")

from octavo.errors import InvalidRequestError  # noqa: E402
from octavo.ray_serve import build_app, deployment_options  # noqa: E402


def test_deployment_options() -> None:
    assert deployment_options({}) == {"max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 1.0},
                                      "num_replicas": 1}
    scaled = deployment_options({"min_replicas": "1", "max_replicas": "4", "target_ongoing_requests": "8",
                                 "num_cpus": "2"})
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}
    assert "num_replicas" not in scaled and scaled["ray_actor_options"] == {"num_cpus": 2.0}
    with pytest.raises(InvalidRequestError, match="one or the other"):
        deployment_options({"num_replicas": "2", "max_replicas": "4"})
    with pytest.raises(InvalidRequestError, match="num_replicas must be a number"):
        deployment_options({"num_replicas": "two"})
    with pytest.raises(InvalidRequestError, match="model=PATH"):
        build_app({"num_replicas": "2"})
    with pytest.raises(InvalidRequestError, match="unknown ray_serve argument 'blocksize'"):
        build_app({"model": "m", "blocksize": "16"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_run_two_replicas(hf_model_dir, tmp_path) -> None:  # noqa: ANN001
    """~1-2 min on 2 cores (Ray's own start is most of it)."""
    model = exported(hf_model_dir("llama"))
    port = _free_port()
    config = tmp_path / "octavo-serve.json"  # Serve's config file (YAML; JSON is YAML): the proxy's port, the app
    config.write_text(json.dumps({
        "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "octavo", "route_prefix": "/", "import_path": "octavo.ray_serve:build_app",
                          "args": {"model": str(model), "num_replicas": 2, "num_cpus": 0.5, "num_threads": 1,
                                   "num_blocks": 64, "served_model_name": "tiny"}}]}))
    serve_cli = Path(sys.executable).with_name("serve")
    command = [str(serve_cli) if serve_cli.exists() else shutil.which("serve") or "serve", "run", str(config)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # ready: the proxy routes /v1/models to a replica whose model is loaded
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)

        def one(i: int) -> tuple[str, str, str]:
            raw = client.completions.with_raw_response.create(model="tiny", prompt=f"request {i}: the answer is",
                                                              max_tokens=4, temperature=0, user=str(i))
            return str(i), raw.parse().choices[0].text, raw.headers["x-octavo-replica"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(24)))
        assert sorted(a[0] for a in answers) == sorted(str(i) for i in range(24))  # each answered exactly once
        assert len({a[2] for a in answers}) == 2, "both replicas served"

        whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True)
            if c.choices)
        assert streamed == whole.choices[0].message.content
        with pytest.raises(openai.NotFoundError):  # octavo's own errors come through the proxy
            client.completions.create(model="other", prompt="x", max_tokens=1)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # serve run: shut the application and its own Ray instance down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
