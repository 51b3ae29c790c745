"""ZmqEventPublisher: the engine's KV events on a ZeroMQ PUB socket, as vLLM's ZmqEventPublisher sends them.

Wire protocol (vLLM's): every batch is one multipart message `[topic, seq, payload]` on the PUB socket — `seq` an
8-byte big-endian counter from 0, `payload` a msgpack batch (runtime/kv_event_wire.py). With a replay endpoint, a
ROUTER socket answers a request `[start_seq (8 bytes, big-endian)]` (from a REQ or DEALER socket) with every buffered
batch from start_seq on, one message `[seq, payload]` each, then `[-1 (8 bytes, signed), b""]`.

Bounded and never blocking: `publish` (on the engine's thread) only puts the step's events into a queue of
`max_queue_size` batches and returns; encoding and sending happen on the publisher's own thread. A full queue drops
the batch (counted in `dropped_batches`, logged) and the next batch that fits starts with AllBlocksCleared, so a
subscriber that lost events forgets this engine's blocks rather than believe in blocks that may be gone. The PUB
socket keeps at most `hwm` messages per subscriber (ZeroMQ drops beyond), the replay buffer `buffer_steps` batches.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import zmq

from octavo.errors import InvalidRequestError
from octavo.runtime.kv_event_wire import BatchEncoder
from octavo.runtime.kv_events import CacheCleared, KVEvent, KVEventsConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # the thread's wait for a batch: also how often it looks at the replay socket
_JOIN_S = 2.0


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard (`*`, `::`) or an ipc:// / inproc:// address, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.published_batches = 0  # batches accepted (their seq numbers are 0 .. published_batches - 1)
        self.dropped_batches = 0
        self._encoder = BatchEncoder(block_size, config.int_block_hashes)
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self._lost = False  # (engine thread) batches were dropped: the next one starts with AllBlocksCleared
        self._send_failed = False  # (publisher thread) a batch was not sent: the next one starts with AllBlocksCleared
        self._ctx = zmq.Context()  # this publisher's own: closing it never touches another's sockets
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            _attach(self._pub, config.endpoint, "endpoint", bind=binds(config.endpoint))
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _attach(self._replay, config.replay_endpoint, "replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self.endpoint = _last_endpoint(self._pub, config.endpoint)  # tcp://*:0 -> the port it got
        self.replay_endpoint = _last_endpoint(self._replay, config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="octavo-kv-events", daemon=True)
        self._thread.start()
        self.publish([CacheCleared()])  # a (re)started engine holds nothing: subscribers forget what it held before
        log.info("publishing KV events on %s (replay: %s, topic %r)", self.endpoint, self.replay_endpoint,
                 config.topic)

    # -- engine thread ------------------------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (never blocks; a full queue drops them, see the module docstring)."""
        if self._lost:
            events = [CacheCleared(), *events]
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            if not self._lost:
                log.warning("KV event queue full (%d batches: the publisher thread is behind); dropping events, "
                            "subscribers will get AllBlocksCleared", self.config.max_queue_size)
            self._lost = True
            self.dropped_batches += 1
            return
        self.published_batches += 1
        self._lost = False

    def close(self) -> None:
        """Send what is queued and a last AllBlocksCleared (the cache ends with the engine) within a short grace,
        then close the sockets."""
        self.publish([CacheCleared()])
        deadline = time.monotonic() + _JOIN_S
        while True:
            try:
                self._queue.put(None, timeout=max(deadline - time.monotonic(), 0.001))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        if self._thread.is_alive():
            log.warning("the KV event publisher thread did not stop within %.1f s", _JOIN_S)
            return  # it still uses the sockets; the daemon thread ends with the process
        self._close_sockets()

    # -- publisher thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._pub is not None
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("KV event replay request failed")
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            if self._send_failed:
                events = [CacheCleared(), *events]
            try:
                payload = self._encoder.encode(ts, events)
                seq = next(self._seq)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                self._buffer.append((seq, payload))
                self._send_failed = False
            except Exception:  # noqa: BLE001 - a failed send must not end the thread (the engine keeps going)
                log.exception("publishing a KV event batch failed")
                self._send_failed = True

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, empty, END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _attach(sock: zmq.Socket, endpoint: str, name: str, *, bind: bool) -> None:
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect to"
        raise InvalidRequestError(f"kv_events_config.{name}: cannot {verb} {endpoint!r}: {exc} (another process "
                                  "may hold the port: give each replica its own endpoint)") from None


def _last_endpoint(sock: zmq.Socket | None, configured: str | None) -> str | None:
    if sock is None or configured is None or not binds(configured):
        return configured
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
