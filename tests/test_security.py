"""Security properties of the package and the server, each checked against the real thing:

- `octavo serve` binds loopback unless told otherwise;
- every route but /health needs the API key (routes are discovered from the app, so a new route is
  covered automatically), and the key is never echoed back;
- body size and max_tokens caps;
- chat templates render in a sandbox: templates reaching for os, __class__.__mro__, globals, config
  or unbounded ranges are refused, and message text is data, never template code;
- no pickle (or other code-running deserialiser) anywhere in the package source (AST scan);
- nothing in a request ever reaches the filesystem: a Python audit hook records every file opened
  or listed while hostile requests (model names that are paths, prompts that are paths) are served.
"""
from __future__ import annotations

import argparse
import ast
import sys
import threading
from pathlib import Path

import httpx
import pytest
from engine_helpers import exported
from serve_process import serve_in_thread
from toy_backend import ToyBackend, make_toy_model_dir

import octavo
from octavo.errors import InvalidRequestError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.server import OpenAIServer

KEY = "sk-secret-4c1f"
NAME = "tiny"
PACKAGE = Path(octavo.__file__).parent
MODEL_REPO = PACKAGE.parent / "model_repo"


@pytest.fixture(scope="module")
def server(hf_model_dir):  # noqa: ANN001, ANN201
    folder = exported(hf_model_dir("llama"))
    ea = EngineArgs(model=str(folder), num_blocks=64, block_size=16, max_num_seqs=8, num_threads=1)
    with serve_in_thread(ea, served_model_names=(NAME,), api_key=KEY, max_body_bytes=16 << 10, max_tokens_cap=6) as s:
        yield s


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------------------------------------
# binding and keys


def test_serve_binds_loopback_by_default() -> None:
    from octavo.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert p.parse_args(["m"]).host == "127.0.0.1"
    import inspect

    assert inspect.signature(OpenAIServer.start).parameters["host"].default == "127.0.0.1"


def test_api_key_on_every_route_but_health(server) -> None:  # noqa: ANN001
    routes = {(r.method, r.resource.canonical) for r in server.server.app.router.routes() if r.method != "HEAD"}
    assert ("GET", "/health") in routes and ("POST", "/v1/completions") in routes and len(routes) >= 7
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for method, path in sorted(routes):
            body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            body = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]},
                    "/v1/chat/completions/batch": {"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 1},
                    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
                    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
                    "/v1/embeddings": {"input": "hi"}}.get(path, body)
            anthropic = path.startswith("/v1/messages")  # Anthropic's x-api-key header is its scheme there only
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                            {"X-API-Key": f"{KEY}x" if anthropic else KEY}):
                r = http.request(method, path, json=body if method == "POST" else None, headers=headers)
                if path == "/health":
                    assert r.status_code == 200
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert KEY not in r.text  # the key is never reflected
            r = http.request(method, path, json=body if method == "POST" else None, headers=auth())
            # (a generative export has no embeddings: 400 past the key)
            assert r.status_code == (400 if path == "/v1/embeddings" else 200), (method, path, r.text[:200])
            if anthropic:
                r = http.request(method, path, json=body, headers={"X-API-Key": KEY})
                assert r.status_code == 200, (method, path, r.text[:200])
        # unknown routes: no key -> 401 (nothing about the server's routes leaks without the key)
        assert http.get("/v1/../../etc/passwd").status_code in (401, 404)
        assert http.get("/admin").status_code == 401
        assert http.get("/admin", headers=auth()).status_code == 404


def test_body_and_max_tokens_caps(server) -> None:  # noqa: ANN001
    with httpx.Client(base_url=server.base_url, timeout=30, headers=auth()) as http:
        r = http.post("/v1/completions", json={"prompt": "x" * (17 << 10), "max_tokens": 1})
        assert r.status_code == 413 and "max-body-bytes" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_completion_tokens": 1000})
        assert r.status_code == 400
        # no max_tokens: the cap is the default, so nothing runs unbounded
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


# ------------------------------------------------------------------------------------------------
# chat templates

HOSTILE_TEMPLATES = [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__['os'].system('touch /tmp/octavo-pwned') }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].listdir('/') }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ config.items() }}{{ self.__init__.__globals__ }}{{ request.application }}",
    "{{ messages|attr('__class__')|attr('__base__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutation of the caller's data
    "{% for i in range(10**9) %}x{% endfor %}",  # the sandbox caps range()
    "{% for x in %}", "{{ unclosed",  # syntax errors: refused the same way
    "{% import 'os' as os %}", "{% include '/etc/passwd' %}", "{% extends '/etc/passwd' %}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_hostile_chat_templates_are_refused(tmp_path: Path, template: str) -> None:
    folder = make_toy_model_dir(tmp_path / "m")
    (folder / "chat_template.jinja").write_text(template)
    eng = LLMEngine(EngineArgs(model=str(folder), block_size=4), ToyBackend(8, 4))
    msgs = [{"role": "user", "content": "x"}]
    try:
        out = eng.tokenizer.apply_chat_template(msgs)
    except InvalidRequestError as exc:
        assert "chat template" in str(exc)
    else:  # rendered without raising: it must not have reached anything (undefined -> empty)
        assert "os" not in out and "subclasses" not in out and "<class" not in out and "function" not in out, out
        assert "/" not in out.replace("/tmp", "")
    assert msgs == [{"role": "user", "content": "x"}]
    assert not Path("/tmp/octavo-pwned").exists()


def test_message_text_is_data_not_template_code(tmp_path: Path) -> None:
    folder = make_toy_model_dir(tmp_path / "m")
    eng = LLMEngine(EngineArgs(model=str(folder), block_size=4), ToyBackend(8, 4))
    evil = "{{ 7*7 }}{% for x in range(3) %}y{% endfor %}{{ config }}"
    out = eng.tokenizer.apply_chat_template([{"role": "user", "content": evil}])
    assert evil in out and "49" not in out


# ------------------------------------------------------------------------------------------------
# no pickle

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _python_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    if MODEL_REPO.is_dir():
        files += sorted(MODEL_REPO.rglob("*.py"))
    return files


def _findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
            kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
            if isinstance(f, ast.Name) and name in ("eval", "exec", "__import__"):
                found.append(f"{where} calls {name}()")
            if name == "load" and owner in ("torch", "np", "numpy", "yaml", "pickle", "joblib"):
                found.append(f"{where} calls {owner}.load")
            if name in ("loads", "load", "Unpickler") and owner in ("pickle", "marshal", "dill", "cloudpickle"):
                found.append(f"{where} calls {owner}.{name}")
            if kwargs.get("allow_pickle") == "True" or kwargs.get("trust_remote_code") == "True":
                found.append(f"{where} passes {kwargs}")
            if kwargs.get("shell") == "True":
                found.append(f"{where} runs a shell")
            if name == "from_pretrained" and kwargs.get("use_safetensors") != "True":
                found.append(f"{where} from_pretrained without use_safetensors=True (would torch.load a .bin)")
    return found


def test_no_pickle_or_code_running_loaders_in_the_source() -> None:
    files = _python_files()
    assert len(files) > 40
    findings = [f for p in files for f in _findings(p)]
    assert not findings, "\n".join(findings)


def test_the_scanner_catches_what_it_looks_for(tmp_path: Path) -> None:
    bad = PACKAGE / "_security_scan_probe.py"  # must live under the package for relative paths
    src = ("import pickle\nfrom joblib import load\nimport numpy as np\nimport torch\n"
           "np.load('x', allow_pickle=True)\ntorch.load('m.pt')\neval('1')\nm.from_pretrained('d')\n"
           "subprocess.run('ls', shell=True)\npickle.loads(b'')\n")
    try:
        bad.write_text(src)
        found = _findings(bad)
    finally:
        bad.unlink()
    assert len(found) >= 9, found


# ------------------------------------------------------------------------------------------------
# requests never touch the filesystem

_RECORDING = threading.Event()
_EVENTS: list[tuple[str, str]] = []
_WATCHED = ("open", "os.listdir", "os.scandir", "os.chdir", "os.remove", "os.rename", "os.mkdir", "os.symlink",
            "os.truncate", "shutil.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "pickle.",
            "marshal.", "socket.connect", "ctypes.dlopen")


def _hook(event: str, args: tuple) -> None:
    if _RECORDING.is_set() and event.startswith(_WATCHED):
        _EVENTS.append((event, repr(args[:2])[:200]))


def test_requests_never_touch_the_filesystem(server) -> None:  # noqa: ANN001
    """Serve hostile requests (model names and prompts that are paths, chat names, stop strings) with a
    Python audit hook recording every open/listdir/exec/connect in the process: none may happen."""
    sys.addaudithook(_hook)  # permanent for this process; records only while _RECORDING is set
    hostile = ["/etc/passwd", "../../../../etc/shadow", "file:///etc/hosts", "~/.ssh/id_rsa", "model.onnx",
               "octavo.json", "\\\\server\\share", "/proc/self/environ"]
    bodies = []
    for h in hostile:
        bodies += [("/v1/completions", {"model": h, "prompt": h, "max_tokens": 2}),
                   ("/v1/completions", {"model": NAME, "prompt": h, "max_tokens": 2, "stop": [h], "user": h}),
                   ("/v1/chat/completions", {"model": h, "messages": [{"role": "user", "content": h}], "max_tokens": 2}),
                   ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "system", "content": h, "name": h},
                                                                          {"role": "user", "content": h}],
                                             "max_tokens": 2})]
    with httpx.Client(base_url=server.base_url, timeout=30, headers=auth()) as http:
        http.post("/v1/completions", json={"prompt": "warm", "max_tokens": 1})  # lazy imports happen before recording
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w"}], "max_tokens": 1})
        _RECORDING.set()
        try:
            statuses = [http.post(path, json=body).status_code for path, body in bodies]
            statuses.append(http.get(f"/v1/models?model={hostile[0]}").status_code)
        finally:
            _RECORDING.clear()
    assert statuses.count(404) == 2 * len(hostile)  # a model name that is a path is only compared: unknown
    assert statuses.count(200) == 2 * len(hostile) + 1
    assert not _EVENTS, _EVENTS
