"""Hypothesis over the engine with the REAL ONNX Runtime backend (tiny random model, few examples; the many-
example property runs over the scheduler live in test_scheduler.py with the toy backend).

1. Hostile requests: any prompt (text with lone surrogates, out-of-range or non-integer ids, junk types)
   and any SamplingParams field values are either refused with InvalidRequestError (PromptTooLongError
   included) or run; a canary request running beside them always finishes with its exact greedy output,
   so no accepted request can fail a shared step.
2. Random workloads: arrivals, aborts, prompt lengths, pool sizes, block sizes, token budgets, sequence
   caps, prefix caching, and sampling params (greedy, seeded temperature/top-k/top-p/min-p, penalties,
   logit bias, stop strings and ids, min_tokens, n > 1, logprobs, tiny temperatures). Invariants: no
   block leaked or double-owned after every step; every request finishes exactly once; each request's
   output equals its output when run alone in an unconstrained engine (aborted ones: a prefix of it).
"""
from __future__ import annotations

import math

import pytest
from engine_helpers import exported
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.errors import InvalidRequestError
from octavo.export.manifest import Manifest
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.sampling_params import SamplingParams
from pool_check import check_pool

VOCAB = 384
CANARY = [17, 42, 99, 5, 250, 3]


@pytest.fixture(scope="module")
def folder(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def engine(folder, num_blocks: int = 64, block_size: int = 16, **kw) -> LLMEngine:  # noqa: ANN001
    backend = OnnxRuntimeBackend(folder, Manifest.load(folder), num_blocks, block_size, num_threads=1)
    return LLMEngine(EngineArgs(model=str(folder), num_blocks=num_blocks, block_size=block_size, num_threads=1, **kw),
                     backend)


def run_until_done(eng: LLMEngine, finals: dict, limit: int = 2000) -> None:
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            return
        for o in eng.step():
            if o.finished:
                assert o.request_id not in finals, f"{o.request_id} finished twice"
                finals[o.request_id] = o
    raise AssertionError("engine did not drain (deadlock?)")


# ------------------------------------------------------------------------------------------------
# 1. hostile requests

_junk_scalar = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                | st.text(st.characters(codec=None), max_size=8) | st.binary(max_size=4))
_junk = st.recursive(_junk_scalar, lambda s: st.lists(s, max_size=3) | st.dictionaries(_junk_scalar.filter(
    lambda k: isinstance(k, (int, str, bool, type(None)))), s, max_size=3), max_leaves=6)
_prompts = st.one_of(
    st.text(st.characters(codec=None), max_size=40),  # surrogates, controls, anything
    st.lists(st.integers(-5, VOCAB + 5), max_size=30),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-1, VOCAB), max_size=10)}),
    _junk,
)
_param_values = {
    "n": st.integers(-1, 3) | _junk, "temperature": st.floats() | st.sampled_from([0.0, 1e-300, 1e-40, 5.0]),
    "top_p": st.floats(), "top_k": st.integers(-2, 500) | _junk, "min_p": st.floats(), "seed": st.integers() | _junk,
    "repetition_penalty": st.floats(), "presence_penalty": st.floats(), "frequency_penalty": st.floats(),
    "logit_bias": st.none() | st.dictionaries(st.integers(-3, VOCAB + 3) | _junk_scalar.filter(
        lambda k: isinstance(k, (int, str, bool, type(None)))), st.floats() | _junk, max_size=3) | _junk,
    "max_tokens": st.none() | st.integers(-1, 2000) | _junk, "min_tokens": st.integers(-1, 6) | _junk,
    "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | _junk,
    "stop_token_ids": st.none() | st.lists(st.integers(-3, VOCAB + 3), max_size=3) | _junk,
    "include_stop_str_in_output": _junk, "ignore_eos": _junk, "logprobs": st.integers(-1, 25) | _junk,
    "skip_special_tokens": _junk,
}


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=_prompts, params=st.fixed_dictionaries({}, optional=_param_values))
def test_hostile_requests_are_refused_or_harmless(shared_engine, prompt, params) -> None:  # noqa: ANN001
    eng, want = shared_engine
    try:
        sp = SamplingParams(**params)
    except InvalidRequestError:
        sp = None
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"SamplingParams({params!r}) raised {type(exc).__name__}: {exc}") from exc
    accepted = False
    if sp is not None:
        try:
            eng.add_request("hostile", prompt, sp)
            accepted = True
        except InvalidRequestError:
            pass
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"add_request({prompt!r}, {params!r}) raised {type(exc).__name__}: {exc}") from exc
    eng.add_request("canary", CANARY, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finals: dict = {}
    for i in range(200):
        if not eng.has_unfinished_requests():
            break
        if i == 6 and eng.has_request("hostile"):
            eng.abort_request("hostile")  # long ones (max_tokens None / 2000) are cut here
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert not eng.has_unfinished_requests()
    c = finals["canary"].outputs[0]
    assert c.finish_reason == "length" and c.token_ids == want, (c, params)
    if accepted:
        assert all(o.finish_reason in ("stop", "length", "abort") for o in finals["hostile"].outputs), finals["hostile"]
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.fixture(scope="module")
def shared_engine(folder):  # noqa: ANN001, ANN201
    eng = engine(folder, num_blocks=160, max_num_batched_tokens=256)
    eng.add_request("ref", CANARY, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finals: dict = {}
    run_until_done(eng, finals)
    yield eng, list(finals["ref"].outputs[0].token_ids)
    eng.close()


# ------------------------------------------------------------------------------------------------
# 2. random workloads, alone vs together

_sampling = st.one_of(
    st.builds(lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), st.integers(1, 12)),
    st.builds(lambda m, seed, t, k, p, mp, rp, pp, fp, n, lp: SamplingParams(
        temperature=t, top_k=k, top_p=p, min_p=mp, repetition_penalty=rp, presence_penalty=pp, frequency_penalty=fp,
        seed=seed, n=n, max_tokens=m, ignore_eos=True, logprobs=lp),
        st.integers(1, 12), st.integers(0, 2**64 - 1), st.sampled_from([1e-30, 0.5, 1.0, 1.7]),
        st.sampled_from([0, 1, 5, 50]), st.sampled_from([1.0, 0.9, 0.3]), st.sampled_from([0.0, 0.05]),
        st.sampled_from([1.0, 1.3]), st.sampled_from([0.0, 0.5]), st.sampled_from([0.0, -0.5]), st.integers(1, 3),
        st.sampled_from([None, 0, 3])),
    st.builds(lambda m, ids, bias, mt: SamplingParams(
        temperature=0, max_tokens=m, stop_token_ids=ids, logit_bias=bias, min_tokens=min(mt, m), stop=["e", "th"]),
        st.integers(1, 12), st.lists(st.integers(0, VOCAB - 1), max_size=20),
        st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 5.0, 100.0]), max_size=2),
        st.integers(0, 4)),
)
_request = st.tuples(
    st.sampled_from([0, 0, 0, 1, 3, 7]),  # arrival step
    st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=70),  # prompt
    _sampling,
    st.one_of(st.none(), st.none(), st.integers(0, 15)),  # abort at this step
    st.booleans(),  # starts with the shared prefix (prefix-cache hits)
)


_workload = dict(reqs=st.lists(_request, min_size=2, max_size=8), block_size=st.sampled_from([4, 8, 16]),
                 pool_tokens=st.integers(96, 320), budget=st.integers(8, 96), max_seqs=st.integers(1, 6),
                 caching=st.booleans())


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(**_workload)
def test_random_workloads_equal_alone_runs(folder, **kw) -> None:  # noqa: ANN001
    check_workload(folder, **kw)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(**_workload)
def test_slow_random_workloads_equal_alone_runs(folder, **kw) -> None:  # noqa: ANN001
    check_workload(folder, **kw)


def check_workload(folder, reqs, block_size, pool_tokens, budget, max_seqs, caching) -> None:  # noqa: ANN001
    prefix = list(range(20, 52))
    reqs = [(a, (prefix + p) if shared else p, sp, ab) for a, p, sp, ab, shared in reqs]
    num_blocks = max(1, pool_tokens // block_size)
    eng = engine(folder, num_blocks, block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                 enable_prefix_caching=caching)
    alone = engine(folder, 256, 16, max_num_batched_tokens=512)
    expected = {}
    for i, (_, p, sp, _) in enumerate(reqs):
        if len(p) + sp.max_tokens - 1 > num_blocks * block_size:
            continue  # cannot fit this pool: refused at add (checked below)
        alone.add_request(str(i), p, sp)
        finals: dict = {}
        run_until_done(alone, finals)
        expected[str(i)] = [list(c.token_ids) for c in finals[str(i)].outputs]
    alone.close()

    finals = {}
    aborted = set()
    step = 0
    while step < 3000:
        for i, (arrive, p, sp, _) in enumerate(reqs):
            if arrive == step:
                if str(i) not in expected:
                    with pytest.raises(InvalidRequestError):
                        eng.add_request(str(i), p, sp)
                else:
                    eng.add_request(str(i), p, sp)
        for i, (_, _, _, abort_at) in enumerate(reqs):
            if abort_at == step and eng.has_request(str(i)):
                eng.abort_request(str(i))
                aborted.add(str(i))
        for o in eng.step():
            if o.finished:
                assert o.request_id not in finals, f"{o.request_id} finished twice"
                finals[o.request_id] = o
        check_pool(eng.block_manager, [r.block_table for g in eng.outputs.groups.values() for r in g.children])
        step += 1
        if step > 8 and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests(), "deadlock"
    assert eng.block_manager.num_free_blocks == num_blocks
    assert set(finals) == set(expected)
    for rid, out in finals.items():
        got = [list(c.token_ids) for c in out.outputs]
        if rid in aborted and any(c.finish_reason == "abort" for c in out.outputs):
            assert all(g == e[: len(g)] for g, e in zip(got, expected[rid])), rid
        else:
            assert got == expected[rid], (rid, reqs[int(rid)][2])
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    eng.close()
    assert math.isfinite(eng.stats().kv_cache_usage)
