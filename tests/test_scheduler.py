"""Scheduler + engine under random workloads (hypothesis), on the paged toy backend (tests/toy_backend.py),
whose outputs are checked against a plain, unpaged oracle (toy_greedy)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import greedy
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from toy_backend import ToyBackend, make_toy_model_dir, toy_greedy

from octavo.errors import PromptTooLongError
from octavo.runtime.block_hash import extend_block_hashes
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.request import Request
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from pool_check import check_pool


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_toy_model_dir(tmp_path_factory.mktemp("toy"))


def engine(toy_dir, num_blocks: int, block_size: int = 4, **kw) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(EngineArgs(model=str(toy_dir), block_size=block_size, **kw), ToyBackend(num_blocks, block_size))


def _req(rid: str, n_prompt: int, order: int, prompt: list[int] | None = None) -> Request:
    """A request whose prompt shares nothing with the others' (unless given)."""
    prompt = prompt if prompt is not None else list(range(100 * order, 100 * order + n_prompt))
    return Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(),
                   generator=np.random.default_rng(0), max_tokens=8, arrival_order=order)


def test_running_first_then_fcfs_under_the_token_budget() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b, c = _req("a", 6, 1), _req("b", 6, 2), _req("c", 3, 3)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled.items()] == [("a", 6), ("b", 4)]  # b's first chunk
    a.num_computed_tokens += 6
    b.num_computed_tokens += 4
    a.output_token_ids.append(1)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled.items()] == [("a", 1), ("b", 2), ("c", 3)]


def test_max_num_seqs_and_priority() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = _req("a", 3, 1), _req("b", 3, 2), _req("c", 3, 3)
    c.priority = -1  # lower value first
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["c", "a"]


def test_preempts_the_most_recently_admitted() -> None:
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = _req("a", 8, 1), _req("b", 8, 2)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert list(out.scheduled) == [a, b] and bm.num_free_blocks == 0
    for r in (a, b):
        r.num_computed_tokens = 8
        r.output_token_ids.append(1)
    out = s.schedule()  # a needs a third block: b (admitted last) is preempted
    assert list(out.scheduled) == [a] and out.preempted == [b]
    assert s.waiting == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert b.metrics.num_preemptions == 1


def _computed(s: Scheduler, out) -> None:  # noqa: ANN001
    """What the engine does after a successful step: the scheduled tokens are in the cache."""
    for r, n in out.scheduled.items():
        r.num_computed_tokens += n
        s.block_manager.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(1)


def _ids(out) -> list[tuple[str, int]]:  # noqa: ANN001
    return [(r.request_id, n) for r, n in out.scheduled.items()]


PREFIX = list(range(500, 512))  # 3 blocks of 4


def test_requests_sharing_a_cold_prefix_wait_for_its_producer() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = (_req(x, 0, i + 1, PREFIX + [i, i + 1]) for i, x in enumerate("abc"))
    u = _req("u", 5, 4)  # shares nothing: admitted at once, overtaking the held b and c
    for r in (a, b, c, u):
        s.add(r)
    out = s.schedule()
    assert _ids(out) == [("a", 14), ("u", 5)] and out.held == [b, c]
    assert set(bm.promised.values()) == {a, u} and len(bm.promised) == 3 + 1
    _computed(s, out)
    assert bm.promised == {}  # a filled its 3 prefix blocks (and 1 of its own), u its one
    out = s.schedule()
    assert _ids(out) == [("a", 1), ("u", 1), ("b", 2), ("c", 2)] and out.held == []
    assert b.metrics.num_cached_tokens == c.metrics.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert bm.prefix_hits == 24
    check_pool(bm, [r.block_table for r in (a, b, c, u)])


def test_a_chunked_producer_releases_its_waiters_after_the_last_shared_block() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=5)
    a, b = _req("a", 0, 1, PREFIX + [1, 2]), _req("b", 0, 2, PREFIX + [3])
    s.add(a)
    s.add(b)
    steps = []
    while not b.num_computed_tokens:
        out = s.schedule()
        steps.append((_ids(out), [r.request_id for r in out.held]))
        _computed(s, out)
    # a's chunks fill blocks 0..2 in steps 1..3 (b is not looked at while a takes the whole budget);
    # in step 3 b is held on block 2, which a is filling; in step 4 b finds all 3 blocks cached
    assert steps == [([("a", 5)], []), ([("a", 5)], []), ([("a", 4)], ["b"]), ([("a", 1), ("b", 1)], [])]
    assert b.metrics.num_cached_tokens == 12


def test_an_aborted_producer_hands_its_prefix_to_the_next_one() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    a, b, c = (_req(x, 0, i + 1, PREFIX + [i]) for i, x in enumerate("abc"))
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert _ids(out) == [("a", 6)]  # the whole budget: b and c are not even looked at
    _computed(s, out)  # block 0 filled, block 1 half
    s.finish(a, "abort")
    assert bm.promised == {}
    out = s.schedule()  # b takes over from block 1 (block 0 stayed cached)
    assert _ids(out) == [("b", 6)] and b.metrics.num_cached_tokens == 4
    assert set(bm.promised.values()) == {b}
    _computed(s, out)
    out = s.schedule()
    assert _ids(out) == [("b", 3)] and out.held == [c]
    _computed(s, out)
    out = s.schedule()
    assert _ids(out) == [("b", 1), ("c", 1)] and c.metrics.num_cached_tokens == 12


def test_a_producer_preempted_mid_prefix_withdraws_its_promises(toy_dir) -> None:  # noqa: ANN001
    """r (admitted first) grows until the pool runs out and the producer a, halfway through the shared
    prefix, is preempted: its promises go with its blocks; a, b and c still share the prefix and every
    output equals the unpaged oracle."""
    eng = engine(toy_dir, num_blocks=6, block_size=4, max_num_batched_tokens=8)
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    prompts = {"r": list(range(20, 28))} | {x: list(range(200, 216)) + [30 + i, 40 + i] for i, x in enumerate("abc")}
    eng.add_request("r", prompts["r"], greedy(12))
    eng.step()
    for x in "abc":
        eng.add_request(x, prompts[x], greedy(4))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        bm = eng.block_manager
        check_pool(bm, [r.block_table for g in eng.outputs.groups.values() for r in g.children])
        assert all(p.status.value == "running" for p in bm.promised.values())
    a_rows = {r["step"]: q for r in rows for q in r["requests"] if q["id"] == "a"}
    preempted = [r["step"] for r in rows if "a" in r["preempted"]]
    assert preempted and a_rows[preempted[0] - 1]["total_len"] < 16, "a was not preempted mid-prefix"
    assert any("b" in r["held"] for r in rows)
    assert eng.block_manager.promised == {} and eng.block_manager.num_free_blocks == 6
    assert outs["b"].num_cached_tokens == outs["c"].num_cached_tokens == 16
    for rid, p in prompts.items():
        assert outs[rid].outputs[0].token_ids == toy_greedy(p, 12 if rid == "r" else 4)


def test_held_requests_keep_their_seats() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    a, b = _req("a", 0, 1, PREFIX + [1]), _req("b", 0, 2, PREFIX + [2])
    u = _req("u", 3, 3)
    u.priority = 1  # served after a and b
    for x in (a, b, u):
        s.add(x)
    out = s.schedule()
    assert _ids(out) == [("a", 13)] and out.held == [b]  # u would take b's seat: it waits
    _computed(s, out)
    out = s.schedule()
    assert _ids(out) == [("a", 1), ("b", 1)]


def test_no_hold_without_prefix_caching() -> None:
    s = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = _req("a", 0, 1, PREFIX + [1]), _req("b", 0, 2, PREFIX + [2])
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert _ids(out) == [("a", 13), ("b", 13)] and out.held == [] and s.block_manager.promised == {}


def test_too_long_is_rejected_at_once(toy_dir) -> None:  # noqa: ANN001
    eng = engine(toy_dir, num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="whole pool"):
        eng.add_request("pool", list(range(5, 15)), greedy(8))  # 18 tokens > 16 slots (+1)
    with pytest.raises(PromptTooLongError, match="context"):
        eng.add_request("ctx", list(range(5, 65)), greedy(8))
    eng.add_request("fits", list(range(5, 15)), greedy(7))  # 17 = 16 KV slots + the last sampled token
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].outputs[0].token_ids == toy_greedy(list(range(5, 15)), 7)


request_st = st.tuples(
    st.sampled_from([0, 0, 0, 1, 2, 5]),  # arrival step
    st.sampled_from([0, 8, 16, 32, 32, 32]),  # length of the shared base prompt it starts with (-> prefix sharing)
    st.lists(st.integers(5, 300), min_size=1, max_size=12),  # its own suffix
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 30)),  # abort at this step (None: never)
    st.integers(-1, 1),  # priority
)


workload = dict(reqs=st.lists(request_st, min_size=3, max_size=12), num_blocks=st.integers(6, 24),
                block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 48), max_seqs=st.integers(1, 8),
                caching=st.booleans(), base=st.lists(st.integers(5, 300), min_size=32, max_size=32),
                long_prefill=st.sampled_from([0, 0, 1, 3, 8, 512]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**workload)
def test_property_random_arrivals_aborts_budgets_pools(toy_dir, **kw) -> None:  # noqa: ANN001
    check_random_workload(toy_dir, **kw)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**workload)
def test_slow_property_random_workloads(toy_dir, **kw) -> None:  # noqa: ANN001
    check_random_workload(toy_dir, **kw)


def check_random_workload(toy_dir, reqs, num_blocks, block_size, budget, max_seqs, caching, base,  # noqa: ANN001
                          long_prefill=0) -> None:
    """No block leaked or double-owned; free + used == total after every step; the budget and the
    sequence cap hold; every request ends with exactly one finish; unaborted outputs equal the oracle
    and aborted ones are a prefix of it (prefix hits, chunking and preemption never change outputs)."""
    reqs = [(arrive, base[:k] + suffix, m, abort_at, prio) for arrive, k, suffix, m, abort_at, prio in reqs]
    eng = engine(toy_dir, num_blocks, block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                 enable_prefix_caching=caching, long_prefill_token_threshold=long_prefill)
    pool_tokens = num_blocks * block_size
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    held_steps = watch_admissions(eng)
    finals: dict[str, list] = {}
    expected: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    step = 0
    while step < 400:
        for i, (arrive, prompt, max_tokens, _, prio) in enumerate(reqs):
            if arrive == step:
                if len(prompt) + max_tokens - 1 > pool_tokens:
                    with pytest.raises(PromptTooLongError):
                        eng.add_request(str(i), prompt, greedy(max_tokens))
                    continue
                eng.add_request(str(i), prompt, greedy(max_tokens), priority=prio)
                expected[str(i)] = (prompt, max_tokens)
        for i, (_, _, _, abort_at, _) in enumerate(reqs):
            if abort_at == step and eng.has_request(str(i)):
                eng.abort_request(str(i))
                aborted.add(str(i))
        n_rows = len(rows)
        for out in eng.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
        live = [r.block_table for g in eng.outputs.groups.values() for r in g.children]
        check_pool(eng.block_manager, live)
        if len(rows) > n_rows:
            row = rows[-1]
            assert row["num_tokens"] <= budget and row["batch_size"] <= max_seqs
            assert row["free_blocks"] + sum(1 for c in eng.block_manager.ref_count if c) == num_blocks
        step += 1
        if step > 7 and not eng.has_unfinished_requests():
            break
    stats = eng.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"held: {len(held_steps) > 0}")
    assert eng.block_manager.promised == {}
    assert not eng.has_unfinished_requests(), "requests left behind (deadlock?)"
    assert eng.block_manager.num_free_blocks == num_blocks
    assert set(finals) == set(expected)
    for rid, outs in finals.items():
        assert len(outs) == 1, f"request {rid} finished {len(outs)} times"
        comp = outs[0].outputs[0]
        prompt, max_tokens = expected[rid]
        ref = toy_greedy(prompt, max_tokens)
        if rid in aborted and comp.finish_reason == "abort":
            assert comp.token_ids == ref[: len(comp.token_ids)]
        else:
            assert comp.finish_reason == "length" and comp.token_ids == ref


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.lists(st.integers(5, 299), min_size=1, max_size=40),
       suffixes=st.lists(st.lists(st.integers(5, 383), max_size=8), min_size=2, max_size=10),
       max_tokens=st.integers(1, 6), block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 64),
       max_seqs=st.integers(1, 8))
def test_property_a_cold_shared_prefix_is_computed_once(toy_dir, base, suffixes, max_tokens, block_size, budget,
                                                        max_seqs) -> None:  # noqa: ANN001
    """Requests arriving together with one prefix (then distinct suffixes), a pool with room for all:
    every full block of the prefix is computed exactly once (engine stats count the prompt tokens
    computed), whatever the budget, block size and sequence cap; outputs equal the oracle."""
    prompts = [base + [300 + i] + suffix for i, suffix in enumerate(suffixes)]
    need = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    eng = engine(toy_dir, need + 1, block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    watch_admissions(eng)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy(max_tokens))
    outs = {}
    while eng.has_unfinished_requests():
        outs |= {o.request_id: o for o in eng.step()}
    shared = [min(len(base) // block_size, (len(p) - 1) // block_size) * block_size for p in prompts]
    stats = eng.stats()
    assert stats.num_preemptions == 0
    assert stats.prompt_tokens_total == sum(len(p) for p in prompts) - sum(shared[1:])
    assert stats.prefix_cache_hits == sum(shared[1:])
    for i, p in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == toy_greedy(p, max_tokens)


def watch_admissions(eng: LLMEngine) -> list[int]:
    """Check every step as the scheduler decides it (the real scheduler, observed, not replaced): a
    held request is not scheduled; every promise belongs to a running request; and no request admitted
    in the step computes a full prefix block that another running request has promised (the cold
    shared prefix is computed once). Returns the list of steps that held someone back."""
    sched, bm = eng.scheduler, eng.block_manager
    schedule = sched.schedule
    held_steps: list[int] = []

    def observed() -> SchedulerOutput:
        was_waiting = {id(r) for r in sched.waiting}
        out = schedule()
        assert not set(map(id, out.held)) & set(map(id, out.scheduled)), "a held request was scheduled"
        assert all(p in sched.running for p in bm.promised.values()), "a promise outlived its producer"
        if out.held:
            held_steps.append(eng.step_count + 1)
        bs = bm.block_size
        for req, n in out.scheduled.items():
            if id(req) not in was_waiting:
                continue
            first = req.num_computed_tokens // bs  # its cached blocks
            last = min((req.num_computed_tokens + n) // bs, (req.num_tokens - 1) // bs)
            extend_block_hashes(req, last * bs, bs)
            for i in range(first, last):
                owner = bm.promised.get(req.block_hashes[i])
                assert owner is None or owner is req, f"{req.request_id} computes block {i} promised by {owner.request_id}"
        return out

    sched.schedule = observed
    return held_steps


def test_trace_rows_follow_the_contract(toy_dir, tmp_path) -> None:  # noqa: ANN001
    import json

    path = tmp_path / "trace.jsonl"
    eng = engine(toy_dir, num_blocks=16, block_size=4, max_num_batched_tokens=8, trace_path=str(path))
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    eng.add_request("a", list(range(5, 15)), greedy(3))
    eng.add_request("b", list(range(5, 8)), greedy(2))
    while eng.has_unfinished_requests():
        eng.step()
    eng.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == json.loads(json.dumps(rows))
    keys = {"step", "time", "duration_s", "batch_size", "num_tokens", "num_waiting", "free_blocks", "total_blocks",
            "block_size", "requests", "arrived", "finished", "preempted", "held"}
    assert all(set(r) == keys for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0]["arrived"] == ["a", "b"] and rows[0]["num_tokens"] == 8
    first = rows[0]["requests"]
    assert first[0] == {"id": "a", "phase": "prefill", "tokens": 8, "prompt_len": 10, "total_len": 8,
                        "output_len": 0, "blocks": 2, "cached": 0}
    assert rows[1]["requests"][0]["tokens"] == 2 and rows[1]["requests"][0]["output_len"] == 1
    finished = [f for r in rows for f in r["finished"]]
    assert sorted(f["id"] for f in finished) == ["a", "b"] and {f["reason"] for f in finished} == {"length"}
    decode = [q for r in rows for q in r["requests"] if q["phase"] == "decode"]
    assert decode and all(q["tokens"] == 1 for q in decode)
    assert rows[-1]["free_blocks"] == 16 and rows[-1]["total_blocks"] == 16 and rows[-1]["block_size"] == 4


def test_a_long_prompt_never_holds_back_decodes_or_a_short_request(toy_dir) -> None:  # noqa: ANN001
    """Issue 17.9: with long_prefill_token_threshold C, prompts with more than C tokens left share C tokens per
    step. While a 300-token prompt is prefilled, a running request decodes one token EVERY step, and a short
    request added after step k is scheduled in step k + 1 and has its first token then (TTFT = one step after
    arrival, counted in steps), long before the long prompt is done; nobody's tokens change (vs the oracle)."""
    C, budget = 16, 64
    eng = engine(toy_dir, 256, 4, max_num_batched_tokens=budget, long_prefill_token_threshold=C)
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    eng.add_request("decoder", list(range(5, 12)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    eng.step()  # the decoder's prompt (7 tokens): it decodes from now on
    long_prompt = [5 + (7 * i) % 370 for i in range(300)]
    eng.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    first_token_row: dict[str, int] = {}
    final: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        if len(rows) == 5:
            eng.add_request("short", [9, 8, 7, 6, 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        for out in eng.step():
            if out.outputs[0].token_ids:
                first_token_row.setdefault(out.request_id, len(rows))
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    tokens = [{q["id"]: q["tokens"] for q in r["requests"]} for r in rows]
    long_steps = [t for t in tokens if "long" in t]
    assert len(long_steps) >= 300 // C and all(t["long"] <= C for t in long_steps)  # chunked by C
    assert all(sum(t.values()) <= budget for t in tokens)
    assert all(t.get("decoder") == 1 for t in long_steps[:30])  # the decoder never missed a step (40 tokens)
    assert first_token_row["short"] == 6  # added after step 5, sampled in step 6
    assert first_token_row["short"] < first_token_row["long"]
    assert final["decoder"] == toy_greedy(list(range(5, 12)), 40)
    assert final["long"] == toy_greedy(long_prompt, 2) and final["short"] == toy_greedy([9, 8, 7, 6, 5], 3)
    assert eng.stats().num_free_blocks == 256
