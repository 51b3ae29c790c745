"""Reliability on the real model: a backend failure ends only that step's requests ("error", blocks
freed) and the engine keeps serving; bad input is refused while other requests run undisturbed."""
from __future__ import annotations

import pytest
from engine_helpers import exported, greedy, hf_reference, random_requests

from octavo.errors import InvalidRequestError, PromptTooLongError, UnknownRequestError
from octavo.export.manifest import Manifest
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.sampling_params import SamplingParams


class FailingBackend:
    """The real backend, raising on chosen calls (1-based)."""

    def __init__(self, inner: OnnxRuntimeBackend, fail_on: set[int]) -> None:
        self.inner, self.fail_on, self.calls = inner, fail_on, 0
        self.num_blocks, self.block_size, self.vocab_size = inner.num_blocks, inner.block_size, inner.vocab_size

    def run(self, inputs):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"injected failure on call {self.calls}")
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def model(hf_model_dir):  # noqa: ANN001, ANN201
    hf = hf_model_dir("llama")
    return hf, exported(hf)


def make_engine(folder, fail_on: set[int], **kw) -> LLMEngine:  # noqa: ANN001
    manifest = Manifest.load(folder)
    args = EngineArgs(model=str(folder), num_blocks=64, **kw)
    return LLMEngine(args, FailingBackend(OnnxRuntimeBackend(folder, manifest, 64, args.block_size), fail_on))


def drain(eng: LLMEngine, final: dict) -> None:
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out


def test_failing_step_ends_only_its_requests(model) -> None:  # noqa: ANN001
    hf, folder = model
    eng = make_engine(folder, fail_on={4}, max_num_seqs=3, max_num_batched_tokens=64)
    reqs = random_requests(6, seed=11, max_prompt=60, max_gen=12)
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    for i, (p, m) in enumerate(reqs):
        eng.add_request(str(i), p, greedy(m))
    final: dict = {}
    drain(eng, final)
    failed_ids = {r["id"] for r in rows[3]["requests"]}
    assert failed_ids and len(failed_ids) < len(reqs)
    for i, (p, m) in enumerate(reqs):
        c = final[str(i)].outputs[0]
        if str(i) in failed_ids:
            assert c.finish_reason == "error" and "injected failure" in c.error
        else:
            assert c.finish_reason == "length" and c.token_ids == hf_reference(hf, p, m)
    assert {f["id"] for f in rows[3]["finished"]} == failed_ids
    assert eng.stats().num_free_blocks == 64
    # and the engine keeps serving, with the prefix cache too
    p, m = reqs[0]
    eng.add_request("after", p, greedy(m))
    drain(eng, final)
    assert final["after"].outputs[0].token_ids == hf_reference(hf, p, m)


def test_failure_during_a_chunked_prefill_and_decode_mix(model) -> None:  # noqa: ANN001
    hf, folder = model
    eng = make_engine(folder, fail_on={2, 3}, max_num_batched_tokens=16, block_size=8)
    eng.add_request("long", list(range(5, 80)), greedy(4))  # prefilled in chunks: fails mid-prefill
    final: dict = {}
    for _ in range(2):
        final.update({o.request_id: o for o in eng.step() if o.finished})
    eng.add_request("late", list(range(100, 120)), greedy(5))  # arrives after: scheduled on call 3 too
    drain(eng, final)
    assert final["long"].outputs[0].finish_reason == "error"
    assert final["late"].outputs[0].finish_reason == "error"
    eng.add_request("again", list(range(5, 80)), greedy(4))  # recompute: cached blocks were computed before the failure
    drain(eng, final)
    assert final["again"].outputs[0].token_ids == hf_reference(hf, list(range(5, 80)), 4)
    assert eng.stats().num_free_blocks == 64


def test_bad_input_while_others_run(model) -> None:  # noqa: ANN001
    hf, folder = model
    eng = make_engine(folder, fail_on=set())
    reqs = random_requests(3, seed=12, max_prompt=40, max_gen=10)
    for i, (p, m) in enumerate(reqs):
        eng.add_request(str(i), p, greedy(m))
    eng.step()
    with pytest.raises(PromptTooLongError, match="context"):
        eng.add_request("long", [5, 6, 7] * 367, greedy(4))  # the model's context is 1024
    for field, value in (("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.01), ("temperature", -1.0)):
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(UnknownRequestError):
        eng.abort_request("missing")
    final: dict = {}
    drain(eng, final)
    for i, (p, m) in enumerate(reqs):
        assert final[str(i)].outputs[0].token_ids == hf_reference(hf, p, m)
