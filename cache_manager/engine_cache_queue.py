"""EngineCacheQueue: ordered, authenticated task broadcast from the engine to N ranks.

The engine hosts the server (one ZMQ ROUTER socket, one I/O thread); each CTM rank is
a client (a DEALER socket).  Contracts:

* **Order and once-only.** ``broadcast`` stamps each task with a sequence number and sends
  it, under one lock, to every registered rank; a ROUTER-to-DEALER link keeps order, so
  every rank receives every task once, in the same order.  Tasks leave from the
  submitting thread on a socket of their own (no hand-off to the I/O thread); results
  come back on each rank's worker threads' own sockets.
* **Results.** A rank's ``send_result`` reaches the server's ``on_result`` callback.  A
  result is accepted only from the connection that registered that rank.
* **Barriers.** ``barrier(name, value, timeout)`` returns ``(True, min of all values)``
  once every rank arrived, or ``(False, None)`` on every rank when the server's deadline
  passes; a rank that arrives after that fails at once.  All ranks take the same path.
* **Security.** Frames are msgpack with an HMAC of the engine's secret (``wire``), never
  pickle, size-limited at the transport.  A frame that fails any check is dropped and
  logged; nothing runs.  The server binds loopback unless told otherwise.
* **No busy loop.** Both sides block in ``zmq.Poller.poll`` with a timeout.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import asdict
from typing import Callable

import zmq

from . import wire
from .cache_tasks import RankResult

logger = logging.getLogger(__name__)

_POLL_MS = 1000


def _socket_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)  # ordered delivery must never drop a task at a high-water mark
    sock.setsockopt(zmq.RCVHWM, 0)


class _Waker:
    """Hands work to a thread blocked in zmq poll: a SimpleQueue plus an inproc doorbell."""

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context):
        endpoint = f"inproc://ctm-waker-{os.getpid()}-{next(self._ids)}"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(endpoint)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(endpoint)
        self._lock = threading.Lock()
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self.items.put(item)
        with self._lock:
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the doorbell is already full of rings: the owner will wake
                pass

    def drain(self) -> list:
        while True:
            try:
                self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self.items.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._push.close(0)
        self.pull.close(0)


class _DropLog:
    """Logs dropped frames without letting a flood of garbage flood the log."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.count = 0

    def __call__(self, reason: str, peer: str) -> None:
        self.count += 1
        if self.count <= 20 or self.count % 1000 == 0:
            self.log.warning("dropped frame from %s: %s (%d dropped so far)", peer, reason, self.count)


class EngineCacheQueueServer:
    """The engine side.  Callbacks run on the server's I/O thread and must not block."""

    def __init__(
        self,
        num_ranks: int,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        on_result: Callable[[RankResult], None] | None = None,
        on_rank_joined: Callable[[int, int], None] | None = None,
    ):
        if num_ranks < 1:
            raise ValueError(f"num_ranks {num_ranks} must be at least 1")
        self.num_ranks = num_ranks
        self._secret = secret
        self._on_result = on_result or (lambda r: None)
        self._on_rank_joined = on_rank_joined or (lambda rank, pid: None)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        _socket_options(self._router)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if port == 0:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        # Tasks go out on a second socket, owned by whichever thread holds _send_lock.
        self._tasks = self._ctx.socket(zmq.ROUTER)
        _socket_options(self._tasks)
        self._tasks.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._tasks.setsockopt(zmq.RCVHWM, 1000)  # only hellos come in here: bound what a flood can queue
        self.task_port = self._tasks.bind_to_random_port(f"tcp://{host}")
        self._send_lock = threading.Lock()
        self._waker = _Waker(self._ctx)
        self._identities: dict[int, bytes] = {}  # rank -> control connection
        self._task_identities: dict[int, bytes] = {}  # rank -> task connection
        self._pids: dict[int, int] = {}
        self._rank_of: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._barriers: dict[str, dict] = {}
        self._failed_barriers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._drop = _DropLog(logger)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-cache-queue", daemon=True)
        self._thread.start()

    # -- engine-facing API (any thread) ---------------------------------------
    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def registered_ranks(self) -> set[int]:
        """Ranks whose control and task connections are both registered."""
        self.pump()
        with self._lock:
            return set(self._identities) & set(self._task_identities)

    def broadcast(self, task: dict) -> list[int]:
        """Send ``task`` (a wire dict with a ``task_id``) to every rank, after all earlier ones.

        Returns the ranks it could not reach (not registered, or disconnected)."""
        with self._send_lock:
            self._pump_locked()
            frame = wire.encode({"type": "task", "seq": next(self._seq), "task": task}, self._secret)
            with self._lock:
                targets = dict(self._task_identities)
            unreachable = []
            for rank in range(self.num_ranks):
                identity = targets.get(rank)
                try:
                    if identity is None:
                        raise zmq.ZMQError(zmq.EHOSTUNREACH)
                    self._tasks.send_multipart([identity, frame], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.append(rank)
            return unreachable

    def pump(self) -> None:
        """Register task connections that said hello (the supervisor calls this periodically)."""
        with self._send_lock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        if self._tasks.closed:
            return
        for _ in range(1000):
            try:
                frames = self._tasks.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, peer = frames[0], repr(frames[0][:40])
            if len(frames) != 2:
                self._drop(f"{len(frames) - 1} frames on the task port", peer)
                continue
            try:
                body = wire.decode(frames[1], self._secret)
            except wire.BadFrame as exc:
                self._drop(f"task port: {exc}", peer)
                continue
            rank, pid = body.get("rank"), body.get("pid")
            with self._lock:
                if body["type"] != "hello" or body.get("channel") != "tasks" or self._pids.get(rank) != pid:
                    self._drop(f"task port: unexpected {body['type']!r} for rank {rank!r} pid {pid!r}", peer)
                    continue
                self._task_identities[rank] = identity

    def forget_rank(self, rank: int) -> None:
        """The engine knows this rank's process is gone: stop sending to it."""
        with self._lock:
            self._identities.pop(rank, None)
            self._task_identities.pop(rank, None)
            self._pids.pop(rank, None)
            for identity in [i for i, r in self._rank_of.items() if r == rank]:
                del self._rank_of[identity]

    @property
    def dropped_frames(self) -> int:
        return self._drop.count

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._waker.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("queue I/O thread did not stop within %.1fs", timeout)
            return
        with self._send_lock:
            self._tasks.close(0)
        self._waker.close()
        self._router.close(0)
        self._ctx.term()

    # -- I/O thread --------------------------------------------------------------
    def _send(self, identity: bytes, body: dict) -> bool:
        try:
            self._router.send_multipart([identity, wire.encode(body, self._secret)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected
            logger.warning("cannot reach %r: %s", identity, exc)
            return False

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._waker.pull, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self._waker.pull in events:
                self._waker.drain()  # only ever rung to stop the loop
            if self._router in events:
                for _ in range(1000):  # bounded batch, then service the doorbell again
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._expire_barriers()

    def _poll_timeout_ms(self) -> int:
        if not self._barriers:
            return _POLL_MS
        soonest = min(b["deadline"] for b in self._barriers.values())
        return max(0, min(_POLL_MS, int((soonest - time.monotonic()) * 1000) + 1))

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        peer = repr(identity[:40])
        if len(frames) != 2:
            self._drop(f"{len(frames) - 1} frames, expected 1", peer)
            return
        try:
            body = wire.decode(frames[1], self._secret)
        except wire.BadFrame as exc:
            self._drop(str(exc), peer)
            return
        kind = body["type"]
        if kind == "hello":
            self._hello(identity, body, peer)
            return
        with self._lock:
            rank = self._rank_of.get(identity)
        if rank is None:
            self._drop(f"{kind!r} from a connection that never said hello", peer)
            return
        if kind == "result":
            self._result(rank, body, peer)
        elif kind == "barrier":
            self._barrier(rank, body, peer)
        else:
            self._drop(f"unknown message type {kind!r}", peer)

    def _hello(self, identity: bytes, body: dict, peer: str) -> None:
        rank, pid = body.get("rank"), body.get("pid")
        if not isinstance(rank, int) or not 0 <= rank < self.num_ranks or not isinstance(pid, int):
            self._drop(f"hello with bad rank {rank!r} or pid {pid!r}", peer)
            return
        if body.get("channel") == "results":  # a worker thread's own socket: results only, no tasks
            with self._lock:
                if self._pids.get(rank) == pid:
                    self._rank_of[identity] = rank
                    return
            self._drop(f"result channel of rank {rank} from pid {pid}, which is not that rank's process", peer)
            return
        with self._lock:  # a new process replaces every connection of the rank's old one
            for old in [i for i, r in self._rank_of.items() if r == rank]:
                del self._rank_of[old]
            self._task_identities.pop(rank, None)
            self._identities[rank] = identity
            self._pids[rank] = pid
            self._rank_of[identity] = rank
        logger.info("rank %d (pid %d) joined", rank, pid)
        self._send(identity, {"type": "welcome", "rank": rank, "task_port": self.task_port})
        self._on_rank_joined(rank, pid)

    def _result(self, rank: int, body: dict, peer: str) -> None:
        try:
            result = RankResult(**{k: body[k] for k in RankResult.__dataclass_fields__ if k in body})
        except TypeError as exc:
            self._drop(f"malformed result: {exc}", peer)
            return
        if result.rank != rank or not isinstance(result.task_id, str):
            self._drop(f"result claims rank {result.rank!r} from rank {rank}'s connection", peer)
            return
        try:
            self._on_result(result)
        except Exception:
            logger.exception("on_result callback failed for task %s", result.task_id)

    def _barrier(self, rank: int, body: dict, peer: str) -> None:
        name, value, timeout = body.get("name"), body.get("value", 0), body.get("timeout")
        if not isinstance(name, str) or not isinstance(value, int) or not isinstance(timeout, (int, float)):
            self._drop("malformed barrier", peer)
            return
        if name in self._failed_barriers:
            self._send(self._identities_get(rank), {"type": "barrier_done", "name": name, "ok": False})
            return
        barrier = self._barriers.setdefault(name, {"deadline": time.monotonic() + float(timeout), "values": {}})
        barrier["values"][rank] = value
        if len(barrier["values"]) == self.num_ranks:
            del self._barriers[name]
            reduced = min(barrier["values"].values())
            for r in barrier["values"]:
                self._send(self._identities_get(r), {"type": "barrier_done", "name": name, "ok": True, "value": reduced})

    def _identities_get(self, rank: int) -> bytes:
        with self._lock:
            return self._identities.get(rank, b"")

    def _expire_barriers(self) -> None:
        now = time.monotonic()
        for name in [n for n, b in self._barriers.items() if b["deadline"] <= now]:
            barrier = self._barriers.pop(name)
            missing = sorted(set(range(self.num_ranks)) - set(barrier["values"]))
            logger.warning("barrier %r timed out waiting for ranks %s", name, missing)
            self._failed_barriers[name] = None
            while len(self._failed_barriers) > 4096:
                self._failed_barriers.popitem(last=False)
            for r in barrier["values"]:
                self._send(self._identities_get(r), {"type": "barrier_done", "name": name, "ok": False, "missing": missing})


class EngineCacheQueueClient:
    """One rank's end.  ``poll`` must be called from a single owner thread; ``send_result``
    and ``barrier`` may be called from any thread (each sending thread gets its own
    authenticated result socket)."""

    def __init__(self, rank: int, num_ranks: int, secret: bytes, address: str, hello_timeout: float = 30.0):
        self.rank = rank
        self.num_ranks = num_ranks
        self._secret = secret
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _socket_options(self._sock)
        self._sock.setsockopt(zmq.ROUTING_ID, f"rank{rank}.{os.getpid()}".encode())
        self._sock.connect(address)
        self._waker = _Waker(self._ctx)
        self._task_sock: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._waker.pull, zmq.POLLIN)
        self._address = address
        self._local = threading.local()
        self._channels: list[zmq.Socket] = []
        self._channels_lock = threading.Lock()
        self._barrier_waits: dict[str, tuple[threading.Event, list]] = {}
        self._barrier_lock = threading.Lock()
        self._drop = _DropLog(logger)
        self._next_seq = None
        self._handshake(address, hello_timeout)

    def _handshake(self, address: str, timeout: float) -> None:
        self._sock.send(wire.encode({"type": "hello", "rank": self.rank, "pid": os.getpid()}, self._secret))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                continue
            body = self._decode(self._sock.recv())
            if body is not None and body["type"] == "welcome" and isinstance(body.get("task_port"), int):
                self._open_task_channel(address.rsplit(":", 1)[0], body["task_port"])
                return
        self.close()
        raise TimeoutError(f"rank {self.rank}: no answer from the engine cache queue at {address} within {timeout}s")

    def _open_task_channel(self, host: str, port: int) -> None:
        self._task_sock = self._ctx.socket(zmq.DEALER)
        _socket_options(self._task_sock)
        self._task_sock.setsockopt(zmq.ROUTING_ID, f"rank{self.rank}.{os.getpid()}.t".encode())
        self._task_sock.connect(f"{host}:{port}")
        self._task_sock.send(wire.encode({"type": "hello", "rank": self.rank, "pid": os.getpid(), "channel": "tasks"},
                                         self._secret))
        self._poller.register(self._task_sock, zmq.POLLIN)

    def _decode(self, frame: bytes) -> dict | None:
        try:
            return wire.decode(frame, self._secret)
        except wire.BadFrame as exc:
            self._drop(str(exc), "server")
            return None

    def poll(self, timeout_ms: int = _POLL_MS) -> list[dict]:
        """Block up to ``timeout_ms`` for tasks; returns their wire dicts in broadcast order."""
        tasks = []
        events = dict(self._poller.poll(timeout_ms))
        if self._waker.pull in events:
            for frame in self._waker.drain():
                self._sock.send(frame)
        if self._sock in events:
            for body in self._recv_all(self._sock):
                if body["type"] == "barrier_done":
                    self._release_barrier(body)
        if self._task_sock is not None and self._task_sock in events:
            tasks = [body for body in self._recv_all(self._task_sock) if body["type"] == "task"]
        out = []
        for body in tasks:
            seq = body.get("seq")
            if self._next_seq is not None and seq != self._next_seq:
                logger.error("rank %d: task sequence jumped from %s to %s", self.rank, self._next_seq, seq)
            self._next_seq = seq + 1 if isinstance(seq, int) else None
            out.append(body["task"])
        return out

    def _recv_all(self, sock: zmq.Socket) -> list[dict]:
        out = []
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            body = self._decode(frame)
            if body is not None:
                out.append(body)

    def send_result(self, result: RankResult) -> None:
        """Send from the calling thread's own socket: no hand-off to the poll thread on the hot path."""
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._ctx.socket(zmq.DEALER)
            _socket_options(channel)
            with self._channels_lock:
                n = len(self._channels)
                self._channels.append(channel)
            channel.setsockopt(zmq.ROUTING_ID, f"rank{self.rank}.{os.getpid()}.r{n}".encode())
            channel.connect(self._address)
            channel.send(wire.encode({"type": "hello", "rank": self.rank, "pid": os.getpid(), "channel": "results"},
                                     self._secret))
            self._local.channel = channel
        channel.send(wire.encode({"type": "result", **asdict(result)}, self._secret))

    def barrier(self, name: str, value: int = 0, timeout: float = 30.0) -> tuple[bool, int | None]:
        """Wait until every rank reaches ``name``; returns (ok, min of values).  Not from the poll thread."""
        event, slot = threading.Event(), []
        with self._barrier_lock:
            self._barrier_waits[name] = (event, slot)
        self._waker.put(wire.encode({"type": "barrier", "name": name, "value": int(value), "timeout": timeout},
                                    self._secret))
        # The server decides; the local wait only guards against a server that is gone.
        if not event.wait(timeout + 5.0):
            with self._barrier_lock:
                self._barrier_waits.pop(name, None)
            return False, None
        body = slot[0]
        return bool(body.get("ok")), body.get("value")

    def _release_barrier(self, body: dict) -> None:
        with self._barrier_lock:
            waiter = self._barrier_waits.pop(body.get("name"), None)
        if waiter is not None:
            waiter[1].append(body)
            waiter[0].set()

    def flush(self) -> None:
        """Send queued results now (before closing)."""
        for frame in self._waker.drain():
            self._sock.send(frame)

    def close(self, linger_ms: int = 1000) -> None:
        """Close every socket; call after the threads that sent results have stopped."""
        for channel in self._channels:
            channel.close(linger_ms)  # let the last results leave
        self._waker.close()
        if self._task_sock is not None:
            self._task_sock.close(0)
        self._sock.close(0)
        self._ctx.term()
