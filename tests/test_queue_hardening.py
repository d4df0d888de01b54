"""EngineCacheQueue under attack and under faults, over real zmq sockets on loopback.

* a Tap sits between real clients and the real server (a message-level man in the middle on
  127.0.0.2) and replays, reorders or moves the exact bytes the real peers produced;
* a FakeRank / FakeServer speaks the protocol on raw sockets with the real secret, to send
  authenticated frames that the real peers never would (malformed bodies);
* exceptions are injected into the server's I/O loop and the client's poll.

Each test asserts what happened (what was delivered, what was dropped and counted), and that
every thread is alive and the queue still works afterwards.
"""
from __future__ import annotations

import os
import queue
import re
import secrets
import stat
import threading
import time

import msgpack
import pytest
import zmq

from cache_manager.queue import wire
from cache_manager.cache_tasks import RankResult
from cache_manager.queue import EngineCacheQueueClient, EngineCacheQueueServer
from cache_manager.queue.session import CONTROL, DOWN, FIRST_RESULTS, TASKS, UP, stream

SECRET = secrets.token_bytes(32)
TIMEOUT = 5.0


def wait_for(cond, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def raw_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def recv_all(sock: zmq.Socket, wait_ms: int = 0) -> list[bytes]:
    out = []
    while sock.poll(wait_ms if not out else 0):
        out.append(sock.recv())
    return out


class Rank:
    """A real client with its own poll thread, recording every task it receives; ``paused``
    stops it reading (test_local_link's rank that does not read)."""

    def __init__(self, rank: int, n: int, address: str):
        self.client = EngineCacheQueueClient(rank, n, SECRET, address, hello_timeout=TIMEOUT)
        self.tasks: list[dict] = []
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def ids(self) -> list[str]:
        return [t["task_id"] for t in self.tasks]

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.005)
                continue
            self.tasks.extend(self.client.poll(20))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.client.close(0)


class Tap:
    """A message-level man in the middle: forwards every frame unchanged, one upstream connection
    per downstream one, records them, and replays or reorders them on request.  Its control port
    is on 127.0.0.2 and its task port is the server's task port number on 127.0.0.2, so a client
    given ``tap.address`` reaches the server's task port through the tap too."""

    def __init__(self, server: EngineCacheQueueServer):
        self.ctx = zmq.Context()
        self.fronts = {kind: self.ctx.socket(zmq.ROUTER) for kind in ("control", "tasks")}
        for sock in self.fronts.values():
            sock.setsockopt(zmq.LINGER, 0)
        port = self.fronts["control"].bind_to_random_port("tcp://127.0.0.2")
        self.fronts["tasks"].bind(f"tcp://127.0.0.2:{server.task_port}")
        self.address = f"tcp://127.0.0.2:{port}"
        self.targets = {"control": server.address, "tasks": f"tcp://127.0.0.1:{server.task_port}"}
        self.ups: dict[tuple[str, bytes], zmq.Socket] = {}
        self.owner: dict[zmq.Socket, tuple[str, bytes]] = {}
        self.log: list[tuple[str, str, bytes, bytes]] = []  # (up|down, kind, downstream identity, frame)
        self.swap_next: set[bytes] = set()  # connections whose next two downstream frames go out swapped
        self.held: dict[bytes, bytes] = {}
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()
        self.poller = zmq.Poller()
        for sock in self.fronts.values():
            self.poller.register(sock, zmq.POLLIN)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def frames(self, direction: str, kind: str, prefix: bytes) -> list[bytes]:
        return [f for d, k, i, f in list(self.log) if d == direction and k == kind and i.startswith(prefix)]

    def identity(self, kind: str, prefix: bytes) -> bytes:
        return next(i for d, k, i, f in list(self.log) if k == kind and i.startswith(prefix))

    def replay(self, direction: str, kind: str, identity: bytes, frame: bytes) -> None:
        """Send ``frame`` again on the existing connection of ``identity`` (same TCP connection)."""
        done = threading.Event()
        self.commands.put((direction, kind, identity, frame, done))
        assert done.wait(TIMEOUT)

    def _run(self) -> None:
        while not self.stop.is_set():
            for sock, _ in self.poller.poll(5):
                if sock in self.fronts.values():
                    kind = next(k for k, s in self.fronts.items() if s is sock)
                    identity, frame = sock.recv_multipart()
                    self.log.append(("up", kind, identity, frame))
                    self._upstream(kind, identity).send(frame)
                else:
                    kind, identity = self.owner[sock]
                    frame = sock.recv()
                    self.log.append(("down", kind, identity, frame))
                    self._downstream(kind, identity, frame)
            while not self.commands.empty():
                direction, kind, identity, frame, done = self.commands.get()
                if direction == "up":
                    self._upstream(kind, identity).send(frame)
                else:
                    self.fronts[kind].send_multipart([identity, frame])
                done.set()

    def _upstream(self, kind: str, identity: bytes) -> zmq.Socket:
        up = self.ups.get((kind, identity))
        if up is None:
            up = self.ups[(kind, identity)] = raw_socket(self.ctx, self.targets[kind])
            self.owner[up] = (kind, identity)
            self.poller.register(up, zmq.POLLIN)
        return up

    def _downstream(self, kind: str, identity: bytes, frame: bytes) -> None:
        if identity in self.swap_next and identity not in self.held:
            self.held[identity] = frame
            return
        self.fronts[kind].send_multipart([identity, frame])
        if identity in self.held:
            self.swap_next.discard(identity)
            self.fronts[kind].send_multipart([identity, self.held.pop(identity)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.ctx.destroy(0)


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


@pytest.fixture
def server():
    results: list[RankResult] = []
    # These tests tap and replay zmq frames: ranks take the task port (the local link has its own tests).
    srv = EngineCacheQueueServer(2, SECRET, on_result=results.append, local_links=False)
    srv.results = results
    yield srv
    srv.close()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(0)


def registered(srv: EngineCacheQueueServer, ranks: set[int]) -> bool:
    return wait_for(lambda: srv.registered_ranks() == ranks)


def reasons(srv: EngineCacheQueueServer) -> dict[str, int]:
    srv.pump()  # the task port is read by whoever pumps (the engine's supervisor), not the I/O thread
    return srv.drop_reasons


def result(task_id: str, rank: int) -> RankResult:
    return RankResult(task_id, rank, True, value=[1, 2])


# -- replay, reorder, cross-connection (real peers' bytes through the tap) ----------------
def test_a_replayed_or_reordered_task_frame_never_runs(server):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        assert server.broadcast({"task_id": "a"}) == []
        assert wait_for(lambda: all(r.ids() == ["a"] for r in ranks))
        frame_a = tap.frames("down", "tasks", b"rank0.t.")[0]
        tasks0, tasks1 = tap.identity("tasks", b"rank0.t."), tap.identity("tasks", b"rank1.t.")
        tap.replay("down", "tasks", tasks0, frame_a)  # the same bytes again, on the same connection
        tap.replay("down", "tasks", tasks1, frame_a)  # rank 0's frame on rank 1's connection
        assert wait_for(lambda: [r.client.dropped_frames for r in ranks] == [1, 1])
        assert server.broadcast({"task_id": "b"}) == []
        assert wait_for(lambda: all(r.ids() == ["a", "b"] for r in ranks))

        tap.swap_next.add(tasks0)  # the tap swaps the next two task frames of rank 0
        server.broadcast({"task_id": "c"})
        server.broadcast({"task_id": "d"})
        assert wait_for(lambda: "c" in ranks[0].ids() and ranks[0].client.dropped_frames == 2)
        time.sleep(0.05)
        assert ranks[0].ids() == ["a", "b", "c"], "the frame that arrived before its turn was dropped"
        assert all(r.client.loop_errors == 0 for r in ranks)
    finally:
        for r in ranks:
            r.close()
        tap.close()


def test_replayed_result_and_barrier_frames_are_dropped(server, ctx):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        ranks[0].client.send_result(result("r1", 0))
        assert wait_for(lambda: len(server.results) == 1)
        channel = tap.identity("control", b"rank0.r")
        captured = tap.frames("up", "control", b"rank0.r")[-1]
        before = server.dropped_frames
        tap.replay("up", "control", channel, captured)  # on the result connection it came on
        attacker = raw_socket(ctx, server.address)
        attacker.send(captured)  # from a connection of its own
        assert wait_for(lambda: server.dropped_frames == before + 2)
        ranks[0].client.send_result(result("r2", 0))  # the stream goes on after the replay
        assert wait_for(lambda: len(server.results) == 2)
        assert [r.task_id for r in server.results] == ["r1", "r2"]

        out = {}
        workers = [threading.Thread(target=lambda r=r: out.__setitem__(r, ranks[r].client.barrier("b", r + 5, 2)))
                   for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(TIMEOUT)
        assert out == {0: (True, 5), 1: (True, 5)}
        done = tap.frames("down", "control", b"rank0.")[-1]  # rank 0's barrier_done
        tap.replay("down", "control", tap.identity("control", b"rank0."), done)
        assert wait_for(lambda: ranks[0].client.dropped_frames == 1)
        assert recv_all(attacker, 100) == [], "the attacker received something"
        assert server.loop_errors == 0 and server.io_thread_alive()
    finally:
        for r in ranks:
            r.close()
        tap.close()


def test_a_replayed_hello_neither_registers_nor_displaces(server, ctx):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        hello, ready = tap.frames("up", "control", b"rank0.")[:2]
        task_hello = tap.frames("up", "tasks", b"rank0.t.")[0]
        before = dict(server.drop_reasons)
        attacker, attacker_tasks = raw_socket(ctx, server.address), raw_socket(ctx, f"tcp://127.0.0.1:{server.task_port}")
        for frame in (hello, ready):
            attacker.send(frame)
        attacker_tasks.send(task_hello)
        assert wait_for(lambda: reasons(server).get("refused", 0) == before.get("refused", 0) + 2)
        assert server.drop_reasons.get("unauthenticated", 0) == before.get("unauthenticated", 0) + 1
        assert server.registered_ranks() == {0, 1}
        assert server.broadcast({"task_id": "t"}) == []
        assert wait_for(lambda: all(r.ids() == ["t"] for r in ranks))
        assert recv_all(attacker, 100) == [] and recv_all(attacker_tasks) == [], "the attacker received something"

        # A client with the real secret cannot take a live rank over either.
        with pytest.raises(TimeoutError):
            EngineCacheQueueClient(0, 2, SECRET, server.address, hello_timeout=0.3)
        assert server.broadcast({"task_id": "u"}) == []
        assert wait_for(lambda: ranks[0].ids() == ["t", "u"])
    finally:
        for r in ranks:
            r.close()
        tap.close()


def test_a_forgotten_rank_restarts_and_its_old_hello_cannot_claim_it(server, ctx):
    tap = Tap(server)
    old = Rank(0, 2, tap.address)
    other = Rank(1, 2, server.address)
    new = None
    try:
        assert registered(server, {0, 1})
        hello, ready = tap.frames("up", "control", b"rank0.")[:2]
        old.close()
        server.forget_rank(0)  # the engine saw the process die
        assert server.registered_ranks() == {1}
        attacker = raw_socket(ctx, server.address)
        attacker.send(hello)  # answered (nobody holds rank 0), but only the secret completes it
        assert attacker.poll(int(TIMEOUT * 1000))
        attacker.recv()
        attacker.send(ready)  # the old session's ready: not this connection's session
        time.sleep(0.1)
        assert server.registered_ranks() == {1}
        new = Rank(0, 2, server.address)
        assert registered(server, {0, 1})
        assert server.broadcast({"task_id": "after-restart"}) == []
        assert wait_for(lambda: new.ids() == ["after-restart"] and other.ids() == ["after-restart"])
        assert recv_all(attacker, 50) == []
    finally:
        for r in (other, new):
            if r is not None:
                r.close()
        tap.close()


def test_frames_from_a_connection_that_never_authenticated_do_nothing(server, ctx):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        ranks[0].client.send_result(result("real0", 0))  # binds rank 0's result channel 2
        assert wait_for(lambda: len(server.results) == 1)
        session = wire.open_frame(tap.frames("down", "control", b"rank0.")[0], SECRET).session
        forged = [  # well-MACed with the real secret, on a connection with no handshake
            wire.encode({"type": "result", **result("forged", 0).__dict__}, SECRET),
            wire.encode({"type": "result", **result("forged", 0).__dict__}, SECRET, session, stream(2, UP), 1),
            wire.encode({"type": "barrier", "name": "b", "value": 0, "timeout": 1}, SECRET, session, 0, 1),
            wire.encode({"type": "ready"}, SECRET, session, 0, 0),
            wire.encode({"type": "hello", "channel": "results"}, SECRET, session, stream(2, UP), 0),  # bound already
        ]
        attacker = raw_socket(ctx, server.address)
        before = server.dropped_frames
        for frame in forged:
            attacker.send(frame)
        assert wait_for(lambda: server.dropped_frames == before + len(forged))
        assert ranks[1].client.barrier("b", 1, timeout=0.3) == (False, None), "the forged barrier counted"
        assert [r.task_id for r in server.results] == ["real0"]
        assert recv_all(attacker, 50) == []
        ranks[0].client.send_result(result("real1", 0))
        assert wait_for(lambda: [r.task_id for r in server.results] == ["real0", "real1"])
    finally:
        for r in ranks:
            r.close()
        tap.close()


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


# -- exceptions injected into long-lived loops --------------------------------------------
def raise_once(obj, name: str, monkeypatch) -> list:
    """Make ``obj.name`` raise on its next call only; returns the list of calls that raised."""
    real, raised = getattr(obj, name), []

    def patched(*args, **kwargs):
        if not raised:
            raised.append(args)
            raise RuntimeError(f"injected fault in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, patched)
    return raised


def test_an_exception_in_the_server_io_loop_costs_one_iteration(server, monkeypatch):
    ranks = [Rank(0, 2, server.address), Rank(1, 2, server.address)]
    try:
        assert registered(server, {0, 1})
        expire = raise_once(server, "_expire_barriers", monkeypatch)  # the loop itself
        handle = raise_once(server, "_result", monkeypatch)  # one frame's handling
        ranks[0].client.send_result(result("lost", 0))  # wakes the loop; its handling raises
        assert wait_for(lambda: expire and handle and server.loop_errors == 2)
        assert server.io_thread_alive() and server.results == []

        assert server.broadcast({"task_id": "t"}) == []
        assert wait_for(lambda: all(r.ids() == ["t"] for r in ranks))
        for r in ranks:
            r.client.send_result(result("t", r.client.rank))
        assert wait_for(lambda: sorted(r.rank for r in server.results) == [0, 1])
        t0 = time.monotonic()
        assert ranks[0].client.barrier("alone", 1, timeout=0.3) == (False, None)  # deadlines still fire
        assert time.monotonic() - t0 < 2
        assert server.loop_errors == 2
    finally:
        for r in ranks:
            r.close()


def test_an_exception_in_the_client_poll_costs_one_frame(server, monkeypatch):
    rank = Rank(0, 2, server.address)
    try:
        assert wait_for(lambda: 0 in server.registered_ranks())
        real_open, raised = rank.client._open, []

        def open_then_fail(frame, channel):
            body = real_open(frame, channel)
            if channel == TASKS and not raised:
                raised.append(body)
                raise RuntimeError("injected fault in the client's task handling")
            return body

        monkeypatch.setattr(rank.client, "_open", open_then_fail)
        server.broadcast({"task_id": "lost"})
        server.broadcast({"task_id": "kept"})
        assert wait_for(lambda: rank.ids() == ["kept"])
        assert rank.client.loop_errors == 1 and rank.thread.is_alive()
    finally:
        rank.close()


# -- transport bounds ---------------------------------------------------------------------
def test_every_peer_facing_socket_bounds_what_it_receives(server):
    rank = Rank(0, 2, server.address)
    try:
        rank.client.send_result(result("r", 0))
        sockets = [server._router, server._tasks, rank.client._sock, rank.client._task_sock, *rank.client._channels]
        for sock in sockets:
            assert sock.getsockopt(zmq.RCVHWM) > 0
            assert sock.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_FRAME_BYTES
        assert server._tasks.getsockopt(zmq.SNDHWM) == 0  # ordered tasks are never dropped at a mark
    finally:
        rank.close()


# -- the secret file ------------------------------------------------------------------------
def write_secret(path, mode: int = 0o600, uid: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, (b"k" * 32).hex().encode() + b"\n")
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1)
    finally:
        os.close(fd)


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    return lambda path: monkeypatch.setenv(wire.SECRET_FILE_ENV, str(path))


def test_secret_file_good_case(tmp_path, secret_env):
    path = tmp_path / "secret"
    write_secret(path)
    secret_env(path)
    assert wire.load_secret() == b"k" * 32


def test_secret_file_readable_by_others_is_refused(tmp_path, secret_env):
    path = tmp_path / "secret"
    write_secret(path, 0o644)
    secret_env(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*mode 644.*owner only"):
        wire.load_secret()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@needs_root
def test_secret_file_of_another_user_is_refused(tmp_path, secret_env):
    path = tmp_path / "secret"
    write_secret(path, uid=65534)
    secret_env(path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: owned by uid 65534, not by the current user")):
        wire.load_secret()


@needs_root
def test_secret_symlink_to_another_users_file_is_refused(tmp_path, secret_env):
    target, link = tmp_path / "theirs", tmp_path / "secret"
    write_secret(target, uid=65534)
    link.symlink_to(target)
    secret_env(link)
    with pytest.raises(ValueError, match=re.escape(f"{link}: owned by uid 65534")):
        wire.load_secret()


def test_secret_path_that_is_not_a_regular_file_is_refused(tmp_path, secret_env):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    secret_env(fifo)
    with pytest.raises(ValueError, match=re.escape(f"{fifo}: not a regular file")):
        wire.load_secret()  # and it returns: opening a FIFO must not block
    secret_env(tmp_path / "missing")
    with pytest.raises(ValueError, match="missing: cannot open it"):
        wire.load_secret()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
