"""The KV event publisher over real ZMQ sockets: frames as vLLM sends them, a sequence that only goes
up (across a restart too), the bounded replay endpoint and its end marker, loopback by default, and a
full queue that drops with a gap the subscriber sees instead of blocking the engine."""
import itertools
import logging

import pytest
import zmq

from engine_hooks.kv_events import (END_SEQ, AllBlocksCleared, BlockStored, KVEventPublisher, KVEventSubscriber,
                                    decode_batch)


def stored(i: int) -> BlockStored:
    return BlockStored([bytes([i % 256]) * 32], None, [], 16, None, "CPU", None)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribed(ctx, pub: KVEventPublisher) -> zmq.Socket:
    """A raw SUB socket that provably receives (a slow joiner misses what is sent before it is)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    for _ in range(200):
        pub.publish([])
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return sub
    raise AssertionError("the SUB socket never received")


def replay(ctx, pub: KVEventPublisher, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(5000), "no end marker from the replay endpoint"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def test_binds_loopback_by_default_and_logs_any_other_host(caplog):
    with KVEventPublisher() as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
    assert "not loopback" not in caplog.text
    with caplog.at_level(logging.WARNING), KVEventPublisher("0.0.0.0", replay_port=None) as pub:
        assert pub.endpoint.startswith("tcp://0.0.0.0:") and pub.replay_endpoint is None
    assert "bound to 0.0.0.0, not loopback" in caplog.text
    with pytest.raises(ValueError, match="layout 'xml' must be one of"):
        KVEventPublisher(layout="xml")
    with pytest.raises(ValueError, match="buffer_steps 0 must be a positive integer"):
        KVEventPublisher(buffer_steps=0)


def test_frames_are_topic_sequence_payload_with_consecutive_sequences(ctx):
    with KVEventPublisher(topic="kv-events", sequence_start=41) as pub:
        sub = subscribed(ctx, pub)
        first = pub.last_sequence + 1
        for i in range(5):
            pub.publish([stored(i)], ts=10.0 + i)
        assert pub.flush()
        frames = [sub.recv_multipart() for _ in range(5)]
    assert [f[0] for f in frames] == [b"kv-events"] * 5
    assert [f[1] for f in frames] == [(first + i).to_bytes(8, "big") for i in range(5)]
    batches = [decode_batch(f[2])[0] for f in frames]
    assert [b.ts for b in batches] == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert [b.events for b in batches] == [[stored(i)] for i in range(5)]
    assert {b.data_parallel_rank for b in batches} == {0}


def test_replay_gives_the_buffered_batches_from_a_start_then_the_end_marker(ctx):
    """A bounded buffer: of 8 batches, the last 5 are kept; a start inside gives the rest in order."""
    with KVEventPublisher(buffer_steps=5, sequence_start=100) as pub:
        for i in range(8):
            pub.publish([stored(i)])
        assert pub.flush()
        everything = replay(ctx, pub, 0)
        tail = replay(ctx, pub, 106)
        nothing = replay(ctx, pub, 200)
        assert pub.stats()["replayed_batches"] == 7 and pub.stats()["replay_requests"] == 3
    assert [seq for seq, _ in everything] == [103, 104, 105, 106, 107]
    assert [decode_batch(p)[0].events for _, p in everything] == [[stored(i)] for i in range(3, 8)]
    assert [seq for seq, _ in tail] == [106, 107] and nothing == []


def test_a_restarted_publisher_never_reuses_a_sequence():
    """By default the sequence starts at the wall clock in microseconds and is never handed out ahead of
    it, so a publisher started after another one closed starts above all of its numbers, even when the
    first published faster than its clock moved (here: 1 us per 10 reads of the clock)."""
    ticks = itertools.count()
    clock = lambda: 1_700_000_000_000_000_000 + next(ticks) * 100  # noqa: E731 (ns; 0.1 us a read)
    with KVEventPublisher(clock_ns=clock) as first:
        for i in range(200):
            first.publish([stored(i)])
        assert first.flush()
        last = first.last_sequence
    with KVEventPublisher(clock_ns=clock) as second:
        second.publish([AllBlocksCleared()])
        assert second.flush()
        assert second.last_sequence > last
    assert last >= 1_700_000_000_000_000 + 199


def test_a_full_queue_drops_without_blocking_and_the_subscriber_sees_the_loss():
    with KVEventPublisher(max_queue_size=1) as pub, KVEventSubscriber(pub.endpoint, pub.replay_endpoint,
                                                                      start=None) as sub:
        for _ in range(200):  # until the subscription is live
            pub.publish([AllBlocksCleared()])
            if sub.poll(0.05):
                break
        assert sub.index.in_sync
        n = 3000
        for i in range(n):
            pub.publish([stored(i)])
        assert pub.flush()
        pub.publish([AllBlocksCleared()])  # carries the gap of the drops just before it
        assert pub.flush()
        stats = pub.stats()
        assert sub.sync_to(stats["last_sequence"])
        dropped = stats["dropped"]
        assert dropped > 0
        assert sub.counts["lost_batches"] == dropped  # every drop seen as a gap replay cannot fill
        assert sub.index.in_sync  # the AllBlocksCleared after the loss makes the index exact again
        assert len(sub.index) == 0
