"""Every error body has OpenAI's shape with one rule (docs/serving.md "Errors"): `type` from the status, `code` a
snake_case string (never a class name, a number or null), `param` the field at fault, and a message that says
what to change. Driven with the official `openai` client (its exception classes read status and code) and raw
httpx, over the real engine on the tiny test model."""
from __future__ import annotations

import re

import httpx
import openai
import pytest
from engine_helpers import exported
from serve_process import serve_in_thread

from octavo.runtime.engine_args import EngineArgs

NAME = "tiny"
KEY = "sk-errors"
MAX_LEN = 256
CODE = re.compile(r"^[a-z][a-z0-9_]*$")


@pytest.fixture(scope="module")
def server(hf_model_dir):  # noqa: ANN001, ANN201
    ea = EngineArgs(model=str(exported(hf_model_dir("llama"))), num_blocks=64, block_size=16, num_threads=1,
                    max_model_len=MAX_LEN)
    with serve_in_thread(ea, served_model_names=(NAME,), api_key=KEY, max_body_bytes=16 << 10) as s:
        yield s


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["code"], str) and CODE.match(err["code"]), err
    assert err["type"] == ("server_error" if status >= 500 else "authentication_error" if status == 401
                           else "invalid_request_error"), err
    return err


def test_a_one_token_prompt_with_huge_max_tokens_is_told_to_lower_max_tokens(client) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[5], max_tokens=100000)
    err = e.value.body
    assert e.value.code == "context_length_exceeded" and err["param"] == "max_tokens", err
    assert f"lower max_tokens to at most {MAX_LEN - 1}" in err["message"] and "shorten" not in err["message"], err


def test_a_prompt_longer_than_the_context_is_told_to_shorten_the_prompt(client) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[5] * (MAX_LEN + 10), max_tokens=4)
    err = e.value.body
    assert e.value.code == "context_length_exceeded" and err["param"] == "prompt", err
    assert f"shorten the prompt to at most {MAX_LEN - 4} tokens" in err["message"], err


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "code", "param"), [
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 100000}, None, 400,
     "context_length_exceeded", "max_tokens"),
    ("POST", "/v1/completions", {"model": "other", "prompt": "x"}, None, 404, "model_not_found", "model"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot"}, None, 400, "invalid_value",
     "temperature"),
    ("POST", "/v1/completions", {"model": NAME}, None, 400, "missing_required_parameter", "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "suffix": "y"}, None, 400, "unsupported_parameter",
     "suffix"),
    ("POST", "/v1/completions", b"{not json", None, 400, "invalid_json", None),
    ("POST", "/v1/completions", b"x" * (20 << 10), None, 413, "request_too_large", None),
    ("GET", "/v1/no-such-route", None, None, 404, "not_found", None),
    ("DELETE", "/v1/completions", None, None, 405, "method_not_allowed", None),
    ("GET", "/v1/models", None, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key", None),
])
def test_every_error_has_one_shape_and_a_string_code(server, method, path, body, headers, status, code,  # noqa: ANN001
                                                     param) -> None:
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body} if body is not None else {}
    r = httpx.request(method, server.base_url + path, headers=headers or {"Authorization": f"Bearer {KEY}"},
                      timeout=30, **kwargs)
    err = _error(r, status)
    assert (err["code"], err["param"]) == (code, param), err
    assert err["message"]
