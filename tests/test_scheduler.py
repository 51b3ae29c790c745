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
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.request import Request
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler


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
    st.sampled_from([0, 8, 16, 32]),  # length of the shared base prompt it starts with (-> prefix-cache hits)
    st.lists(st.integers(5, 300), min_size=1, max_size=12),  # its own suffix
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 30)),  # abort at this step (None: never)
    st.integers(-1, 1),  # priority
)


workload = dict(reqs=st.lists(request_st, min_size=3, max_size=12), num_blocks=st.integers(6, 24),
                block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 48), max_seqs=st.integers(1, 8),
                caching=st.booleans(), base=st.lists(st.integers(5, 300), min_size=32, max_size=32))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**workload)
def test_property_random_arrivals_aborts_budgets_pools(toy_dir, **kw) -> None:  # noqa: ANN001
    check_random_workload(toy_dir, **kw)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**workload)
def test_slow_property_random_workloads(toy_dir, **kw) -> None:  # noqa: ANN001
    check_random_workload(toy_dir, **kw)


def check_random_workload(toy_dir, reqs, num_blocks, block_size, budget, max_seqs, caching, base) -> None:  # noqa: ANN001
    """No block leaked or double-owned; free + used == total after every step; the budget and the
    sequence cap hold; every request ends with exactly one finish; unaborted outputs equal the oracle
    and aborted ones are a prefix of it (prefix hits, chunking and preemption never change outputs)."""
    reqs = [(arrive, base[:k] + suffix, m, abort_at, prio) for arrive, k, suffix, m, abort_at, prio in reqs]
    eng = engine(toy_dir, num_blocks, block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                 enable_prefix_caching=caching)
    pool_tokens = num_blocks * block_size
    rows: list[dict] = []
    eng.add_step_listener(rows.append)
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
            if abort_at == step and str(i) in eng.groups:
                eng.abort_request(str(i))
                aborted.add(str(i))
        n_rows = len(rows)
        for out in eng.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
        live = [r.block_table for g in eng.groups.values() for r in g.children]
        eng.block_manager.check(live)
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


def test_trace_rows_follow_the_contract(toy_dir, tmp_path) -> None:  # noqa: ANN001
    import json

    path = tmp_path / "trace.jsonl"
    eng = engine(toy_dir, num_blocks=16, block_size=4, max_num_batched_tokens=8, trace_path=str(path))
    rows: list[dict] = []
    eng.add_step_listener(rows.append)
    eng.add_request("a", list(range(5, 15)), greedy(3))
    eng.add_request("b", list(range(5, 8)), greedy(2))
    while eng.has_unfinished_requests():
        eng.step()
    eng.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == json.loads(json.dumps(rows))
    keys = {"step", "time", "duration_s", "batch_size", "num_tokens", "num_waiting", "free_blocks", "total_blocks",
            "block_size", "requests", "arrived", "finished", "preempted"}
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
