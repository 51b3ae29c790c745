"""Speculative decoding in the engine, on a tiny random llama: greedy output token for token HF transformers'
(n-gram drafts, and drafts that are mostly right, under chunked prefill, preemption and the prefix cache), the
pool's invariants after every step, no leaks after aborts mid-verification, stop strings / max_tokens /
logprobs / n exact, seeded sampling reproducible and distributed as without speculation, and the counters."""
from __future__ import annotations

import math

import numpy as np
import pytest
from engine_helpers import exported, hf_reference, random_requests
from pool_check import check_pool

from octavo import LLM, SamplingParams
from octavo.runtime.block_hash import block_hash
from octavo.runtime.request import Request

ALWAYS = 1 << 20  # disable_by_batch_size: speculate at any batch size (the CPU default stops past 4 requests)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": ALWAYS}


@pytest.fixture(scope="module")
def folder(hf_dir):  # noqa: ANN001, ANN201
    return exported(hf_dir)


class ReferenceDrafts:
    """A proposer that drafts what the target will say (its greedy reference), wrong at every 5th position:
    long runs are accepted, some are cut short. It replaces the n-gram proposer behind the same seam."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.refs = refs

    def propose(self, req: Request, k: int) -> list[int]:
        ref = self.refs.get(tuple(req.prompt_token_ids))
        if ref is None or req.output_token_ids != ref[:req.num_output_tokens]:
            return []
        at = req.num_output_tokens
        return [t if (at + j) % 5 != 3 else (t + 1) % 384 for j, t in enumerate(ref[at:at + k])]


def _watch(llm: LLM) -> list[int]:
    """Check the pool after every step: refcounts = block tables, no block past a request's tokens (rejected
    drafts' blocks given back), and every block offered to the prefix cache named by the request's real
    tokens (a rejected draft never reached one). Returns the list the drafts of each step are counted in."""
    eng, drafts = llm.engine, []

    def check(rec) -> None:  # noqa: ANN001
        bm = eng.block_manager
        live = eng.scheduler.running
        check_pool(bm, [r.block_table for r in live])
        for r in live:
            assert not r.spec_token_ids and r.num_computed_tokens <= r.num_tokens
            assert len(r.block_table) <= bm.blocks_needed(r.num_tokens), "blocks of rejected drafts kept"
            parent = b""
            for i in range(r.num_registered_blocks):
                parent = block_hash(parent, r.tokens(i * bm.block_size, (i + 1) * bm.block_size))
                assert r.block_hashes[i] == parent and bm.hash_of[r.block_table[i]] in (None, parent)
        drafts.append(sum(k for k, _ in rec.drafts.values()))

    eng.add_step_listener(check)
    return drafts


def _greedy(prompts: list[list[int]], lengths: list[int], llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks, "blocks leaked"
    return [list(o.outputs[0].token_ids) for o in outs]


def _repetitive(tokenizer, n: int) -> list[list[int]]:  # noqa: ANN001
    texts = ["The quick brown fox jumps over the lazy dog. " * 4, "def fibonacci(n):\n    return n\n" * 5,
             "Paris is the capital. What is the capital of France? " * 3]
    return [tokenizer.encode(texts[i % len(texts)])[i:] for i in range(n)]


def _plain(folder, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:  # noqa: ANN001
    """The engine's greedy output without speculation (tests/test_engine_hf.py ties it to transformers)."""
    return _greedy(prompts, lengths, LLM(str(folder), block_size=4))


def test_greedy_ngram_equals_transformers_with_chunked_prefill_and_prefix_hits(folder, hf_dir) -> None:  # noqa: ANN001
    llm = LLM(str(folder), block_size=4, num_blocks=512, max_num_batched_tokens=48, long_prefill_token_threshold=16,
              speculative_config=NGRAM)
    drafts = _watch(llm)
    reqs = [(p, 40) for p in _repetitive(llm.get_tokenizer(), 4)] + random_requests(6, seed=5, max_prompt=70,
                                                                                  max_gen=30)
    prompts, lengths = [p for p, _ in reqs], [m for _, m in reqs]
    got = _greedy(prompts, lengths, llm)
    for i in (0, 4):  # transformers on two (its generate is slow on a loaded machine), the engine alone on all
        assert got[i] == hf_reference(hf_dir, prompts[i], lengths[i]), f"request {i} differs from transformers"
    assert got == _plain(folder, prompts, lengths)
    st = llm.engine.stats()
    assert sum(drafts) == st.spec_decode_num_draft_tokens > 0 and st.spec_decode_num_drafts > 0
    assert st.generation_tokens_total == sum(lengths)
    # prompts extending those outputs find the blocks computed while speculating in the prefix cache: a
    # rejected draft's KV in one of them would change these tokens
    again = [p + out[:30] for p, out in zip(prompts[:4], got)]
    assert _greedy(again, [8] * 4, llm) == _plain(folder, again, [8] * 4)
    assert llm.engine.stats().prefix_cache_hits >= st.prefix_cache_hits + 4 * 24


@pytest.mark.parametrize("caching", [False, True])
def test_accepted_runs_are_exact_under_preemption(folder, caching) -> None:  # noqa: ANN001
    reqs = random_requests(8, seed=11, max_prompt=40, max_gen=2)
    prompts, lengths = [p for p, _ in reqs], [30 + i for i in range(len(reqs))]
    want = _plain(folder, prompts, lengths)
    llm = LLM(str(folder), block_size=4, num_blocks=40, enable_prefix_caching=caching,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6,
                                                  "disable_by_batch_size": ALWAYS})
    llm.engine.scheduler.proposer = ReferenceDrafts({tuple(p): w for p, w in zip(prompts, want)})
    _watch(llm)
    assert _greedy(prompts, lengths, llm) == want
    st = llm.engine.stats()
    assert st.num_preemptions > 0
    assert st.spec_decode_num_accepted_tokens > st.spec_decode_num_draft_tokens // 2 > 0
    assert st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens  # and some were rejected
    assert st.spec_decode_num_accepted_tokens_per_pos[0] >= st.spec_decode_num_accepted_tokens_per_pos[-1]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)])  # the attention's dot products; its GEMM (group 8)
def test_logprobs_are_bit_for_bit_across_long_contexts(hf_model_dir, tmp_path, monkeypatch, heads: int,
                                                       kv_heads: int) -> None:  # noqa: ANN001
    """A Q4_0 GGUF (BlockMatMul keeps decode's arithmetic on steps of <= 8 rows), one request at a time, 1 + 4
    tokens verified a step: every token and logprob with speculation is the float the engine gives without it,
    while the context grows across the attention's 512-key parts (docs/op.md) and for a GQA group of 8 (the GEMM
    path, decode included)."""
    from models import make_random_model

    from octavo.export.gguf_writer import write_gguf

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    hf = make_random_model(tmp_path / "hf", "llama", num_attention_heads=heads, num_key_value_heads=kv_heads)
    path = write_gguf(hf, tmp_path / "m.Q4_0.gguf", tensor_type="Q4_0")
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(5, 300, n)] for n in (490, 1000)]  # decode crosses keys 512 and 1024
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=1)
    runs = {}
    for name in ("plain", "spec"):
        llm = LLM(str(path), num_threads=2, max_model_len=1024,
                  speculative_config=NGRAM if name == "spec" else None)
        if name == "spec":  # drafts of the plain output, every 5th wrong: runs accepted, some cut short
            llm.engine.scheduler.proposer = ReferenceDrafts({tuple(p): r[0] for p, r in zip(prompts, runs["plain"])})
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        runs[name] = [(list(o.outputs[0].token_ids),
                       [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs]) for o in outs]
        if name == "spec":
            st = llm.engine.stats()
            assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
        llm.close()
    assert runs["spec"] == runs["plain"]


def test_stop_strings_max_tokens_logprobs_and_n_are_as_without_speculation(folder) -> None:  # noqa: ANN001
    base = LLM(str(folder), block_size=4)
    tok = base.get_tokenizer()
    prompts = _repetitive(tok, 3)
    refs = {tuple(p): w for p, w in zip(prompts, _plain(folder, prompts, [40] * 3))}
    stop = tok.decode(refs[tuple(prompts[0])][12:14])  # inside a run the drafts get accepted
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=17, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=23, n=2, ignore_eos=True, include_stop_str_in_output=True,
                             stop=[tok.decode(refs[tuple(prompts[2])][20:21])])]
    spec = LLM(str(folder), block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                                                    "disable_by_batch_size": ALWAYS})
    spec.engine.scheduler.proposer = ReferenceDrafts(refs)
    want = base.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 10
    for w, g in zip(want, got):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert (gc.text, gc.token_ids, gc.finish_reason, gc.stop_reason) == \
                (wc.text, wc.token_ids, wc.finish_reason, wc.stop_reason)
            if wc.logprobs is not None:
                assert [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in gc.logprobs] == \
                    [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in wc.logprobs]
    assert got[0].outputs[0].finish_reason == "stop" and len(got[0].outputs[0].token_ids) < 40
    assert spec.engine.stats().generation_tokens_total == sum(len(c.token_ids) for o in got for c in o.outputs)


def test_seeded_sampling_is_reproducible_beside_other_requests(folder) -> None:  # noqa: ANN001
    llm = LLM(str(folder), block_size=4, speculative_config=NGRAM)
    prompts = [{"prompt_token_ids": p} for p in _repetitive(llm.get_tokenizer(), 3)]
    sampled = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=42, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [sampled, greedy, SamplingParams(temperature=1.0, max_tokens=25, seed=1)],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert llm.engine.stats().spec_decode_num_drafts > 0


def _chi2_two_samples(a: list[tuple], b: list[tuple]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the outcomes (rare ones pooled) and its degrees of freedom."""
    counts: dict[tuple, list[int]] = {}
    for i, sample in enumerate((a, b)):
        for o in sample:
            counts.setdefault(o, [0, 0])[i] += 1
    cells, other = [], [0, 0]
    for c in counts.values():
        if sum(c) >= 12:
            cells.append(c)
        else:
            other = [other[0] + c[0], other[1] + c[1]]
    if sum(other):
        cells.append(other)
    na, nb = len(a), len(b)
    stat = sum((c[0] - na * sum(c) / (na + nb)) ** 2 / (na * sum(c) / (na + nb))
               + (c[1] - nb * sum(c) / (na + nb)) ** 2 / (nb * sum(c) / (na + nb)) for c in cells)
    return stat, len(cells) - 1


def _chi2_quantile(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile Z (3.719: 1 - 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_are_distributed_as_without_speculation(folder) -> None:  # noqa: ANN001
    """Three sampled tokens (top-k 3) of one prompt over 300 seeds each, with drafts that are the greedy
    continuation (often accepted, often not) and without speculation: the same distribution."""
    prompt = random_requests(1, seed=3, max_prompt=30)[0][0]
    refs = {tuple(prompt): _plain(folder, [prompt], [4])[0]}
    n = 600

    def run(speculate: bool, seed0: int) -> tuple[list[tuple], LLM]:
        llm = LLM(str(folder), block_size=4, max_num_seqs=128,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "disable_by_batch_size": ALWAYS} if speculate else None)
        if speculate:
            llm.engine.scheduler.proposer = _Greedy(refs)
        params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=seed0 + i, ignore_eos=True)
                  for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs], llm

    with_spec, llm = run(True, 10_000)
    without, _ = run(False, 0)
    st = llm.engine.stats()
    assert st.spec_decode_num_accepted_tokens > n // 4 and st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    for outcome in (lambda o: o[:2], lambda o: o):  # the first draft position (most of the signal), then all
        stat, df = _chi2_two_samples([outcome(o) for o in with_spec], [outcome(o) for o in without])
        assert df >= 3 and stat < _chi2_quantile(df), (stat, df)


class _Greedy(ReferenceDrafts):
    """Drafts the greedy continuation of the prompt, whatever was sampled so far (no corruption)."""

    def propose(self, req: Request, k: int) -> list[int]:
        ref = self.refs[tuple(req.prompt_token_ids)]
        return ref[req.num_output_tokens:req.num_output_tokens + k]


class _Wrong:
    """Drafts that are almost always rejected: every decode allocates blocks for drafts."""

    def propose(self, req: Request, k: int) -> list[int]:
        return [7] * k


def test_abort_mid_verification_leaks_nothing(folder) -> None:  # noqa: ANN001
    llm = LLM(str(folder), block_size=4, speculative_config=NGRAM)
    eng = llm.engine
    eng.scheduler.proposer = _Wrong()
    seen: list[int] = []
    eng.add_step_listener(lambda rec: seen.append(len(rec.drafts)))
    for i, p in enumerate(_repetitive(llm.get_tokenizer(), 6)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=200))
    while not any(seen):
        eng.step()
    # drafts are scheduled (blocks allocated for them): abort half of the requests between schedule and commit
    sched = eng.scheduler.schedule()
    assert any(r.spec_token_ids for r in sched.scheduled)
    for i in range(0, 6, 2):
        eng.abort_request(f"r{i}")
    for req in sched.scheduled:  # the step is abandoned (as after a failed backend): its requests end
        if not req.finished:
            eng.scheduler.finish(req, "abort")
    eng.abort_all()
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    assert st.num_free_blocks == st.num_total_blocks and not eng.block_manager.promised


def test_disable_by_batch_size_and_the_trace(folder, tmp_path) -> None:  # noqa: ANN001
    import json

    trace = tmp_path / "t.jsonl"
    llm = LLM(str(folder), block_size=4, trace_path=str(trace),
              speculative_config=dict(NGRAM, disable_by_batch_size=2))
    runs: list[tuple[int, int]] = []
    llm.engine.add_step_listener(lambda rec: runs.append((len(rec.scheduled), len(rec.drafts))))
    prompts = _repetitive(llm.get_tokenizer(), 3)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (10, 40, 40)],
                 use_tqdm=False)
    assert all(d == 0 for n, d in runs if n > 2) and any(d for _, d in runs)
    llm.engine.close()
    rows = [r for line in trace.read_text().splitlines() for r in json.loads(line)["requests"] if "draft_tokens" in r]
    assert rows and all(0 <= r["accepted_tokens"] <= r["draft_tokens"] and r["phase"] == "decode" for r in rows)
    from octavo.tracing.reader import read_trace

    read = [r for row in read_trace(trace) for r in row["requests"]]
    assert sum(r["draft_tokens"] for r in read) == sum(r["draft_tokens"] for r in rows) > 0


def test_metrics_have_vllms_names(folder) -> None:  # noqa: ANN001
    from octavo.serving.metrics import ServerMetrics

    llm = LLM(str(folder), block_size=4, speculative_config=NGRAM)
    llm.generate([{"prompt_token_ids": p} for p in _repetitive(llm.get_tokenizer(), 2)],
                 SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    st = llm.engine.stats()
    text = ServerMetrics("m", llm.engine.stats).render().decode()
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("octavo:spec_decode") and "position" not in line}
    per_pos = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("octavo:spec_decode_num_accepted_tokens_per_pos_total")]
    assert per_pos == list(st.spec_decode_num_accepted_tokens_per_pos) and len(per_pos) == 4
    assert values == {"octavo:spec_decode_num_drafts_total": st.spec_decode_num_drafts,
                      "octavo:spec_decode_num_draft_tokens_total": st.spec_decode_num_draft_tokens,
                      "octavo:spec_decode_num_accepted_tokens_total": st.spec_decode_num_accepted_tokens}
    assert st.spec_decode_num_drafts > 0
    assert 0 <= st.spec_decode_acceptance_rate <= 1


def test_bench_throughput_reports_acceptance(folder, tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    from octavo.cli import main

    out = tmp_path / "tp.json"
    spec = json.dumps(dict(NGRAM, num_speculative_tokens=3))
    code = main(["bench", "throughput", str(folder), "--workload", "shared-prefix", "--num-prompts", "4",
                 "--prefix-len", "60", "--output-len", "24", "--num-threads", "1", "--speculative-config", spec,
                 "--save-result", str(out)])
    assert code == 0
    r = json.loads(out.read_text())["spec_decode"]
    assert 0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"] and r["num_drafts"] > 0
    assert sum(r["accepted_per_position"]) == r["num_accepted_tokens"] and len(r["accepted_per_position"]) == 3
    assert r["mean_acceptance_length"] == 1 + r["num_accepted_tokens"] / r["num_drafts"]
    assert "Speculative decoding: acceptance rate" in capsys.readouterr().out


def test_structured_outputs_speculate_exactly(folder) -> None:  # noqa: ANN001
    """Grammar-constrained requests verify drafts against the mask of each draft position: greedy output is
    the same as without speculation (drafts mostly right, some forbidden by the grammar), sampled outputs
    validate."""
    from test_structured import CONSTRAINTS, validate

    prompts = ["Once upon a time", "0123456789", "The quick brown fox", "def fibonacci(n):"]
    kinds = ["json", "regex", "choice", "grammar"]
    greedy = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS[k]) for k in kinds]
    base = LLM(str(folder), block_size=4)
    want = base.generate(prompts, greedy, use_tqdm=False)
    spec = LLM(str(folder), block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                             "disable_by_batch_size": ALWAYS})
    ids = [base.get_tokenizer().encode(p) for p in prompts]
    spec.engine.scheduler.proposer = ReferenceDrafts({tuple(i): list(w.outputs[0].token_ids) for i, w in zip(ids, want)})
    got = spec.generate(prompts, greedy, use_tqdm=False)
    for k, w, g in zip(kinds, want, got):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == (w.outputs[0].token_ids, w.outputs[0].finish_reason), k
        validate(k, g.outputs[0].text, g.outputs[0].finish_reason)
    st = spec.engine.stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    sampled = [SamplingParams(n=4, temperature=1.0, max_tokens=60, seed=5, structured_outputs=CONSTRAINTS[k])
               for k in kinds]
    ngram = LLM(str(folder), block_size=4, speculative_config=NGRAM)
    for k, o in zip(kinds, ngram.generate(prompts, sampled, use_tqdm=False)):
        for c in o.outputs:
            validate(k, c.text, c.finish_reason)
    assert ngram.engine.stats().spec_decode_num_drafts > 0


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_draft_model_greedy_is_exact(folder, hf_model_dir, draft: str) -> None:  # noqa: ANN001
    """A draft model (the target itself: every draft accepted; another random model of the same vocabulary:
    most rejected) in its own pool: greedy output as without speculation, sampled output reproducible, and
    the draft pool empty once the requests end."""
    model = folder if draft == "itself" else exported(hf_model_dir("qwen2"))
    reqs = random_requests(4, seed=21, max_prompt=40, max_gen=2)
    prompts, lengths = [p for p, _ in reqs], [20, 33, 9, 27]
    want = _plain(folder, prompts, lengths)
    llm = LLM(str(folder), block_size=4, speculative_config={"model": str(model), "num_speculative_tokens": 3,
                                                                   "disable_by_batch_size": ALWAYS})
    _watch(llm)
    assert _greedy(prompts, lengths, llm) == want
    st = llm.engine.stats()
    if draft == "itself":
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens > 30
    else:
        assert st.spec_decode_num_draft_tokens > st.spec_decode_num_accepted_tokens
    sampled = SamplingParams(temperature=0.8, max_tokens=20, seed=9, ignore_eos=True)
    one = llm.generate([{"prompt_token_ids": prompts[0]}], sampled, use_tqdm=False)[0].outputs[0].token_ids
    two = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)[0].outputs[0].token_ids
    assert one == two
    pool = llm.engine.proposer.pool
    assert pool.num_free_blocks == pool.num_blocks and not llm.engine.proposer.shadows
    llm.engine.close()


def test_on_cpu_speculation_stops_under_load_by_default(folder) -> None:  # noqa: ANN001
    """onnxruntime steps of more than a few rows are compute-bound: by default no request speculates while
    more than 4 run (docs/engine.md); an explicit disable_by_batch_size is kept."""
    llm = LLM(str(folder), block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert llm.engine.scheduler.spec.disable_by_batch_size == 4
    runs: list[tuple[int, int]] = []
    llm.engine.add_step_listener(lambda rec: runs.append((len(rec.scheduled), len(rec.drafts))))
    prompts = _repetitive(llm.get_tokenizer(), 6)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0.0, max_tokens=10 + 8 * i, ignore_eos=True) for i in range(6)],
                 use_tqdm=False)
    assert all(d == 0 for n, d in runs if n > 4) and any(d for _, d in runs)
    kept = LLM(str(folder), block_size=4, speculative_config=dict(NGRAM, disable_by_batch_size=9))
    assert kept.engine.scheduler.spec.disable_by_batch_size == 9
