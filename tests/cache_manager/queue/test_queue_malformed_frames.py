"""EngineCacheQueue under malformed authenticated frames, over real zmq sockets on loopback: a
FakeRank / FakeServer speaks the protocol on raw sockets with the real secret, to send
authenticated frames that the real peers never would (malformed bodies, replays).

Each test asserts what was delivered, what was dropped and counted, and that every thread is
alive and the queue still works afterwards.
"""
from __future__ import annotations

import os
import secrets
import threading
import time

import msgpack
import zmq

from cache_manager.queue import wire
from cache_manager.queue import EngineCacheQueueClient, EngineCacheQueueServer
from cache_manager.queue.session import CONTROL, DOWN, FIRST_RESULTS, TASKS, UP, stream
from tests import queue_helpers
from tests.queue_helpers import SECRET, TIMEOUT, Rank, raw_socket, recv_all, registered, result, wait_for

server = queue_helpers.server  # the shared fixture, under its name here


class FakeRank:
    """A rank that holds the real secret and speaks the protocol on raw sockets, so it can send
    authenticated frames a real client never would.  One control, task and result connection."""

    def __init__(self, server: EngineCacheQueueServer, rank: int):
        self.ctx = zmq.Context()
        self.ctl = raw_socket(self.ctx, server.address)
        self.ctl.send(wire.encode({"type": "hello", "channel": "control", "rank": rank, "pid": os.getpid(),
                                   "nonce": secrets.token_bytes(16)}, SECRET))
        assert self.ctl.poll(int(TIMEOUT * 1000)), "no welcome"
        env = wire.open_frame(self.ctl.recv(), SECRET)
        self.session, self.ctl_in = env.session, 1
        self.counters = {CONTROL: 0, TASKS: 0, FIRST_RESULTS: 0}
        self.send(CONTROL, {"type": "ready"})
        self.tasks = raw_socket(self.ctx, f"tcp://127.0.0.1:{server.task_port}")
        self.send(TASKS, {"type": "hello", "channel": "tasks"}, sock=self.tasks)
        self.results = raw_socket(self.ctx, server.address)
        self.send(FIRST_RESULTS, {"type": "hello", "channel": "results"}, sock=self.results)

    def send_payload(self, channel: int, payload: bytes, sock: zmq.Socket | None = None) -> None:
        """Seal ``payload`` (raw msgpack bytes) as the next frame of ``channel``."""
        sock = sock or (self.ctl if channel == CONTROL else self.results)
        sock.send(wire.seal(payload, SECRET, self.session, stream(channel, UP), self.counters[channel]))
        self.counters[channel] += 1

    def send(self, channel: int, body: dict, sock: zmq.Socket | None = None) -> None:
        self.send_payload(channel, msgpack.packb(body, use_bin_type=True), sock)

    def control_bodies(self, wait_ms: int) -> list[dict]:
        out = []
        for frame in recv_all(self.ctl, wait_ms):
            env = wire.open_frame(frame, SECRET)
            assert (env.session, env.stream, env.counter) == (self.session, stream(CONTROL, DOWN), self.ctl_in)
            self.ctl_in += 1
            out.append(wire.parse_body(env.payload))
        return out

    def close(self) -> None:
        self.ctx.destroy(0)


class FakeServer:
    """The server's side of the handshake on raw sockets, to send a real client authenticated
    frames the real server never would."""

    def __init__(self, rank: int = 0):
        self.ctx = zmq.Context()
        self.ctl, self.tasks = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.ROUTER)
        for sock in (self.ctl, self.tasks):
            sock.setsockopt(zmq.LINGER, 0)
        port = self.ctl.bind_to_random_port("tcp://127.0.0.1")
        task_port = self.tasks.bind_to_random_port("tcp://127.0.0.1")
        made: list = []
        maker = threading.Thread(target=lambda: made.append(
            EngineCacheQueueClient(rank, 1, SECRET, f"tcp://127.0.0.1:{port}", hello_timeout=TIMEOUT)))
        maker.start()
        assert self.ctl.poll(int(TIMEOUT * 1000))
        self.ctl_id, hello = self.ctl.recv_multipart()
        nonce = wire.decode(hello, SECRET)["nonce"]
        self.session = wire.new_session()
        self.counters = {CONTROL: 0, TASKS: 0}
        self.send(CONTROL, {"type": "welcome", "nonce": nonce, "rank": rank, "task_port": task_port})
        maker.join(TIMEOUT)
        self.client: EngineCacheQueueClient = made[0]
        assert self.tasks.poll(int(TIMEOUT * 1000))
        self.task_id, _ = self.tasks.recv_multipart()
        assert self.ctl.poll(int(TIMEOUT * 1000))
        ready = wire.open_frame(self.ctl.recv_multipart()[1], SECRET)
        assert (ready.session, ready.stream, ready.counter) == (self.session, stream(CONTROL, UP), 0)

    def frame(self, channel: int, payload: bytes, session: bytes | None = None) -> bytes:
        frame = wire.seal(payload, SECRET, session or self.session, stream(channel, DOWN), self.counters[channel])
        self.counters[channel] += 1
        return frame

    def send(self, channel: int, body: dict) -> bytes:
        return self.send_frame(channel, self.frame(channel, msgpack.packb(body, use_bin_type=True)))

    def send_frame(self, channel: int, frame: bytes) -> bytes:
        sock, identity = (self.ctl, self.ctl_id) if channel == CONTROL else (self.tasks, self.task_id)
        sock.send_multipart([identity, frame])
        return frame

    def poll_until(self, count: int) -> list[dict]:
        """Poll the client until it dropped or returned ``count`` frames in all (or a timeout)."""
        got: list[dict] = []
        deadline = time.monotonic() + TIMEOUT
        while len(got) + self.client.dropped_frames < count and time.monotonic() < deadline:
            got.extend(self.client.poll(20))
        got.extend(self.client.poll(50))  # anything more would be a bug: give it the chance to show
        return got

    def close(self) -> None:
        self.client.close(0)
        self.ctx.destroy(0)


def deep(depth: int) -> bytes:
    """msgpack of a list nested ``depth`` deep, written by hand (msgpack's packer refuses it)."""
    return b"\x91" * depth + b"\xc0"


def body_with(fields: dict, key: str, raw_value: bytes) -> bytes:
    """msgpack of the map ``fields`` plus ``key`` whose value is the raw msgpack ``raw_value``."""
    items = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
    return bytes([0x80 | (len(fields) + 1)]) + items + msgpack.packb(key) + raw_value


# -- malformed authenticated frames ----------------------------------------------------
RESULT = {"type": "result", "task_id": "x", "rank": 1, "ok": True}
BAD_RESULTS = [
    {**RESULT, "rank": [1]},  # unhashable
    {**RESULT, "rank": 5},
    {**RESULT, "rank": 0},  # another rank's
    {**RESULT, "rank": True},
    {**RESULT, "task_id": 3},
    {**RESULT, "ok": "yes"},
    {**RESULT, "error": 7},
    {**RESULT, "elapsed_ms": 1e300},
    {**RESULT, "recv_seq": 2 ** 63},
    {**RESULT, "evil": 1},
    {"type": "result", "task_id": "x", "rank": 1},
    {**RESULT, "value": {1: 2}},  # a non-string map key
    {"type": 3},
]
BARRIER = {"type": "barrier", "name": "b", "value": 1, "timeout": 1.0}
BAD_BARRIERS = [
    {**BARRIER, "timeout": 1e300},
    {**BARRIER, "timeout": -1},
    {**BARRIER, "timeout": "5"},
    {**BARRIER, "name": ["b"]},
    {**BARRIER, "value": 1.5},
    {**BARRIER, "value": 2 ** 63},
    {"type": "hello", "channel": "control", "rank": 1, "pid": 1, "nonce": b"n" * 16},  # a hello mid-session
    {"type": "ready"},  # a second ready
    {"type": "result", **RESULT},  # a result on the control channel
]


def malformed_payloads() -> dict[int, list[bytes]]:
    packed = lambda b: msgpack.packb(b, use_bin_type=True)  # noqa: E731
    results = [packed(b) for b in BAD_RESULTS] + [
        body_with(RESULT, "value", deep(10_000)),  # msgpack's own limit
        body_with(RESULT, "value", deep(100)),  # ours
        body_with(RESULT, "elapsed_ms", b"\xcb" + bytes.fromhex("7ff0000000000000")),  # inf
        body_with(RESULT, "elapsed_ms", b"\xcb" + bytes.fromhex("7ff8000000000000")),  # nan
        body_with(RESULT, "value", msgpack.packb(msgpack.ExtType(5, b"x"))),
        packed([1, 2]),
        b"\xc1garbage",
    ]
    barriers = [packed(b) for b in BAD_BARRIERS] + [
        body_with(BARRIER, "timeout", b"\xcb" + bytes.fromhex("7ff0000000000000")),
        body_with(BARRIER, "timeout", b"\xcb" + bytes.fromhex("7ff8000000000000")),
        body_with(BARRIER, "value", deep(10_000)),
    ]
    return {FIRST_RESULTS: results, CONTROL: barriers}


def test_malformed_authenticated_frames_are_dropped_and_the_queue_works(server):
    real = Rank(0, 2, server.address)
    fake = FakeRank(server, 1)
    try:
        assert registered(server, {0, 1})
        payloads = malformed_payloads()
        before, reasons = server.dropped_frames, dict(server.drop_reasons)
        for channel, frames in payloads.items():
            for payload in frames:
                fake.send_payload(channel, payload)
        count = sum(map(len, payloads.values()))
        assert wait_for(lambda: server.dropped_frames == before + count)
        time.sleep(0.05)
        assert server.dropped_frames == before + count, "each bad frame is dropped exactly once"
        assert server.results == [] and server.loop_errors == 0 and server.io_thread_alive()
        delta = {k: v - reasons.get(k, 0) for k, v in server.drop_reasons.items() if v != reasons.get(k, 0)}
        assert delta == {"malformed": count - 3, "unexpected": 3}  # a mid-session hello, ready, result

        # Everything still works: tasks both ways, results from both ranks, a barrier on both.
        assert server.broadcast({"task_id": "t"}) == []
        assert wait_for(lambda: real.ids() == ["t"])
        task = wire.open_frame(recv_all(fake.tasks, 1000)[0], SECRET)
        assert (task.session, task.counter) == (fake.session, 0)
        real.client.send_result(result("t", 0))
        fake.send(FIRST_RESULTS, {**RESULT, "task_id": "t", "value": [[1, [2]]], "elapsed_ms": 1})
        assert wait_for(lambda: len(server.results) == 2)
        assert sorted((r.task_id, r.rank) for r in server.results) == [("t", 0), ("t", 1)]
        assert next(r for r in server.results if r.rank == 1).elapsed_ms == 1.0
        fake.send(CONTROL, BARRIER)
        assert real.client.barrier("b", 4, timeout=2) == (True, 1)
        assert [b["ok"] for b in fake.control_bodies(1000)] == [True]
    finally:
        real.close()
        fake.close()


def test_the_client_drops_replayed_and_malformed_frames_from_its_server():
    fake = FakeServer()
    client = fake.client
    try:
        good = fake.send(TASKS, {"type": "task", "seq": 0, "task": {"task_id": "ok0"}})
        fake.send_frame(TASKS, good)  # replayed
        bad = [
            msgpack.packb({"type": "task", "seq": 1, "task": [1]}),
            msgpack.packb({"type": "task", "seq": "1", "task": {}}),
            msgpack.packb({"type": "barrier_done", "name": "x", "ok": True}),  # on the task stream
            body_with({"type": "task", "seq": 1}, "task", deep(10_000)),
            body_with({"type": "task", "seq": 1}, "task", deep(50)),
            body_with({"type": "task", "seq": 1}, "task", b"\xcb" + bytes.fromhex("7ff8000000000000")),
        ]
        for payload in bad:
            fake.send_frame(TASKS, fake.frame(TASKS, payload))
        other_session = fake.frame(TASKS, msgpack.packb({"type": "task", "seq": 1, "task": {"task_id": "x"}}),
                                   session=wire.new_session())
        fake.counters[TASKS] -= 1
        fake.send_frame(TASKS, other_session)
        fake.send(CONTROL, {"type": "barrier_done", "name": 5, "ok": "yes"})
        fake.send(TASKS, {"type": "task", "seq": 1, "task": {"task_id": "ok1"}})
        got = fake.poll_until(2 + 1 + len(bad) + 2)
        assert [t["task_id"] for t in got] == ["ok0", "ok1"]
        assert client.dropped_frames == 1 + len(bad) + 2
        assert client.loop_errors == 0
    finally:
        fake.close()
