"""A KV-event subscriber for the tests, independent of octavo's encoder: its own msgspec declarations of vLLM 0.32's
layout (vllm/distributed/kv_events.py: the batch an array [ts, events, data_parallel_rank]; each event a map tagged
by its class name under "type", fields in vLLM's order; unknown fields rejected here, so a misspelt field fails),
a ZeroMQ SUB socket for the live stream and a DEALER socket for the replay endpoint."""
from __future__ import annotations

import time
from typing import Any, Union

import msgspec
import zmq

Hash = Union[int, bytes]


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union["Stored", "Removed", "Cleared"]]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, tag=True, forbid_unknown_fields=True):
    pass


class Stored(_Event, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class Cleared(_Event, tag="AllBlocksCleared"):
    pass


DECODER = msgspec.msgpack.Decoder(Batch)
END_SEQ = -1


def apply(state: set, batch: Batch) -> None:
    """A router's view of one replica: the set of block hashes it holds."""
    for e in batch.events:
        if isinstance(e, Stored):
            state.update(e.block_hashes)
        elif isinstance(e, Removed):
            state.difference_update(e.block_hashes)
        else:
            state.clear()


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.live: dict[int, bytes] = {}  # seq -> payload, as received

    def receive_until(self, last_seq: int, timeout: float = 30.0) -> None:
        """Receive live messages until one with seq >= LAST_SEQ arrived (AssertionError after TIMEOUT)."""
        deadline = time.monotonic() + timeout
        while not self.live or max(self.live) < last_seq:
            left = deadline - time.monotonic()
            assert left > 0, f"no KV event batch {last_seq} within {timeout} s (got {sorted(self.live)[-3:]})"
            if self.sub.poll(int(min(left, 1.0) * 1000)):
                topic, seq, payload = self.sub.recv_multipart()
                self.live[int.from_bytes(seq, "big")] = payload

    def replay(self, start: int = 0, timeout: float = 30.0) -> list[tuple[int, bytes]]:
        """Every buffered batch from START on, through the replay endpoint (a DEALER speaking to its ROUTER)."""
        assert self.replay_endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            out: list[tuple[int, bytes]] = []
            while True:
                assert sock.poll(int(timeout * 1000)), "the replay endpoint did not answer"
                empty, seq, payload = sock.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == END_SEQ:
                    return out
                out.append((n, payload))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
