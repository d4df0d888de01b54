"""EngineCacheQueue in one process: order, barriers with timeouts, authentication, the wire format."""
import re
import threading
import time

import msgpack
import pytest

from cache_manager.queue import wire
from cache_manager.cache_tasks import RankResult, result_body
from cache_manager.queue import EngineCacheQueueClient, EngineCacheQueueServer

SECRET = b"s" * 32


class Rank:
    """A client with its own poll thread, recording every task it receives."""

    def __init__(self, rank: int, n: int, server: EngineCacheQueueServer):
        self.client = EngineCacheQueueClient(rank, n, SECRET, server.address, hello_timeout=10)
        self.tasks: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.tasks.extend(self.client.poll(50))

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.client.close()


@pytest.fixture
def queue():
    results = []
    server = EngineCacheQueueServer(2, SECRET, on_result=results.append)
    ranks = [Rank(r, 2, server) for r in range(2)]
    deadline = time.monotonic() + 10
    while server.registered_ranks() != {0, 1} and time.monotonic() < deadline:
        time.sleep(0.01)
    yield server, ranks, results
    for r in ranks:
        r.close()
    server.close()


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_every_rank_gets_every_task_once_in_order(queue):
    server, ranks, _ = queue
    senders = [threading.Thread(target=lambda k=k: [server.broadcast({"task_id": f"{k}-{i}"}) for i in range(100)])
               for k in range(3)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    assert wait_for(lambda: all(len(r.tasks) == 300 for r in ranks))
    time.sleep(0.1)
    ids = [[t["task_id"] for t in r.tasks] for r in ranks]
    assert ids[0] == ids[1]
    assert len(set(ids[0])) == 300
    for k in range(3):  # each sender's tasks keep their order
        mine = [i for i in ids[0] if i.startswith(f"{k}-")]
        assert mine == [f"{k}-{i}" for i in range(100)]


def test_results_come_back_from_any_thread(queue):
    server, ranks, results = queue
    workers = [threading.Thread(target=ranks[r].client.send_result, args=(RankResult(f"x{r}", r, True, value=r),))
               for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert wait_for(lambda: len(results) == 2)
    assert sorted((r.task_id, r.rank, r.value) for r in results) == [("x0", 0, 0), ("x1", 1, 1)]


def test_results_arrive_field_for_field_whatever_they_leave_at_default(queue):
    """A result travels with only the fields that differ from their defaults; the engine gets
    every field back, the defaults included."""
    server, ranks, results = queue
    sent = [RankResult("plain", 0, True, recv_seq=3, elapsed_ms=0.25, bytes_moved=4096),
            RankResult("failed", 0, False, error="OSError: disk gone", recv_seq=0),
            RankResult("late", 0, True, value=[4, 5], released=False, storage_calls=2, storage_failures=1),
            RankResult("release", 0, True, released=True, recv_seq=7),
            RankResult("control", 0, True, value={"pid": 12, "rank": 0}, elapsed_ms=0.0)]
    for r in sent:
        ranks[0].client.send_result(r)
    assert wait_for(lambda: len(results) == len(sent))
    assert results == sent
    assert sorted(result_body(sent[0])) == \
        ["bytes_moved", "elapsed_ms", "ok", "rank", "recv_seq", "task_id", "type"]


def test_a_result_cannot_claim_another_rank(queue):
    server, ranks, results = queue
    ranks[0].client.send_result(RankResult("forged", 1, True))
    ranks[0].client.send_result(RankResult("honest", 0, True))
    assert wait_for(lambda: len(results) == 1)
    time.sleep(0.2)
    assert [r.task_id for r in results] == ["honest"]


def test_barrier_reduces_to_the_minimum(queue):
    _, ranks, _ = queue
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, ranks[r].client.barrier("b1", 10 - r * 3, 5)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {0: (True, 7), 1: (True, 7)}


def test_barrier_timeout_fails_every_rank_and_they_carry_on(queue):
    _, ranks, _ = queue
    t0 = time.monotonic()
    assert ranks[0].client.barrier("late", 1, timeout=0.3) == (False, None)
    assert time.monotonic() - t0 < 3
    assert ranks[1].client.barrier("late", 1, timeout=0.3) == (False, None)  # arrives after the failure: fails too
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, ranks[r].client.barrier("next", r, 5)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {0: (True, 0), 1: (True, 0)}


def test_a_client_without_the_secret_cannot_join():
    server = EngineCacheQueueServer(1, SECRET)
    try:
        with pytest.raises(TimeoutError, match="no answer from the engine cache queue"):
            EngineCacheQueueClient(0, 1, b"x" * 32, server.address, hello_timeout=0.5)
        assert server.registered_ranks() == set()
        assert server.dropped_frames >= 1
    finally:
        server.close()


def test_broadcast_reports_ranks_it_cannot_reach():
    server = EngineCacheQueueServer(2, SECRET)
    try:
        assert server.broadcast({"task_id": "t"}) == [0, 1]
    finally:
        server.close()


def test_wire_refuses_tampering_and_foreign_frames():
    frame = wire.encode({"type": "task", "n": 1}, SECRET)
    assert wire.decode(frame, SECRET) == {"type": "task", "n": 1}
    tampered = bytearray(frame)
    tampered[len(wire.HEADER) + 2] ^= 1
    cases = {
        "authentication failed": bytes(tampered),
        "bad magic": b"XXXX" + frame[4:],
        "protocol version": wire.MAGIC + bytes([9]) + frame[5:],
        "short frame": frame[:10],
        "oversized": b"x" * (wire.MAX_FRAME_BYTES + 1),
    }
    for reason, bad in cases.items():
        with pytest.raises(wire.BadFrame, match=reason):
            wire.decode(bad, SECRET)
    with pytest.raises(wire.BadFrame, match="not a map"):
        wire.decode(wire.seal(msgpack.packb([1, 2]), SECRET), SECRET)
    with pytest.raises(ValueError, match="exceeds"):
        wire.encode({"type": "x", "blob": b"y" * wire.MAX_FRAME_BYTES}, SECRET)


def test_secret_file_must_be_private(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text((b"k" * 32).hex() + "\n")
    path.chmod(0o644)
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    monkeypatch.setenv(wire.SECRET_FILE_ENV, str(path))
    with pytest.raises(ValueError, match="readable by its owner only"):
        wire.load_secret()
    path.chmod(0o600)
    assert wire.load_secret() == b"k" * 32
    path.write_text("not hex")
    with pytest.raises(ValueError, match="must hold the secret as hex"):
        wire.load_secret()


@pytest.mark.parametrize("body, why", [
    ({"type": "t", "v": [None, True, 1, -2 ** 63, 1.5, "s", b"b", [], {}, {"k": [0.0]}]}, None),
    ({"type": "t", "v": float("nan")}, "non-finite number nan"),
    ({"type": "t", "v": [[1.0, float("-inf")]]}, "non-finite number -inf"),
    ({"type": "t", "v": {"k": {3: 1}}}, "a map key is not a string"),
    ({"type": "t", "v": [(1, 2)]}, "tuple is not plain data"),
    ({"type": "t", "v": {"k": {1, 2}}}, "set is not plain data"),
    ({"type": "t", "v": [[[[1]]]]}, "nested deeper than 4 levels"),
    ({"type": "t", "v": [[[1]]]}, None),  # 4 levels: the limit itself
    ({"type": "t", "v": list(range(98))}, None),  # 100 items with the map's own two
    ({"type": "t", "v": list(range(99))}, "more than 100 items"),
])
def test_check_plain_names_what_is_not_bounded_plain_data(body, why):
    if why is None:
        wire.check_plain(body, max_depth=4, max_items=100)
    else:
        with pytest.raises(wire.BadFrame, match=re.escape(why)):
            wire.check_plain(body, max_depth=4, max_items=100)


@pytest.mark.parametrize("key_bytes", [0, 1, 31, 32, 63, 64, 65, 200])
def test_frame_macs_are_hmac_sha256_for_keys_of_every_length(key_bytes):
    """The MAC comes from precomputed key states (wire._mac), not hmac.new per frame: it must be
    the same bytes, keys longer than SHA-256's 64-byte block (hashed first) included."""
    import hmac
    import os

    key = os.urandom(key_bytes)
    for n in list(range(0, 200)) + [1000, 4096 + 55]:  # every padding case after the key's block
        data = os.urandom(n)
        assert wire._mac(key, data) == hmac.digest(key, data, "sha256"), n
    frame = wire.encode({"type": "t", "v": 1}, key)
    assert frame[-wire.TAG_BYTES:] == hmac.digest(key, frame[:-wire.TAG_BYTES], "sha256")


def test_a_sealed_frame_has_the_documented_layout_and_opens_to_its_envelope():
    """seal and open are in C (csrc/wire_seal.c): the bytes must be exactly the format wire.py
    documents, so the C and any other peer agree."""
    import hmac

    key, session, payload = b"k" * 32, bytes(range(16)), wire.pack({"type": "task", "seq": 7})
    frame = wire.seal(payload, key, session, 0xDEADBEEF, 2**64 - 1)
    framed = wire.HEADER + wire.ENVELOPE.pack(session, 0xDEADBEEF, 2**64 - 1) + payload
    assert frame == framed + hmac.digest(key, framed, "sha256")
    env = wire.open_frame(frame, key)
    assert (env.session, env.stream, env.counter, env.payload) == (session, 0xDEADBEEF, 2**64 - 1, payload)
    assert tuple(env) == (session, 0xDEADBEEF, 2**64 - 1, payload)
    assert wire.open_frame(bytearray(frame), key) == env  # any buffer opens alike


@pytest.mark.parametrize("args, error", [
    ((b"x", b"k", bytes(15), 0, 0), ValueError),  # a session is 16 bytes
    ((b"x", b"k", wire.NO_SESSION, 2**32, 0), OverflowError),
    ((b"x", b"k", wire.NO_SESSION, 0, -1), OverflowError),
    ((b"x", b"k", wire.NO_SESSION, 0, 2**64), OverflowError),
    ((b"x" * wire.MAX_FRAME_BYTES, b"k", wire.NO_SESSION, 0, 0), ValueError),
])
def test_seal_refuses_what_the_envelope_cannot_hold(args, error):
    with pytest.raises(error):
        wire.seal(*args)


def test_open_frame_names_what_is_wrong_with_a_frame():
    key = b"k" * 32
    good = wire.encode({"type": "t"}, key)
    cases = [
        (good[:40], "short frame (40 bytes)"),
        (b"XTMQ" + good[4:], "bad magic"),
        (good[:4] + bytes([9]) + good[5:], f"protocol version 9, expected {wire.PROTOCOL_VERSION}"),
        (good[:-1] + bytes([good[-1] ^ 1]), "authentication failed"),
        (good[:30] + bytes([good[30] ^ 1]) + good[31:], "authentication failed"),
        (good, None),
    ]
    for frame, why in cases:
        if why is None:
            assert wire.open_frame(frame, key).payload == good[33:-32]
            continue
        with pytest.raises(wire.BadFrame, match=re.escape(why)):
            wire.open_frame(frame, key)
    with pytest.raises(wire.BadFrame, match="authentication failed"):
        wire.open_frame(good, b"another secret")
    with pytest.raises(wire.BadFrame, match="oversized frame"):
        wire.open_frame(bytes(wire.MAX_FRAME_BYTES + 1), key)
