"""What the queue's attack and fault tests share (test_queue_hardening.py, test_queue_malformed_frames.py,
test_queue_loop_faults.py, test_local_link.py, test_fault_queue_frames.py): the secret, real ranks
with their own poll threads, the Tap (a message-level man in the middle on 127.0.0.2), a server
fixture and small waits.
"""
from __future__ import annotations

import queue
import secrets
import threading
import time

import pytest
import zmq

from cache_manager.cache_tasks import RankResult
from cache_manager.queue import EngineCacheQueueClient, EngineCacheQueueServer

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


@pytest.fixture
def server():
    results: list[RankResult] = []
    # These tests tap and replay zmq frames: ranks take the task port (the local link has its own tests).
    srv = EngineCacheQueueServer(2, SECRET, on_result=results.append, local_links=False)
    srv.results = results
    yield srv
    srv.close()


def registered(srv: EngineCacheQueueServer, ranks: set[int]) -> bool:
    return wait_for(lambda: srv.registered_ranks() == ranks)


def reasons(srv: EngineCacheQueueServer) -> dict[str, int]:
    srv.pump()  # the task port is read by whoever pumps (the engine's supervisor), not the I/O thread
    return srv.drop_reasons


def result(task_id: str, rank: int) -> RankResult:
    return RankResult(task_id, rank, True, value=[1, 2])
