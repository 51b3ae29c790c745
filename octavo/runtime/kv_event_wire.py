"""vLLM's KV-event wire format, as msgspec encodes vLLM's own classes (vllm.distributed.kv_events, 0.32):

- a batch is a msgpack ARRAY `[ts, events, data_parallel_rank]` (EventBatch is array_like);
- each event is a msgpack MAP tagged by its class name under "type" (vLLM dropped array_like from the events in
  vllm-project/vllm#42892), with the fields in vLLM's declaration order; fields that have a default are left out
  while they hold it (omit_defaults):
  `BlockStored`: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, [extra_keys,
  group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership, session_id];
  `BlockRemoved`: block_hashes, medium, [group_idx, locality, ownership]; `AllBlocksCleared`: no fields.
- a block hash is vLLM's ExternalBlockHash: an int (the hash's low 64 bits, big-endian: vLLM's default) or bytes.

The structs below are octavo's own declarations of that layout; `encode_batch` turns the block manager's events
(runtime/kv_events.py) into one payload. tests/test_kv_events.py decodes payloads with an independent decoder and,
where the vLLM CPU venv exists, with vLLM's own classes.
"""
from __future__ import annotations

from typing import Union

import msgspec

from octavo.runtime.kv_events import BlocksRemoved, BlocksStored, KVEvent

# the medium of the engine's own KV pool: vLLM reports its primary pool as "GPU" on every device (its CPU build too);
# "CPU" names an offload tier, which routers score below the primary one
MEDIUM = "GPU"
FULL_ATTENTION = "full_attention"
ExternalHash = Union[int, bytes]  # noqa: UP007 - msgspec reads the annotation at class creation


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union["WireStored", "WireRemoved", "WireCleared"]]  # noqa: UP007
    data_parallel_rank: int | None = None


class _WireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class WireStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class WireRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None


class WireCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


def external_hash(h: bytes, as_int: bool) -> ExternalHash:
    """vLLM's maybe_convert_block_hash: the low 64 bits as an unsigned int, or the bytes."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF if as_int else h


class BatchEncoder:
    """Encodes one step's events into a payload (on the publisher's thread)."""

    def __init__(self, block_size: int, int_block_hashes: bool, data_parallel_rank: int = 0) -> None:
        self._block_size = block_size
        self._as_int = int_block_hashes
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def wire_event(self, event: KVEvent) -> WireStored | WireRemoved | WireCleared:
        conv = self._as_int
        if isinstance(event, BlocksStored):
            parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash, conv)
            return WireStored([external_hash(h, conv) for h in event.block_hashes], parent, event.token_ids,
                              self._block_size, None, MEDIUM, None, group_idx=0, kv_cache_spec_kind=FULL_ATTENTION)
        if isinstance(event, BlocksRemoved):
            return WireRemoved([external_hash(h, conv) for h in event.block_hashes], MEDIUM, group_idx=0)
        return WireCleared()

    def encode(self, ts: float, events: list[KVEvent]) -> bytes:
        return self._encoder.encode(WireBatch(ts, [self.wire_event(e) for e in events], self._rank))
