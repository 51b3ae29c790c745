"""KV-cache events: what the prefix cache stored, evicted and cleared, in the order it happened — vLLM's
`--kv-events-config`, for KV-aware routers (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router, the
SGLang gateway) that track which replica holds which blocks.

- `KVEventsConfig`: vLLM's fields and defaults (`enable_kv_cache_events`, `publisher`, `endpoint`,
  `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`), parsed from the same JSON text
  (`KVEventsConfig.parse`); one octavo field, `int_block_hashes`, is vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
- `KVEventLog`: the BlockManager appends an event at each transition of its prefix cache (a full block's hash
  registered: `BlocksStored`; a cached block reused for other tokens: `BlocksRemoved`; everything dropped:
  `CacheCleared`); the engine takes the step's events once per step and hands them to the publisher
  (runtime/kv_event_publisher.py: ZMQ, msgspec, vLLM's wire format), which does all encoding on its own thread.

Nothing here imports pyzmq or msgspec: an engine without events pays one `is None` test per cached block.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from octavo.errors import InvalidRequestError

PUBLISHERS = ("null", "zmq")


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (same names, same defaults), plus `int_block_hashes`."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "null" | "zmq"; None: "zmq" when events are enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has '*' or '::' or is ipc:// / inproc://, else connected
    replay_endpoint: str | None = None  # ROUTER socket (always bound) that resends buffered batches on request
    buffer_steps: int = 10_000  # batches (engine steps) kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket: messages queued per subscriber, then dropped
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; a full queue drops (never blocks)
    topic: str = ""  # first frame of every message: subscribers filter on it
    # block hashes as vLLM's ExternalBlockHash: True (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the
    # low 64 bits of the hash as an unsigned int (big-endian); False: the hash's bytes as they are
    int_block_hashes: bool = True

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """Events are recorded and sent only when enabled with a real publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> KVEventsConfig:
        """vLLM's `--kv-events-config` JSON (or its dict): unknown keys and wrong types raise InvalidRequestError."""
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"kv_events_config is not valid JSON ({exc}); expected e.g. "
                                          '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'') from None
        else:
            data = text
        if not isinstance(data, dict):
            raise InvalidRequestError(f"kv_events_config must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        for key, value in data.items():
            if key not in known:
                raise InvalidRequestError(f"kv_events_config: unknown key {key!r}; known: {', '.join(known)}")
            _check_type(key, value)
        config = cls(**data)
        config.validate()
        return config

    def validate(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise InvalidRequestError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, "
                                      f"got {self.publisher!r}")
        for name, low in (("buffer_steps", 0), ("hwm", 1), ("max_queue_size", 1)):
            value = getattr(self, name)
            if value < low:  # hwm 0 / an unbounded queue would let a slow subscriber grow the engine's memory
                raise InvalidRequestError(f"kv_events_config.{name} must be >= {low} (bounded), got {value}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidRequestError(f"kv_events_config.{name} must be a ZeroMQ address (tcp://HOST:PORT, "
                                          f"tcp://*:PORT, ipc://PATH), got {value!r}")
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise InvalidRequestError("kv_events_config.replay_endpoint must differ from endpoint")


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,), "int_block_hashes": (bool,),
    "publisher": (str, type(None)), "endpoint": (str,), "replay_endpoint": (str, type(None)), "topic": (str,),
    "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
}


def _check_type(key: str, value: Any) -> None:
    allowed = _TYPES[key]
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise InvalidRequestError(f"kv_events_config.{key} must be {names}, got {value!r}")


# -- the events, as the block manager records them (bytes hashes; the publisher converts them) ---------------
@dataclass(slots=True)
class BlocksStored:
    """Full blocks just registered in the prefix cache: consecutive blocks of one sequence, in order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the hash of the block before the first one (None: the sequence's first)
    token_ids: list[int]  # the blocks' tokens, block_size per block


@dataclass(slots=True)
class BlocksRemoved:
    """Cached blocks evicted (their pool blocks reused for other tokens): the hashes no longer name a block."""

    block_hashes: list[bytes]


@dataclass(slots=True)
class CacheCleared:
    """Every cached block dropped (reset_prefix_cache, an engine start or close, a resync after lost events)."""


KVEvent = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(slots=True)
class KVEventLog:
    """The events since the engine last took them (one step's worth: the engine takes them every step)."""

    events: list[KVEvent] = field(default_factory=list)

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


def replay(events: list[KVEvent], cached: set[bytes] | None = None) -> set[bytes]:
    """The set of cached block hashes a consumer holds after applying EVENTS (in order) to CACHED."""
    state = set() if cached is None else cached
    for event in events:
        if isinstance(event, BlocksStored):
            state.update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            state.difference_update(event.block_hashes)
        else:
            state.clear()
    return state
