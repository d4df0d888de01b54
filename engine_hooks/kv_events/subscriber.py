"""A KV event consumer the way a router keeps one: an index of where each block is, fed by the PUB
stream, with sequence gaps filled from the replay endpoint.

``KVEventIndex`` is the state alone (block hash -> the mediums holding it): ``BlockStored`` adds a
medium, ``BlockRemoved`` takes it away (removed anywhere counts as removed there), ``AllBlocksCleared``
empties it.  ``KVEventSubscriber`` owns a SUB socket and a DEALER for replays, and no thread: the
caller drives it with ``poll`` (e.g. from its own loop) and ``sync_to``.

**Catching up.**  ``start`` is the first sequence the subscriber wants (0: everything the publisher
still buffers; None: only what arrives from now on).  When a batch arrives past the next expected
sequence (it subscribed late, it was disconnected, the PUB socket dropped messages), it asks the replay
endpoint for everything from the next expected one, applies those in order and skips duplicates.  What
replay can no longer give (fell out of the bounded buffer, or dropped by the publisher's full queue) is
counted in ``lost_batches`` and the index is marked out of sync (``index.in_sync``) until the next
``AllBlocksCleared``,
after which it is exact again (the prefix cache sends one when it starts and on an RL clear).
"""
from __future__ import annotations

import logging
import time

import zmq

from .wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, hash_key

logger = logging.getLogger(__name__)


class KVEventIndex:
    def __init__(self) -> None:
        self._where: dict[str | int, set[str | None]] = {}
        self.tags: dict[str | int, object] = {}  # block -> its extra_keys entry (our salt tag), if any
        self.events = 0
        self.in_sync = False  # exact: an AllBlocksCleared was applied and nothing was lost since

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.events += 1
            if isinstance(event, BlockStored):
                extra = event.extra_keys or [None] * len(event.block_hashes)
                for h, key in zip(event.block_hashes, extra + [None] * (len(event.block_hashes) - len(extra))):
                    k = hash_key(h)
                    self._where.setdefault(k, set()).add(event.medium)
                    if key is not None:
                        self.tags[k] = key
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    k = hash_key(h)
                    where = self._where.get(k)
                    if where is not None:
                        where.discard(event.medium)
                        if not where:
                            del self._where[k]
                            self.tags.pop(k, None)
            elif isinstance(event, AllBlocksCleared):
                self._where.clear()
                self.tags.clear()
                self.in_sync = True  # everything before it no longer matters

    def hashes(self, medium: str | None) -> set:
        """The blocks the stream says ``medium`` holds."""
        return {h for h, where in self._where.items() if medium in where}

    def mediums(self, block_hash: str | int) -> frozenset:
        return frozenset(self._where.get(block_hash, ()))

    def __len__(self) -> int:
        return len(self._where)


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 index: KVEventIndex | None = None, start: int | None = 0, replay_timeout: float = 5.0):
        self.index = index if index is not None else KVEventIndex()
        self.next_sequence = start  # the next sequence this subscriber expects (None: take the first seen)
        self.replay_timeout = replay_timeout
        self.counts = {"batches": 0, "live_batches": 0, "replayed_batches": 0, "duplicates": 0,
                       "lost_batches": 0, "unknown_events": 0, "replays": 0}
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._dealer: zmq.Socket | None = None
        self._started = False  # a batch was applied: a gap from here on is a loss

    # ------------------------------------------------------------------ receiving
    def poll(self, timeout: float = 0.0) -> int:
        """Apply every batch that has arrived, waiting at most ``timeout`` for the first; returns how many."""
        applied = 0
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                logger.warning("KV events: malformed message of %d frames ignored", len(frames))
                continue
            applied += self._on_live(int.from_bytes(frames[1], "big"), frames[2])
        return applied

    def sync_to(self, sequence: int, timeout: float = 5.0) -> bool:
        """Poll until the batch ``sequence`` is applied (or was lost for good); then, if the live stream
        has not brought it, ask the replay endpoint.  False if still behind after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self._past(sequence) and time.monotonic() < deadline:
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        if not self._past(sequence) and self._replay_endpoint is not None:
            self._replay_from(self.next_sequence or 0)
        return self._past(sequence)

    def _past(self, sequence: int) -> bool:
        return self.next_sequence is not None and self.next_sequence > sequence

    def _on_live(self, seq: int, payload: bytes) -> int:
        if self.next_sequence is None:
            self.next_sequence = seq
        if seq < self.next_sequence:
            self.counts["duplicates"] += 1
            return 0
        applied = 0
        if seq > self.next_sequence:  # a gap: fill it from the replay endpoint
            applied += self._replay_from(self.next_sequence) if self._replay_endpoint else 0
            if seq > self.next_sequence:
                self._gap(seq - self.next_sequence)
            if seq < self.next_sequence:  # the replay brought it already
                self.counts["duplicates"] += 1
                return applied
        self._apply(seq, payload)
        self.counts["live_batches"] += 1
        return applied + 1

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch, unknown = decode_batch(payload)
        except ValueError as exc:
            logger.warning("KV events: batch %d undecodable (%s): counted lost", seq, exc)
            self._lose(1)
        else:
            self.counts["unknown_events"] += unknown
            self.index.apply(batch)
        self.counts["batches"] += 1
        self.next_sequence = seq + 1
        self._started = True

    def _gap(self, n: int) -> None:
        """``n`` batches before the next one will never come.  Before the first batch this subscriber
        applies, that is history it never had: not counted, and the index waits for an AllBlocksCleared
        (``in_sync`` is False until then anyway)."""
        if self._started:
            self._lose(n)

    def _lose(self, n: int) -> None:
        self.counts["lost_batches"] += n
        if self.index.in_sync:
            logger.warning("KV events: %d batches lost for good; the index is out of sync until the next "
                           "AllBlocksCleared", n)
        self.index.in_sync = False

    # ------------------------------------------------------------------ replay
    def _replay_from(self, start: int) -> int:
        """Ask for every buffered batch from ``start`` and apply them in order (their live copies then
        count as duplicates).  Returns how many."""
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self._replay_endpoint)
        if self.next_sequence is None:
            self.next_sequence = start
        self.counts["replays"] += 1
        self._dealer.send_multipart((b"", start.to_bytes(8, "big")))
        applied = 0
        deadline = time.monotonic() + self.replay_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._dealer.poll(int(remaining * 1000)):
                logger.warning("KV events: no end of replay from %s in %.1fs", self._replay_endpoint,
                               self.replay_timeout)
                self._dealer.close(0)  # a late answer must not be read as the next replay's
                self._dealer = None
                return applied
            frames = self._dealer.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            if frames[1] == END_SEQ:
                return applied
            seq = int.from_bytes(frames[1], "big")
            if seq < self.next_sequence:
                continue
            if seq > self.next_sequence:  # fell out of the buffer, or dropped by the publisher
                self._gap(seq - self.next_sequence)
            self._apply(seq, frames[2])
            self.counts["replayed_batches"] += 1
            applied += 1

    def close(self) -> None:
        """Close the sockets; idempotent."""
        for sock in (self._sub, self._dealer):
            if sock is not None and not sock.closed:
                sock.close(0)
        self._dealer = None
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
