"""Structured outputs in the library and the engine: StructuredOutputsParams, the grammar builder, the
tokenizer bridge (byte-level BPE and a GGUF-rebuilt SentencePiece tokenizer), the matcher, the sampler's
bitmask, and constrained decoding under continuous batching on a tiny random model.

References: `jsonschema` for schemas, `re.fullmatch` for regexes, membership for choices, Lark's own parser
for grammars; the unconstrained requests of a mixed batch against the same requests run alone.
"""
from __future__ import annotations

import json
import re

import jsonschema
import lark
import numpy as np
import pytest
from engine_helpers import exported

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.errors import InvalidRequestError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler, apply_token_bitmask
from octavo.structured.compiler import GrammarCompiler
from octavo.structured.grammar import build_grammar, closed_objects
from octavo.structured.params import StructuredOutputError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "home": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x"],
                 "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe so"]
LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
TIGHT = dict(disable_any_whitespace=True)  # a random model would fill free whitespace forever


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model_dir):  # noqa: ANN001, ANN201
    llm = LLM(str(model_dir), num_blocks=256, num_threads=1, max_num_seqs=64)
    yield llm
    llm.close()


def lark_parser() -> lark.Lark:
    return lark.Lark(LARK, start="start", parser="lalr")


def lark_prefix_ok(text: str) -> bool:
    """TEXT is a prefix of some sentence of the grammar (what a cut-off output must be)."""
    return prefix_ok(lark_parser(), text)


def prefix_ok(parser: lark.Lark, text: str) -> bool:
    """TEXT is a prefix of some sentence of PARSER's (LALR) grammar."""
    ip = parser.parse_interactive(text)
    try:
        for _ in ip.iter_parse():
            pass
    except lark.exceptions.UnexpectedInput:
        return False
    return True


def validate(kind: str, text: str, finish_reason: str) -> None:
    if finish_reason == "length":  # cut by max_tokens: checked as a prefix where we can
        if kind == "grammar":
            assert lark_prefix_ok(text), text
        return
    assert finish_reason == "stop", (finish_reason, text)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        lark_parser().parse(text)


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, **TIGHT),
    "json_object": StructuredOutputsParams(json_object=True, **TIGHT),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=LARK),
}


# ------------------------------------------------------------------------------------------------
# params and grammars


def test_params_take_exactly_one_constraint_and_check_types() -> None:
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    for kw, field in [({}, "json"), ({"regex": "a", "choice": ["a"]}, "choice"), ({"json": "{nope"}, "json"),
                      ({"json": [1]}, "json"), ({"regex": 3}, "regex"), ({"choice": []}, "choice"),
                      ({"choice": ["a", ""]}, "choice"), ({"grammar": ""}, "grammar"),
                      ({"structural_tag": "{}"}, "structural_tag"), ({"json_object": "yes"}, "json_object"),
                      ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern")]:
        with pytest.raises(StructuredOutputError) as e:
            StructuredOutputsParams(**kw)
        assert e.value.field == field, (kw, e.value.field)
    with pytest.raises(StructuredOutputError, match="unknown structured_outputs field"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    # SamplingParams takes the dataclass or a dict of its fields
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs={"regex": "a", "grammar": "start: x"})
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.cache_key() == StructuredOutputsParams(json={"a": 2, "b": 1}).cache_key()
    assert a.cache_key() != StructuredOutputsParams(json={"a": 2, "b": 1}, disable_any_whitespace=True).cache_key()


@pytest.mark.parametrize("kw, field, words", [
    ({"json": {"type": "objekt"}}, "json", "objekt"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "json", "nope"),
    ({"json": {"type": "string", "pattern": "("}}, "json", "unclosed"),
    ({"regex": "[a-"}, "regex", "unclosed"),
    ({"regex": "a{5,2}"}, "regex", "repetition"),
    ({"grammar": "start: foo"}, "grammar", "foo"),
    ({"grammar": "start ::= ("}, "grammar", ""),
])
def test_malformed_constraints_are_errors_naming_the_field(kw: dict, field: str, words: str) -> None:
    with pytest.raises(StructuredOutputError) as e:
        build_grammar(StructuredOutputsParams(**kw))
    assert e.value.field == field and words in str(e.value)


def test_gbnf_grammar_and_closed_objects() -> None:
    build_grammar(StructuredOutputsParams(grammar='root ::= "a" [0-9]+ ("," [0-9]+)*'))
    s = closed_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
                        "enum": [{"type": "object"}]})
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["enum"] == [{"type": "object"}]  # values are left alone


# ------------------------------------------------------------------------------------------------
# bitmask in the sampler


def _req(rid: str, **kw: object) -> Request:
    p = SamplingParams(**kw)
    return Request(request_id=rid, prompt_token_ids=[1, 2], params=p, generator=np.random.default_rng(7),
                   max_tokens=16, arrival_order=0)


def _mask(allowed: list[set[int] | None], vocab: int) -> np.ndarray:
    words = (vocab + 31) // 32
    m = np.full((len(allowed), words), -1, np.int32)
    for i, a in enumerate(allowed):
        if a is not None:
            bits = np.zeros(words * 32, np.uint8)
            bits[list(a)] = 1
            m[i] = np.packbits(bits, bitorder="little").view(np.int32)
    return m


def test_bitmask_applies_before_every_other_processor() -> None:
    vocab = 100
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    allowed = [{3, 50, 99}, None, {7}, {10, 11}]
    reqs = [_req("a", temperature=1.0, logit_bias={0: 100.0}, repetition_penalty=1.3),  # bias can't revive 0
            _req("b", temperature=0.0), _req("c", temperature=0.0, logprobs=2), _req("d", temperature=0.7, top_k=1)]
    s = Sampler(eos_token_ids=[0])
    for _ in range(30):
        out = s(logits, reqs, _mask(allowed, vocab))
        assert out.token_ids[0] in allowed[0] and out.token_ids[2] == 7 and out.token_ids[3] in allowed[3]
    assert out.token_ids[1] == int(np.argmax(logits[1]))  # the unconstrained row is untouched
    assert out.token_ids[3] == max(allowed[3], key=lambda t: logits[3, t])  # top_k among the allowed ones
    lp = out.logprobs[2]
    assert lp[7] == pytest.approx(0.0) and all(v == -np.inf for t, v in lp.items() if t != 7)
    # a mask narrower than the logits forbids the rest; min_tokens holding back an EOS-only row revives it
    x = np.zeros((1, 40), np.float32)
    apply_token_bitmask(x, _mask([{1, 33}], 33), np.array([0]))
    assert np.flatnonzero(np.isfinite(x[0])).tolist() == [1, 33]
    eos_only = s(np.zeros((1, vocab), np.float32), [_req("e", temperature=0.0, min_tokens=5)], _mask([{0}], vocab))
    assert eos_only.token_ids == [0]
    with pytest.raises(FloatingPointError):  # a NaN row still fails the step, mask or not
        s(np.full((1, vocab), np.nan, np.float32), [_req("f", temperature=0.0)], _mask([{3}], vocab))


# ------------------------------------------------------------------------------------------------
# the tokenizer bridge and the matcher


def test_matcher_follows_a_valid_output_and_rolls_back(llm) -> None:  # noqa: ANN001
    tok = llm.get_tokenizer()
    comp = GrammarCompiler(tok, llm.engine.vocab_size)
    text = '{"name":"ab","age":7,"kind":"dog","tags":["x"],"home":{"x":-3}}'
    ids = tok.encode(text, add_special_tokens=False)
    m = comp.matcher(StructuredOutputsParams(json=SCHEMA, **TIGHT))
    mask = np.zeros((1, comp.words), np.int32)
    eos = tok.eos_token_ids[0]
    for i, t in enumerate(ids):
        m.fill_bitmask(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        assert bits[t] == 1, (i, tok.decode([t]))
        assert bits[eos] == 0  # EOS only where the grammar may end
        assert m.accept(t)
    assert m.is_terminated and m.num_accepted == len(ids)
    m.rollback(1)
    assert not m.is_terminated and m.num_accepted == len(ids) - 1
    m.reset()
    assert m.num_accepted == 0 and not m.accept(tok.encode("}", add_special_tokens=False)[0]) and m.is_error
    # the cache: one compile, then copies; a different option is another grammar
    comp.matcher(StructuredOutputsParams(json=SCHEMA, **TIGHT))
    comp.matcher(StructuredOutputsParams(json=SCHEMA))
    assert comp.stats.compiled == 2 and comp.stats.hits == 1


def test_gguf_rebuilt_sentencepiece_tokenizer_bridges(spm_gguf) -> None:  # noqa: ANN001, F811
    from octavo.export.gguf_reader import read_gguf

    path, _ = spm_gguf
    ckpt = read_gguf(path)
    from tokenizers import Tokenizer as HF

    hf = HF.from_str(ckpt.tokenizer_json)

    class Tok:  # what GrammarCompiler reads of octavo's Tokenizer
        vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eos_token_ids = ckpt.eos_token_ids

        @staticmethod
        def to_json() -> str:
            return ckpt.tokenizer_json

    comp = GrammarCompiler(Tok(), Tok.vocab_size)
    m = comp.matcher(StructuredOutputsParams(regex=r" capital of [A-Z][a-z]+"))
    ids = hf.encode("capital of France", add_special_tokens=False).ids  # "▁capital" is " capital" in bytes
    mask = np.zeros((1, comp.words), np.int32)
    for t in ids:
        m.fill_bitmask(mask, 0)
        assert np.unpackbits(mask.view(np.uint8), bitorder="little")[t] == 1, hf.id_to_token(t)
        assert m.accept(t)
    assert m.is_accepting


from test_gguf import spm_gguf  # noqa: E402, F401 - the module fixture


# ------------------------------------------------------------------------------------------------
# the engine


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_outputs_validate(llm, kind: str) -> None:  # noqa: ANN001
    params = SamplingParams(n=16, temperature=1.0, max_tokens=96, seed=3, structured_outputs=CONSTRAINTS[kind])
    outs = llm.generate(["Once upon a time", "0123456789"], params, use_tqdm=False)
    done = 0
    for o in outs:
        for c in o.outputs:
            validate(kind, c.text, c.finish_reason)
            done += c.finish_reason == "stop"
    assert done >= 8  # most end by themselves (the grammar complete: "stop"), not by max_tokens


def test_grammar_is_complete_means_stop_and_children_have_own_matchers(model_dir) -> None:  # noqa: ANN001
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_blocks=64, num_threads=1))
    try:
        eng.add_request("r", "Hello", SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=1,
                                                    structured_outputs=StructuredOutputsParams(regex="[0-9]{5}")))
        kids = eng.outputs.groups["r"].children
        assert len({id(k.grammar) for k in kids}) == 4
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
        assert all(re.fullmatch("[0-9]{5}", c.text) and c.finish_reason == "stop" and len(c.token_ids) <= 5
                   for c in out.outputs)
        assert all(k.grammar is None for k in kids)  # freed at the finish
        # abort frees the state too
        eng.add_request("a", "Hello", SamplingParams(max_tokens=20, structured_outputs={"regex": "[0-9]{9}"}))
        req = eng.outputs.groups["a"].children[0]
        eng.step()
        assert req.grammar is not None and req.grammar.num_accepted == len(req.output_token_ids)
        eng.abort_request("a")
        assert req.grammar is None
    finally:
        eng.close()


def test_mixed_batch_with_preemption_and_shared_prefix(model_dir) -> None:  # noqa: ANN001
    """Constrained and unconstrained requests together, a KV pool too small for all (preemption and
    recompute), prompts sharing a long prefix (prefix-cache hits) and chunked prefill: the unconstrained
    greedy tokens are those of a run without any constraint; the constrained outputs validate."""
    prefix = "Write an essay about the history of computing, memory, paging and operating systems. " * 2
    prompts = [prefix + s for s in ("Once", "upon", "a", "time", "there", "was", "an", "engine")]
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    args = dict(num_blocks=40, block_size=8, num_threads=1, max_num_seqs=16, max_num_batched_tokens=64)
    ref = LLM(str(model_dir), **args)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, plain, use_tqdm=False)]
    finally:
        ref.close()
    kinds = list(CONSTRAINTS)
    llm = LLM(str(model_dir), **args)
    try:
        params = []
        for i in range(len(prompts) * 2):
            if i % 2 == 0:
                params.append(plain)
            else:
                params.append(SamplingParams(temperature=1.0, max_tokens=40, seed=i,
                                             structured_outputs=CONSTRAINTS[kinds[i // 2 % len(kinds)]]))
        outs = llm.generate([p for p in prompts for _ in (0, 1)], params, use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.close()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if i % 2 == 0:
            assert c.token_ids == want[i // 2], i
        else:
            validate(kinds[i // 2 % len(kinds)], c.text, c.finish_reason)
