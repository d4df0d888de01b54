"""The rank's end of the EngineCacheQueue.

See ``queue_session`` for the handshake, sessions and per-stream counters, and
``engine_cache_queue`` for the contracts (order, results, barriers, security).
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import zmq

from cache_manager.queue.clocks import shares_engine_clock
from cache_manager.queue import local_link
from cache_manager.queue import wire
from cache_manager.cache_tasks import RankResult, result_body
from cache_manager.queue.checks import MAX_BARRIER_TIMEOUT, MAX_NAME_CHARS, DropLog, LoopErrors, is_int
from cache_manager.queue.session import CONTROL, DOWN, FIRST_RESULTS, MAX_RESULT_CHANNELS, TASKS, UP, GapWatch, stream
from cache_manager.queue.zmq_sockets import NONCE_BYTES, POLL_MS, RECV_BATCH, EdgePoller, Waker, readable, routing_id, socket_options

logger = logging.getLogger("cache_manager.queue.server")

@dataclass(frozen=True)
class BarrierAnswer:
    """What a rank got at a barrier: ``ok`` with the minimum of the values, or not ``ok``; a barrier
    that timed out names the ranks that never arrived (``missing``), one that had failed before this
    rank arrived names none."""

    ok: bool
    value: int | None = None
    missing: list[int] = field(default_factory=list)


class _ResultChannel:
    """One worker thread's own socket: its own stream of the rank's session, its own counter."""

    def __init__(self, sock: zmq.Socket, channel: int):
        self.sock, self.stream, self.counter = sock, stream(channel, UP), 0

    def send(self, body: dict, secret: bytes, session: bytes) -> None:
        self.sock.send(wire.encode(body, secret, session, self.stream, self.counter))
        self.counter += 1


class EngineCacheQueueClient:
    """One rank's end.  ``poll`` must be called from a single owner thread; ``send_result``
    and ``barrier`` may be called from any thread (each sending thread gets its own
    authenticated result socket)."""

    def __init__(self, rank: int, num_ranks: int, secret: bytes, address: str, hello_timeout: float = 30.0):
        self.rank = rank
        self.num_ranks = num_ranks
        self._secret = secret
        self._address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        socket_options(self._sock, rcvhwm=1000)  # only welcome and barrier answers come here
        self._sock.setsockopt(zmq.ROUTING_ID, routing_id(f"rank{rank}"))
        self._sock.connect(address)
        self._waker = Waker(self._ctx)
        self._task_sock: zmq.Socket | None = None
        self._poller = EdgePoller()
        self._poller.add_socket(self._sock)
        self._poller.add_socket(self._waker.pull)
        self._session = wire.NO_SESSION
        self._expect = {CONTROL: 1, TASKS: 0}  # next counter per stream down (the welcome was 0)
        self._gaps = {CONTROL: GapWatch(), TASKS: GapWatch()}  # a frame ahead of its turn: reordered, or lost
        self._broken: str | None = None  # why the stream from the engine broke for good
        self.link_closed = False  # the break is a closed connection, as the engine's own end would cause
        self.shared_clock = False  # whether the engine reads our CLOCK_MONOTONIC (settled by the welcome)
        self.engine_pid: int | None = None  # the engine process behind the local link (SO_PEERCRED), if any
        self._sent_control = 0
        self._control_lock = threading.Lock()
        self._thread_local = threading.local()
        self._channels: list[zmq.Socket] = []
        self._channel_ids = itertools.count(FIRST_RESULTS)
        self._channels_lock = threading.Lock()
        self._barrier_waits: dict[str, tuple[threading.Event, list]] = {}
        self._barrier_lock = threading.Lock()
        self._drop = DropLog(logger)
        self._errors = LoopErrors(logger, f"rank {rank} queue poll")
        self._next_seq: int | None = None
        self._local: local_link.FrameStream | None = None  # the task channel, on the engine's host
        self._local_lock = threading.Lock()  # orders result frames and their counters on it
        self._local_sent = 0
        self._handshake(address, hello_timeout)

    @property
    def dropped_frames(self) -> int:
        return self._drop.count

    @property
    def loop_errors(self) -> int:
        return self._errors.count

    # -- handshake -----------------------------------------------------------------
    def _handshake(self, address: str, timeout: float) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._sock.send(wire.encode({"type": "hello", "channel": "control", "rank": self.rank, "pid": os.getpid(),
                                     "nonce": nonce}, self._secret))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                continue
            welcome = self._welcome(self._sock.recv(), nonce)
            if welcome is not None:
                self._send_control({"type": "ready"})
                task_port, path = welcome
                if not (path and self._open_local_link(path)):
                    # a Unix-socket queue's ranks share the engine's host: its task port is on loopback
                    host = "tcp://127.0.0.1" if address.startswith("ipc://") else address.rsplit(":", 1)[0]
                    self._open_task_channel(host, task_port)
                return
        self.close()
        raise TimeoutError(f"rank {self.rank}: no answer from the engine cache queue at {address} within {timeout}s")

    def _welcome(self, frame: bytes, nonce: bytes) -> tuple[int, str | None] | None:
        """The task port and local link path of the welcome that answers our hello (fixing the
        session), or None."""
        try:
            env = wire.open_frame(frame, self._secret)
            body = wire.parse_body(env.payload)
        except wire.BadFrame as exc:
            self._drop("bad frame", str(exc), "server")
            return None
        port, path = body.get("task_port"), body.get("local_path")
        if (env.stream, env.counter) != (stream(CONTROL, DOWN), 0) or body["type"] != "welcome" \
                or body.get("nonce") != nonce or body.get("rank") != self.rank \
                or not is_int(port) or not 0 < port < 65536 or env.session == wire.NO_SESSION \
                or not (path is None or type(path) is str):
            self._drop("not our welcome", f"{body['type']!r} on stream {env.stream}", "server")
            return None
        self._session = env.session
        self.shared_clock = shares_engine_clock(body.get("clock"))
        return port, path

    def _open_local_link(self, path: str) -> bool:
        """Take the task channel on the engine's local link; False if there is none on this host."""
        try:
            link = local_link.connect(path, on_backlog=self._waker.ring)
        except OSError as exc:
            logger.info("rank %d: no local link at %r (%s): tasks come on the task port", self.rank, path,
                        exc.strerror)
            return False
        try:  # the kernel's word on who listens there: the engine process, which the CTM then watches
            pid, uid = local_link.peer_credentials(link.sock)
            self.engine_pid = pid if uid == os.geteuid() and pid > 0 else None
        except OSError:
            self.engine_pid = None
        link.send(wire.encode({"type": "hello", "channel": "tasks"}, self._secret, self._session,
                              stream(TASKS, UP), 0))
        self._local, self._local_sent = link, 1
        self._poller.watch(link.fileno(), link.wanted_events)
        return True

    def _open_task_channel(self, host: str, port: int) -> None:
        self._task_sock = self._ctx.socket(zmq.DEALER)
        socket_options(self._task_sock, rcvhwm=10000)  # tasks: back pressure on the server, never a drop
        self._task_sock.setsockopt(zmq.ROUTING_ID, routing_id(f"rank{self.rank}.t"))
        self._task_sock.connect(f"{host}:{port}")
        self._task_sock.send(wire.encode({"type": "hello", "channel": "tasks"}, self._secret, self._session,
                                         stream(TASKS, UP), 0))
        self._poller.add_socket(self._task_sock)

    def _send_control(self, body: dict) -> None:
        with self._control_lock:
            self._sock.send(wire.encode(body, self._secret, self._session, stream(CONTROL, UP), self._sent_control))
            self._sent_control += 1
            self._poller.touch(self._sock)  # the send may have taken the socket's signal in passing

    # -- receiving ------------------------------------------------------------------
    def poll(self, timeout_ms: int = POLL_MS) -> list[dict]:
        """Block up to ``timeout_ms`` for tasks; returns their wire dicts in broadcast order.

        Never raises for what a peer sent: a bad frame is dropped, a failure in handling one
        is logged and counted, and the poll goes on with the next."""
        out: list[dict] = []
        ready, fds = self._poller.poll(timeout_ms)
        if self._waker.pull in ready:
            for body in self._waker.drain():
                self._guarded(self._send_control, body)
        if self._sock in ready:
            for frame in self._recv_batch(self._sock):
                self._guarded(self._on_control, frame)
        if self._task_sock is not None and self._task_sock in ready:
            for frame in self._recv_batch(self._task_sock):
                task = self._guarded(self._on_task, frame)
                if task is not None:
                    out.append(task)
        if self._local is not None:
            self._serve_local_link(fds, out)
        now = time.monotonic()
        for channel, gap in self._gaps.items():
            if gap.overdue(now):
                self._break(f"a frame from the engine was lost on stream {stream(channel, DOWN)} "
                            f"(counter {self._expect[channel]} never came)")
        return out

    @property
    def broken(self) -> str | None:
        """Why the stream to the engine broke for good (its local link closed, a frame of it was lost),
        or None.  No task reaches a broken rank again: its owner should exit (``STREAM_BROKEN_EXIT``),
        so the engine sees it down at once instead of a rank alive but mute."""
        return self._broken

    def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            logger.error("rank %d: the stream from the engine broke: %s", self.rank, why)

    def _serve_local_link(self, fds: dict[int, int], out: list[dict]) -> None:
        link = self._local
        if link.fileno() < 0:
            return  # closed below, on an earlier poll
        try:
            frames = link.serve(fds.get(link.fileno(), 0), self._local_lock, RECV_BATCH)
        except local_link.LinkClosed as exc:
            self._poller.unregister(link.fileno())
            with self._local_lock:
                link.close()
            self.link_closed = True
            self._break(f"the engine's local link closed ({exc}): no more tasks reach this rank")
            return
        for frame in frames:
            task = self._guarded(self._on_task, frame)
            if task is not None:
                out.append(task)
        self._poller.watch(link.fileno(), link.wanted_events)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            self._errors()
            return None

    def _recv_batch(self, sock: zmq.Socket) -> list[bytes]:
        out = []
        for _ in range(RECV_BATCH):
            if not readable(sock):
                return out
            try:
                out.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return out
        self._poller.touch(sock)  # more may wait: look again before blocking
        return out

    def _open(self, frame: bytes, channel: int) -> dict | None:
        """The body of the next frame of ``channel``'s downstream in our session, or None (dropped)."""
        try:
            env = wire.open_frame(frame, self._secret)
        except wire.BadFrame as exc:
            self._drop("bad frame", str(exc), "server")
            return None
        expect = self._expect[channel]
        if env.session != self._session or env.stream != stream(channel, DOWN) or env.counter != expect:
            self._drop("replayed, reordered or foreign frame",
                       f"stream {env.stream} counter {env.counter}, expected {stream(channel, DOWN)}/{expect}", "server")
            if env.session == self._session and env.stream == stream(channel, DOWN) and env.counter > expect \
                    and self._gaps[channel].ahead(time.monotonic()):
                self._break(f"frames from the engine lost on stream {env.stream}: counter {env.counter}, "
                            f"expected {expect}")
            return None
        self._gaps[channel].filled()
        self._expect[channel] = expect + 1
        return self._drop.parsed(env, "server")

    def _on_control(self, frame: bytes) -> None:
        body = self._open(frame, CONTROL)
        if body is None:
            return
        name, ok, value = body.get("name"), body.get("ok"), body.get("value")
        if body["type"] != "barrier_done" or type(name) is not str or type(ok) is not bool \
                or not (value is None or is_int(value)):
            self._drop("malformed", f"unexpected {body['type']!r} on the control channel", "server")
            return
        self._release_barrier(name, body)

    def _on_task(self, frame: bytes) -> dict | None:
        body = self._open(frame, TASKS)
        if body is None:
            return None
        seq, task = body.get("seq"), body.get("task")
        if body["type"] != "task" or not is_int(seq) or type(task) is not dict:
            self._drop("malformed", f"unexpected {body['type']!r} on the task channel", "server")
            return None
        if self._next_seq is not None and seq != self._next_seq:
            # Not a replay (the counter rules that out): the server could not reach this rank
            # for the tasks in between, and failed them.
            logger.warning("rank %d: task sequence jumped from %d to %d", self.rank, self._next_seq, seq)
        self._next_seq = seq + 1
        return task

    # -- sending --------------------------------------------------------------------
    def send_result(self, result: RankResult) -> None:
        """Send from the calling thread: no hand-off to the poll thread on the hot path."""
        link = self._local
        if link is not None:
            body = result_body(result)
            with self._local_lock:
                sent = link.send(wire.encode(body, self._secret, self._session, stream(TASKS, UP), self._local_sent))
                self._local_sent += 1
            if not sent:
                self.link_closed = True
                self._break(f"the result of task {result.task_id} was lost: the local link is closed")
            return
        channel = getattr(self._thread_local, "channel", None)
        if channel is None:
            channel = self._thread_local.channel = self._open_result_channel()
        channel.send(result_body(result), self._secret, self._session)

    def _open_result_channel(self) -> _ResultChannel:
        with self._channels_lock:
            number = next(self._channel_ids)
            if number >= FIRST_RESULTS + MAX_RESULT_CHANNELS:
                raise RuntimeError(f"rank {self.rank}: more than {MAX_RESULT_CHANNELS} threads sent results")
            sock = self._ctx.socket(zmq.DEALER)
            self._channels.append(sock)
        socket_options(sock, rcvhwm=16)  # the server never sends on a result channel
        sock.setsockopt(zmq.ROUTING_ID, routing_id(f"rank{self.rank}.r{number}"))
        sock.connect(self._address)
        channel = _ResultChannel(sock, number)
        channel.send({"type": "hello", "channel": "results"}, self._secret, self._session)
        return channel

    def barrier(self, name: str, value: int = 0, timeout: float = 30.0) -> tuple[bool, int | None]:
        """Wait until every rank reaches ``name``; returns (ok, min of values).  Not from the poll thread."""
        answer = self.arrive(name, value, timeout)
        return answer.ok, answer.value

    def arrive(self, name: str, value: int = 0, timeout: float = 30.0) -> BarrierAnswer:
        """``barrier`` with the whole answer (the missing ranks of one that timed out)."""
        if type(name) is not str or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"barrier name {name!r:.80} must be a string of at most {MAX_NAME_CHARS} characters")
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or not 0 <= timeout <= MAX_BARRIER_TIMEOUT:
            raise ValueError(f"barrier timeout {timeout!r} must be a number of seconds in [0, {MAX_BARRIER_TIMEOUT:g}]")
        if not is_int(int(value)):
            raise ValueError(f"barrier value {value!r} must be an integer within +-2**62")
        event, slot = threading.Event(), []
        with self._barrier_lock:
            self._barrier_waits[name] = (event, slot)
        self._waker.put({"type": "barrier", "name": name, "value": int(value), "timeout": float(timeout)})
        # The server decides; the local wait only guards against a server that is gone.
        if not event.wait(timeout + 5.0):
            with self._barrier_lock:
                self._barrier_waits.pop(name, None)
            return BarrierAnswer(False)
        body = slot[0]
        missing = body.get("missing")
        missing = [r for r in missing if is_int(r)] if isinstance(missing, list) else []
        return BarrierAnswer(bool(body.get("ok")), body.get("value"), missing)

    def _release_barrier(self, name: str, body: dict) -> None:
        with self._barrier_lock:
            waiter = self._barrier_waits.pop(name, None)
        if waiter is not None:
            waiter[1].append(body)
            waiter[0].set()

    def flush(self) -> None:
        """Send queued barrier requests now (before closing)."""
        for body in self._waker.drain():
            self._send_control(body)

    def close(self, linger_ms: int = 1000) -> None:
        """Close every socket; call after the threads that sent results have stopped.  A thread
        still waiting at a barrier gets a failed answer at once."""
        with self._barrier_lock:
            waiting, self._barrier_waits = list(self._barrier_waits.values()), {}
        for event, slot in waiting:
            slot.append({"type": "barrier_done", "ok": False})
            event.set()
        for channel in self._channels:
            channel.close(linger_ms)  # let the last results leave
        if self._local is not None:
            with self._local_lock:
                self._local.drain(linger_ms / 1000)
                self._local.close()
        self._waker.close()
        if self._task_sock is not None:
            self._task_sock.close(0)
        self._sock.close(0)
        self._ctx.term()
