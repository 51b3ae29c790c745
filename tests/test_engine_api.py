"""LLMEngine / LLM behaviour on the paged toy backend (fast): n > 1, stops, seeds, aborts, metrics,
bad input. Outputs are checked against the unpaged oracle of tests/toy_backend.py."""
from __future__ import annotations

import numpy as np
import pytest
from toy_backend import ToyBackend, make_toy_model_dir, toy_greedy, toy_logits

from octavo.errors import InvalidRequestError, PromptTooLongError, UnknownRequestError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.llm import LLM
from octavo.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_toy_model_dir(tmp_path_factory.mktemp("toy"), max_context=256)


def llm(toy_dir, num_blocks: int = 64, block_size: int = 4, **kw) -> LLM:  # noqa: ANN001
    return LLM(str(toy_dir), backend_instance=ToyBackend(num_blocks, block_size), block_size=block_size, **kw)


def run_all(eng: LLMEngine) -> dict[str, object]:
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in final, "output after the final one"
            if out.finished:
                final[out.request_id] = out
    return final


P = list(range(20, 50))  # a 30-token prompt


def test_llm_backend_is_the_engine_args_name_and_an_object_goes_in_backend_instance(toy_dir) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequestError, match="backend must be"):
        LLM(str(toy_dir), backend="cuda")  # a name, checked by EngineArgs
    with pytest.raises(InvalidRequestError, match="backend must be"):
        LLM(str(toy_dir), backend=ToyBackend(8, 16))  # an object is not a name
    m = llm(toy_dir)
    assert m.engine.args.backend == "onnxruntime" and isinstance(m.engine.backend, ToyBackend)


def test_n_children_share_the_prompt_blocks(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir)
    out = m.generate({"prompt_token_ids": P}, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # different samples
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    assert m.engine.stats().prefix_cache_hits >= 2 * 28  # children 1 and 2 reuse 7 full blocks each
    assert m.engine.stats().num_free_blocks == 64
    again = m.generate({"prompt_token_ids": P}, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeded_sampling_is_independent_of_the_batch(toy_dir) -> None:  # noqa: ANN001
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm(toy_dir).generate({"prompt_token_ids": P}, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(60, 60 + k))} for k in (3, 17, 40)]
    params = [SamplingParams(temperature=1.0, seed=k, max_tokens=20) for k in range(3)]
    batch = llm(toy_dir, max_num_batched_tokens=16).generate(others[:2] + [{"prompt_token_ids": P}] + others[2:],
                                                             params[:2] + [sp] + params[2:], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12)
    a = llm(toy_dir).generate({"prompt_token_ids": P}, unseeded, use_tqdm=False)[0].outputs[0].token_ids
    b = llm(toy_dir, seed=1).generate({"prompt_token_ids": P}, unseeded, use_tqdm=False)[0].outputs[0].token_ids
    assert a != b  # EngineArgs.seed seeds requests without their own seed


def test_stop_strings_and_stop_token_ids_through_the_engine(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir)
    tok = m.get_tokenizer()
    ascii_bias = {t: 20.0 for t in range(tok.vocab_size) if (s := tok.decode([t])).isascii() and s.isprintable() and s}
    sp = dict(temperature=0, max_tokens=20, ignore_eos=True, logit_bias=ascii_bias)
    ids = m.generate({"prompt_token_ids": P}, SamplingParams(**sp), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[5]
    o = m.generate({"prompt_token_ids": P}, SamplingParams(**sp, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    k = ids.index(stop_id)
    assert o.token_ids == ids[: k + 1] and o.finish_reason == "stop" and o.stop_reason == stop_id
    text = tok.decode(ids)
    assert text.isascii() and len(text) > 12
    stop = text[8:11]
    for include in (False, True):
        c = m.generate({"prompt_token_ids": P}, SamplingParams(**sp, stop=stop, include_stop_str_in_output=include),
                       use_tqdm=False)[0].outputs[0]
        i = text.find(stop)
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == text[: i + (len(stop) if include else 0)]
        assert tok.decode(c.token_ids).startswith(c.text)
    assert m.engine.stats().num_free_blocks == 64


def test_eos_stops_unless_ignored_and_min_tokens(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir)
    eos = m.get_tokenizer().eos_token_ids[0]
    bias = {eos: 100.0}
    o = m.generate({"prompt_token_ids": P}, SamplingParams(temperature=0, max_tokens=8, logit_bias=bias), use_tqdm=False)[0]
    assert o.outputs[0].token_ids == [eos] and o.outputs[0].finish_reason == "stop" and o.outputs[0].text == ""
    o = m.generate({"prompt_token_ids": P}, SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias=bias),
                   use_tqdm=False)[0]
    assert len(o.outputs[0].token_ids) == 4 and o.outputs[0].token_ids[-1] == eos
    o = m.generate({"prompt_token_ids": P}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias=bias),
                   use_tqdm=False)[0]
    assert o.outputs[0].token_ids == [eos] * 5 and o.outputs[0].finish_reason == "length"


def test_logprobs_through_the_engine(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir)
    o = m.generate({"prompt_token_ids": P}, SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True),
                   use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 3
    ctx = list(P)
    for tok, lp in zip(o.token_ids, o.logprobs):
        lg = toy_logits(ctx).astype(np.float64)
        ref = lg - np.log(np.exp(lg - lg.max()).sum()) - lg.max()
        assert tok in lp and len(lp) == 2  # greedy: the chosen token is the top one
        for t, v in lp.items():
            assert v.logprob == pytest.approx(ref[t], abs=1e-4) and v.token_id == t
        ctx.append(tok)


def test_max_tokens_none_runs_to_the_context(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir, num_blocks=128, max_model_len=40)
    o = m.generate({"prompt_token_ids": P}, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(o.outputs[0].token_ids) == 10 and o.outputs[0].finish_reason == "length"


def test_abort_and_metrics(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir, max_num_batched_tokens=8)
    eng = m.engine
    eng.add_request("a", P, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", P[:10], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(6):
        eng.step()
    eng.abort_request("a")
    with pytest.raises(UnknownRequestError, match="nope"):
        eng.abort_request("nope")
    final = run_all(eng)
    assert final["a"].outputs[0].finish_reason == "abort" and final["a"].finished
    b = final["b"]
    assert b.outputs[0].token_ids == toy_greedy(P[:10], 5)
    mt = b.metrics
    assert mt.arrival_time <= mt.first_scheduled_time <= mt.first_token_time <= mt.last_token_time <= mt.finished_time
    with pytest.raises(UnknownRequestError):
        eng.abort_request("a")  # already over
    st = eng.stats()
    assert st.num_free_blocks == st.num_total_blocks and st.num_running == st.num_waiting == 0
    assert st.generation_tokens_total >= 5 and st.step_count >= 6


@pytest.mark.parametrize("bad, exc, words", [
    (dict(prompt=list(range(5, 300))), PromptTooLongError, "context"),
    (dict(params=dict(max_tokens=0)), InvalidRequestError, "max_tokens"),
    (dict(params=dict(top_p=0.0)), InvalidRequestError, "top_p"),
    (dict(params=dict(top_p=1.5)), InvalidRequestError, "top_p"),
    (dict(params=dict(temperature=-0.5)), InvalidRequestError, "temperature"),
    (dict(prompt=[]), InvalidRequestError, "empty"),
    (dict(prompt=[5, 100000]), InvalidRequestError, "token ids"),
    (dict(prompt=3.5), InvalidRequestError, "prompt"),
    (dict(params=dict(logit_bias={100000: 1.0})), InvalidRequestError, "logit_bias"),
    (dict(rid="dup"), InvalidRequestError, "already in use"),
])
def test_bad_input_is_refused_and_others_are_undisturbed(toy_dir, bad, exc, words) -> None:  # noqa: ANN001
    eng = llm(toy_dir).engine
    eng.add_request("dup", P, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()
    with pytest.raises(exc, match=words):
        params = SamplingParams(temperature=0, max_tokens=4)
        for k, v in bad.get("params", {}).items():
            setattr(params, k, v)  # bypass the constructor: add_request must validate too
        eng.add_request(bad.get("rid", "bad"), bad.get("prompt", P), params)
    final = run_all(eng)
    assert list(final) == ["dup"] and final["dup"].outputs[0].token_ids == toy_greedy(P, 6)
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_bad_params_in_a_batch_raise_before_anything_runs(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir)
    with pytest.raises(PromptTooLongError):
        m.generate([{"prompt_token_ids": P}, {"prompt_token_ids": list(range(5, 300))}], use_tqdm=False)
    assert not m.engine.has_unfinished_requests() and m.engine.stats().num_free_blocks == 64
    assert m.generate({"prompt_token_ids": P}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0].token_ids == toy_greedy(P, 2)


def test_text_prompts_chat_and_tokenizer(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir)
    tok = m.get_tokenizer()
    out = m.generate(["The quick brown fox", "Paris"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].prompt == "The quick brown fox" and out[0].prompt_token_ids == tok.encode("The quick brown fox")
    msgs = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(msgs)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    c = m.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert c.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert c.outputs[0].token_ids == toy_greedy(c.prompt_token_ids, 3)


def test_chat_template_is_sandboxed(tmp_path) -> None:  # noqa: ANN001
    folder = make_toy_model_dir(tmp_path / "m")
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    eng = LLMEngine(EngineArgs(model=str(folder), block_size=4), ToyBackend(8, 4))
    with pytest.raises(InvalidRequestError, match="chat template"):
        eng.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    (folder / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    eng = LLMEngine(EngineArgs(model=str(folder), block_size=4), ToyBackend(8, 4))
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        eng.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_engine_args_are_checked(toy_dir) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        LLMEngine(EngineArgs(model=str(toy_dir), block_size=4, max_model_len=100000), ToyBackend(8, 4))
    with pytest.raises(InvalidRequestError, match="block_size"):
        LLMEngine(EngineArgs(model=str(toy_dir), block_size=8), ToyBackend(8, 4))
    with pytest.raises(InvalidRequestError, match="block_size"):
        LLMEngine(EngineArgs(model=str(toy_dir), block_size=6), ToyBackend(8, 6))


def test_default_pool_size(toy_dir) -> None:  # noqa: ANN001
    from octavo.export.manifest import Manifest
    from octavo.runtime.model_setup import default_num_blocks

    m = Manifest.load(toy_dir)  # 1 layer, 1 KV head of 4: 2*1*16*1*4*4 = 512 bytes per block of 16
    assert default_num_blocks(EngineArgs(model="x", num_blocks=7, kv_cache_memory=10**9), m, 256) == 7
    assert default_num_blocks(EngineArgs(model="x", kv_cache_memory=512 * 10 + 100), m, 256) == 10
    with pytest.raises(InvalidRequestError, match="less than one KV block"):
        default_num_blocks(EngineArgs(model="x", kv_cache_memory=100), m, 256)
    assert default_num_blocks(EngineArgs(model="x", max_num_seqs=8), m, 256) == 8 * 256 // 16


def test_priority_decides_who_runs_first(toy_dir) -> None:  # noqa: ANN001
    m = llm(toy_dir, max_num_seqs=1)
    prompts = [{"prompt_token_ids": [10 + i, 11, 12]} for i in range(3)]
    outs = m.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                      priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]
    assert all(o.outputs[0].token_ids == toy_greedy(p["prompt_token_ids"], 2) for o, p in zip(outs, prompts))


def test_final_only_outputs_equal_the_last_cumulative_ones(toy_dir) -> None:  # noqa: ANN001
    """output_kind="final_only" (what LLM.generate asks for): step() returns a request only once, finished,
    with exactly what the cumulative stream ends with; LLM.generate leaves the caller's params alone."""
    params = {kind: SamplingParams(temperature=1.0, seed=3, max_tokens=9, stop_token_ids=[7], output_kind=kind)
              for kind in ("cumulative", "final_only")}
    ends = {}
    for kind, p in params.items():
        eng = llm(toy_dir).engine
        for i in range(4):
            eng.add_request(f"r{i}", {"prompt_token_ids": P[i:]}, p)
        seen: dict[str, int] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                seen[out.request_id] = seen.get(out.request_id, 0) + 1
                assert kind == "cumulative" or out.finished
                if out.finished:
                    ends[kind, out.request_id] = ([c.token_ids for c in out.outputs], [c.text for c in out.outputs],
                                                  [c.finish_reason for c in out.outputs])
        assert (max(seen.values()) > 1) == (kind == "cumulative")
    for i in range(4):
        assert ends["final_only", f"r{i}"] == ends["cumulative", f"r{i}"]
    mine = SamplingParams(temperature=0.0, max_tokens=3)
    llm(toy_dir).generate({"prompt_token_ids": P}, mine, use_tqdm=False)
    assert mine.output_kind == "cumulative"
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="everything")


def test_delta_outputs_add_up_to_the_cumulative_ones(toy_dir) -> None:  # noqa: ANN001
    """output_kind="delta" (the engine's native form): per child, the deltas' text, token ids and logprobs
    concatenated equal the last cumulative output; each child's finish reason comes exactly once, last;
    a delta never repeats a token. n > 1, a stop string, logprobs and an abort mid-way."""
    base = dict(n=3, temperature=1.0, seed=11, max_tokens=12, logprobs=2, stop=["a"], stop_token_ids=[7])
    results = {}
    for kind in ("cumulative", "delta"):
        eng = llm(toy_dir).engine
        for i in range(3):
            eng.add_request(f"r{i}", {"prompt_token_ids": P[i:]}, SamplingParams(**base, output_kind=kind))
        acc: dict[tuple[str, int], dict] = {}
        steps = 0
        while eng.has_unfinished_requests():
            steps += 1
            if steps == 4:
                eng.abort_request("r2")
            for out in eng.step():
                for c in out.outputs:
                    a = acc.setdefault((out.request_id, c.index), {"text": "", "ids": [], "lps": [], "reasons": []})
                    if kind == "cumulative":
                        a.update(text=c.text, ids=list(c.token_ids), lps=list(c.logprobs or []))
                        a["reasons"] = [c.finish_reason] if c.finish_reason else []
                    else:
                        assert not a["reasons"], "output after the child's finish"
                        a["text"] += c.text
                        a["ids"] += c.token_ids
                        a["lps"] += c.logprobs or []
                        a["reasons"] += [c.finish_reason] if c.finish_reason else []
        results[kind] = {k: (v["text"], v["ids"], [sorted(d) for d in v["lps"]], v["reasons"]) for k, v in acc.items()}
        assert eng.stats().num_free_blocks == 64
    assert results["delta"] == results["cumulative"]
    assert all(len(v[3]) == 1 for v in results["delta"].values())
    assert {v[3][0] for k, v in results["delta"].items() if k[0] == "r2"} <= {"abort", "stop", "length"}
