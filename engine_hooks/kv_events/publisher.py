"""KVEventPublisher: a ZMQ PUB stream of KV event batches with a bounded replay endpoint, as vLLM's
``ZmqEventPublisher`` does it.

* **Stream.**  ``publish(events)`` hands a batch to the publisher's thread, which gives it the next
  sequence number and sends ``(topic, seq as 8 bytes big-endian, payload)`` on a PUB socket.
* **Replay.**  A ROUTER socket: a client sends the 8-byte big-endian sequence it wants to start from
  (a DEALER sends ``[b"", start]``, a REQ just ``start``); it gets ``(b"", seq, payload)`` for every
  batch still buffered with ``seq >= start``, in order, then ``(b"", END_SEQ, b"")``.  The buffer keeps
  the last ``buffer_steps`` batches.
* **Never blocks the engine.**  ``publish`` puts on a bounded queue without waiting; when the queue is
  full the batch is dropped, counted and logged, and the sequence skips its number, so a subscriber
  sees a gap that replay cannot fill (it knows it lost something, rather than not knowing).
* **A sequence that never goes back.**  By default the first sequence is the wall clock in
  microseconds when the publisher starts, and the thread hands out a number only once the clock has
  passed it (no real stream waits for that).  So a restarted engine's publisher starts above every
  number its predecessor used, as long as the wall clock did not step back between the two;
  ``sequence_start`` sets the first number instead (e.g. one the caller persisted).
* **Bind like the metrics.**  ``127.0.0.1`` by default (ephemeral ports unless given); another host is
  allowed and logged: the stream has no authentication and discloses prompt fingerprints
  (docs/security.md).

The publisher owns its ZMQ context, both sockets and its thread; ``close()`` stops and frees them.
"""
from __future__ import annotations

import collections
import ipaddress
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import zmq

from .wire import END_SEQ, LAYOUTS, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

_STOP = object()
_POLL_S = 0.02  # the thread's wait between looks at the queue and the replay socket


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: not provably loopback


class KVEventPublisher:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, replay_port: int | None = 0, *, topic: str = "",
                 buffer_steps: int = 10_000, max_queue_size: int = 100_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0, layout: str = "map", sequence_start: int | None = None,
                 clock_ns: Callable[[], int] = time.time_ns):
        """``port`` / ``replay_port``: 0 picks a free one (``endpoint`` / ``replay_endpoint`` say which);
        ``replay_port=None``: no replay endpoint.  ``layout``: ``"map"`` (vLLM after v0.23) or
        ``"array"`` (vLLM v0.9 to v0.23), see ``engine_hooks.kv_events.wire``."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} must be one of {LAYOUTS}")
        for name, value in (("buffer_steps", buffer_steps), ("max_queue_size", max_queue_size), ("hwm", hwm)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        for name, value in (("port", port), ("replay_port", replay_port)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536):
                raise ValueError(f"{name} {value!r} must be a port number (0 picks a free one)")
        if sequence_start is not None and (isinstance(sequence_start, bool) or not isinstance(sequence_start, int)
                                           or not 0 <= sequence_start < 2**63):
            raise ValueError(f"sequence_start {sequence_start!r} must be an integer in 0..2**63-1")
        if not is_loopback(host):
            logger.warning("KV events bound to %s, not loopback: anyone who reaches it reads block hashes "
                           "(prompt fingerprints) without authentication", host)
        self.layout = layout
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._clock_ns = clock_ns
        self._clock_guard = sequence_start is None
        self._next_seq = clock_ns() // 1000 if sequence_start is None else sequence_start
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Condition()  # the counters below, the drop bookkeeping, _pending
        self._pending = 0  # batches queued and not yet sent
        self._skipped = 0  # batches dropped since the last one queued: the sequence skips their numbers
        self._counts = {"published": 0, "dropped": 0, "replay_requests": 0, "replayed_batches": 0}
        self._last_seq: int | None = None
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._bind(zmq.PUB, host, port, hwm)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = self._bind(zmq.ROUTER, host, replay_port, hwm) if replay_port is not None else None
            self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                    if self._replay is not None else None)
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events published on %s (replay %s)", self.endpoint, self.replay_endpoint)

    def _bind(self, kind: int, host: str, port: int, hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        if ":" in host.strip("[]"):
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host.strip('[]')}]"
        try:
            sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(f"cannot bind KV events to tcp://{host}:{port}: {exc}") from None
        return sock

    # ------------------------------------------------------------------ engine side
    def publish(self, events: Sequence[Any], ts: float | None = None) -> None:
        """Queue one batch of events; never waits (a full queue drops it, counted and logged)."""
        if self._closed:
            raise RuntimeError("KV event publisher is closed")
        batch = KVEventBatch(time.time() if ts is None else float(ts), list(events), self.data_parallel_rank)
        with self._lock:
            try:
                self._queue.put_nowait((batch, self._skipped))
                self._skipped = 0
                self._pending += 1
            except queue.Full:
                self._skipped += 1
                self._counts["dropped"] += 1
                dropped = self._counts["dropped"]
                if dropped == 1 or dropped % 1000 == 0:
                    logger.warning("KV event queue full (%d batches): %d batches dropped so far; subscribers "
                                   "see the gap", self._queue.maxsize, dropped)

    def stats(self) -> dict[str, int | None]:
        """``published``, ``dropped``, ``replay_requests``, ``replayed_batches``, ``last_sequence``."""
        with self._lock:
            return {**self._counts, "last_sequence": self._last_seq}

    @property
    def last_sequence(self) -> int | None:
        """The sequence of the last batch sent (None before the first)."""
        with self._lock:
            return self._last_seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout``) until every queued batch is sent; False if some are not yet."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (at most ``timeout``), stop the thread and free the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._queue.put(_STOP, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    logger.warning("KV event publisher: %d batches unsent at close", self._queue.qsize())
                    self._drain_queue()
        self._thread.join(max(0.1, deadline - time.monotonic()) + 1.0)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread did not stop in %.1fs", timeout)
            return  # it still uses the sockets: they go with the process
        self._close_sockets()

    def _drain_queue(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replays()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            try:
                self._send(*item)
            except Exception:  # one bad batch must not stop the stream
                logger.exception("KV event publisher: a batch could not be sent")
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _send(self, batch: KVEventBatch, skipped: int) -> None:
        seq = self._next_seq + skipped
        if self._clock_guard:  # always behind the clock in microseconds (see the module doc)
            while seq >= self._clock_ns() // 1000:
                time.sleep(1e-4)
        payload = encode_batch(batch, self.layout)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at its high-water mark anyway; the replay buffer still has it
            pass
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1
        with self._lock:
            self._last_seq = seq
            self._counts["published"] += 1

    def _serve_replays(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("KV event replay: malformed request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            sent = 0
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                    sent += 1
            self._replay.send_multipart((client, b"", END_SEQ, b""))
            with self._lock:
                self._counts["replay_requests"] += 1
                self._counts["replayed_batches"] += sent
