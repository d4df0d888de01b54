"""EngineCacheQueue: ordered, authenticated task broadcast from the engine to N ranks.

The engine hosts the server (one ZMQ ROUTER socket, one I/O thread); each CTM rank is
a client (``queue_client``, a DEALER socket).  Contracts:

* **Order and once-only.** ``broadcast`` stamps each task with a sequence number and sends
  it, under one lock, to every registered rank; each rank's task channel keeps order, so
  every rank receives every task once, in the same order.  Tasks leave from the
  submitting thread (no hand-off to the I/O thread).
* **Transports.** The handshake and barriers use zmq.  A rank on the engine's host takes its
  tasks, and sends its results, on a local link (``local_link``: a Unix socket, no zmq I/O
  threads on the path); a rank elsewhere uses the task port, and sends results on each
  worker thread's own socket to the control port.
* **Results.** A rank's ``send_result`` reaches the server's ``on_result`` callback.  A
  result is accepted only on a channel of the session that registered that rank, and
  only if every field checks against ``RankResult`` (``queue_checks``).
* **Barriers.** ``barrier(name, value, timeout)`` returns ``(True, min of all values)``
  once every rank arrived, or ``(False, None)`` on every rank when the server's deadline
  passes; a rank that arrives after that fails at once.  All ranks take the same path.
* **Security.** Frames are msgpack with an HMAC of the engine's secret (``wire``), never
  pickle, size- and queue-limited at the transport.  Each connection has a session fixed
  at a challenge-response handshake and each stream a counter under the MAC
  (``queue_session``): a replayed, reordered or cross-connection frame is dropped, and a
  live rank is never displaced by another connection.  A frame that fails any check is
  dropped, counted and logged; nothing runs.  The server binds loopback unless told otherwise.
* **Liveness.** No iteration of the I/O thread, and no frame, can kill it: a failure is
  logged, counted (``loop_errors``) and the loop goes on.
* **No busy loop.** Both sides block in one poll(2) with a timeout (``queue_zmq.EdgePoller``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import zmq

from cache_manager.queue.clocks import engine_clock
from cache_manager.queue import wire
from cache_manager.cache_tasks import RankResult
from cache_manager.queue.checks import (DropLog, LoopErrors, Refused, barrier_fields, is_int, rank_result_from_body,
                           unsupported_result_fields)
from cache_manager.queue.barriers import Barriers
from cache_manager.queue.zmq_sockets import (MAX_HELLO_FRAME_BYTES, MAX_RESULT_FRAME_BYTES, NONCE_BYTES, POLL_MS,
                                             ROUTER_BYTES_PER_WAKE, ROUTER_FRAMES_PER_WAKE, EdgePoller, TransportCuts,
                                             Unreachable, Waker, peer_name, readable, socket_options)
from cache_manager.queue.local_links import LocalLinks
from cache_manager.queue.session import CONTROL, DOWN, UP, Registry, Session, stream
from cache_manager.queue.task_port import TaskSender, open_router_frame

__all__ = ["EngineCacheQueueServer"]

logger = logging.getLogger(__name__)

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
        local_links: bool = True,
        on_rank_broken: Callable[[int, int, str], None] | None = None,
        ipc_path: str | None = None,
    ):
        """``on_rank_broken(rank, pid, why)``: a live rank's stream broke for good (``session.Registry.broke``);
        called once per session, under the server's lock, on any of its threads: it must only hand off.
        ``ipc_path``: listen on this Unix socket (in a private directory: ``unix_address``) instead of
        ``host:port``; the task port for ranks elsewhere then binds loopback."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks {num_ranks} must be at least 1")
        self.num_ranks = num_ranks
        self._secret = secret
        self._on_result = on_result or (lambda r: None)
        self._on_rank_joined = on_rank_joined or (lambda rank, pid: None)
        unchecked = unsupported_result_fields()
        if unchecked:  # every result would be refused: say why once, loudly
            logger.error("RankResult fields %s have types the queue cannot check; results will be dropped", unchecked)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        # Sends here are small answers (welcome, barrier_done): bounded, so a peer that never
        # reads cannot grow the engine's memory; ROUTER_MANDATORY turns a full pipe into an error.
        socket_options(self._router, rcvhwm=1000, sndhwm=1000, max_frame=MAX_RESULT_FRAME_BYTES)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.ipc_path = ipc_path
        if ipc_path is not None:
            host = "127.0.0.1"  # every rank of a Unix-socket queue is on this host
            self._router.bind(f"ipc://{ipc_path}")
            self.port = 0
        elif port == 0:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._reg = Registry(num_ranks)
        self._reg.on_break = on_rank_broken
        self._lock = threading.Lock()  # guards _reg: the I/O thread, the task sender and forget_rank() share it
        self._drop = DropLog(logger)
        self._errors = LoopErrors(logger, "engine cache queue")
        # Tasks go out on a second socket, the task port, which the sender owns with its send lock.
        self._task_sender = TaskSender(self._ctx, host, num_ranks, secret, self._reg, self._lock, self._drop,
                                       self._errors, logger)
        self._waker = Waker(self._ctx)
        self._barriers = Barriers(num_ranks, lambda rank, body: self._send(self._live(rank), body))
        # Connections zmq cuts on either port (e.g. for an oversized frame): zmq logs none.
        self._cuts = TransportCuts([self._router, self._task_sender.socket], logger)
        self._stop = threading.Event()
        self._poller = EdgePoller()  # the I/O thread's
        # Offered to every rank; one on another host cannot reach the path and takes the task port.
        # A local link's task stream advances under the sender's lock, as the task port's streams do.
        self._local = LocalLinks(secret, self._task_sender.lock, self._lock, self._reg, self._drop, self._result,
                                 self._errors, self._waker.ring) if local_links else None
        self._thread = threading.Thread(target=self._run, name="engine-cache-queue", daemon=True)
        self._thread.start()

    # -- engine-facing API (any thread) ---------------------------------------
    @property
    def address(self) -> str:
        return f"ipc://{self.ipc_path}" if self.ipc_path is not None else f"tcp://{self.host}:{self.port}"

    @property
    def task_port(self) -> int:
        """Where a rank on another host connects its task channel (``TaskSender``)."""
        return self._task_sender.port

    @property
    def dropped_frames(self) -> int:
        return self._drop.count

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self._drop.reasons()

    @property
    def loop_errors(self) -> int:
        """Iterations or frames of the I/O thread (or of ``pump``) that raised and were survived."""
        return self._errors.count

    def io_thread_alive(self) -> bool:
        return self._thread.is_alive()

    def registered_ranks(self) -> set[int]:
        """Ranks whose control and task connections are both registered."""
        self.pump()
        with self._lock:
            return set(self._reg.reachable())

    def local_ranks(self) -> set[int]:
        """Ranks whose tasks and results travel on a local link (the rest use the task port)."""
        with self._lock:
            return {rank for rank, s in self._reg.reachable().items() if s.local is not None}

    @property
    def local_path(self) -> str | None:
        """The local link's socket, or None when the server offers none."""
        return self._local.path if self._local is not None else None

    def broadcast(self, task: dict) -> Unreachable:
        """Send ``task`` (a wire dict with a ``task_id``) to every rank, after all earlier ones.

        Returns the ranks it could not reach (not registered, disconnected, or a rank whose
        backlog is full), each with its reason: the task is never silently lost on a rank."""
        return self._task_sender.broadcast(task)

    def pump(self) -> None:
        """Register task connections that said hello (the supervisor calls this periodically), and
        break the streams whose lost frame is overdue (``Registry.overdue_gaps``)."""
        self._task_sender.register_hellos()
        with self._lock:
            self._reg.overdue_gaps(time.monotonic())

    def forget_rank(self, rank: int) -> None:
        """The engine knows this rank's process is gone: stop sending to it, and let a new
        process of that rank register (the only way a registered rank is ever replaced)."""
        with self._lock:
            self._reg.forget(rank)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._waker.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("queue I/O thread did not stop within %.1fs", timeout)
            return
        self._task_sender.close(detach=self._cuts.close)  # the monitor lets go of the task port before it closes
        if self._local is not None:
            self._local.close_all()
        self._waker.close()
        self._router.close(0)
        self._ctx.term()

    # -- I/O thread --------------------------------------------------------------
    def _run(self) -> None:
        poller = self._poller
        poller.add_socket(self._router)
        poller.add_socket(self._waker.pull)
        for monitor in self._cuts.monitors:
            poller.add_socket(monitor)
        if self._local is not None:
            self._local.register(poller)
        while not self._stop.is_set():
            try:
                self._run_once(poller)
            except Exception:
                self._errors()
                self._stop.wait(0.01)  # a fault that repeats every iteration must not spin a core

    def _run_once(self, poller: EdgePoller) -> None:
        ready, fds = poller.poll(self._poll_timeout_ms())
        if self._waker.pull in ready:
            self._waker.drain()  # rung to stop the loop, or to watch a local link's backlog
        self._cuts.drain(ready, poller)
        if self._router in ready:
            budget = ROUTER_BYTES_PER_WAKE  # a bounded batch, then the local links, doorbell and deadlines
            for _ in range(ROUTER_FRAMES_PER_WAKE):
                if not readable(self._router):
                    break
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._handle(frames)
                except Exception:  # one frame's failure costs that frame, not the thread
                    self._errors()
                budget -= len(frames[-1])
                if budget < 0:
                    poller.touch(self._router)  # more may wait: look again before blocking
                    break
            else:
                poller.touch(self._router)
        if self._local is not None:
            self._local.handle(fds)
        self._expire_barriers()

    def _poll_timeout_ms(self) -> int:
        return self._barriers.poll_timeout_ms(POLL_MS)

    def _send(self, session: Session | None, body: dict) -> bool:
        """Send on ``session``'s control stream (I/O thread only: it alone advances that counter)."""
        if session is None:
            return False
        frame = wire.encode(body, self._secret, session.sid, stream(CONTROL, DOWN), session.next_counter(CONTROL))
        try:
            self._router.send_multipart([session.control, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected; EAGAIN: it does not read
            logger.warning("cannot reach rank %d's connection %s: %s", session.rank, peer_name(session.control), exc)
            return False
        finally:
            self._poller.touch(self._router)  # the send may have taken the socket's signal in passing
        session.advance(CONTROL)
        return True

    def _handle(self, frames: list[bytes]) -> None:
        identity, peer = frames[0], peer_name(frames[0])
        if len(frames[-1]) > MAX_HELLO_FRAME_BYTES:  # only a bound connection sends more than a hello
            with self._lock:
                bound = identity in self._reg.links
            if not bound:  # dropped before its MAC is computed: unauthenticated bytes cost a length check
                self._drop("oversized", f"{len(frames[-1])} bytes before a hello (at most {MAX_HELLO_FRAME_BYTES})",
                           peer)
                return
        env = open_router_frame(frames, self._secret, self._drop, peer)
        if env is None:
            return
        with self._lock:
            link = self._reg.links.get(identity)
            problem = self._reg.continues(link, env) if link is not None else None
        if link is None:
            self._first_frame(identity, env, peer)
            return
        body = self._drop.continued(problem, env, peer)
        if body is None:
            return
        session, kind = link.session, body["type"]
        if link.channel == CONTROL and kind == "ready" and not session.live:
            self._ready(session, peer)
        elif link.channel == CONTROL and kind == "barrier" and session.live:
            self._barrier(session.rank, body, peer)
        elif link.channel != CONTROL and kind == "result" and session.live:
            self._result(session.rank, body, peer)
        else:
            self._drop("unexpected", f"{kind!r} on channel {link.channel} of rank {session.rank}", peer)

    def _first_frame(self, identity: bytes, env: wire.Envelope, peer: str) -> None:
        """A frame from a connection bound to no session: only a hello may open one."""
        body = self._drop.parsed(env, peer)
        if body is None:
            return
        if body["type"] == "hello" and env.session == wire.NO_SESSION:
            self._hello(identity, env, body, peer)
        elif body["type"] == "hello" and body.get("channel") == "results":
            with self._lock:
                problem = self._reg.bind(identity, env, task_port=False)
            if problem:
                self._drop("refused", problem, peer)
        else:
            self._drop("unauthenticated", f"{body['type']!r} from a connection that never completed a handshake",
                       peer)

    def _hello(self, identity: bytes, env: wire.Envelope, body: dict, peer: str) -> None:
        rank, pid, nonce = body.get("rank"), body.get("pid"), body.get("nonce")
        if (env.stream, env.counter) != (stream(CONTROL, UP), 0) or body.get("channel") != "control" \
                or not is_int(rank) or not 0 <= rank < self.num_ranks or not is_int(pid) or pid <= 0 \
                or type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
            self._drop("malformed", f"hello with rank {rank!r:.40}, pid {pid!r:.40}", peer)
            return
        with self._lock:
            current = self._reg.live.get(rank)
            session = None if current is not None else self._reg.open_control(identity, rank, pid)
        if session is None:  # never displace a live rank; the engine calls forget_rank when it is gone
            self._drop("refused", f"hello for rank {rank}, which is live (pid {current.pid})", peer)
            return
        welcome = {"type": "welcome", "nonce": nonce, "rank": rank, "task_port": self.task_port,
                   "clock": engine_clock()}
        if self._local is not None:
            welcome["local_path"] = self._local.path
        self._send(session, welcome)

    def _ready(self, session: Session, peer: str) -> None:
        with self._lock:
            problem = self._reg.make_live(session)
        if problem:
            self._drop("refused", problem, peer)
            return
        logger.info("rank %d (pid %d) joined", session.rank, session.pid)
        try:
            self._on_rank_joined(session.rank, session.pid)
        except Exception:
            logger.exception("on_rank_joined callback failed for rank %d", session.rank)

    def _result(self, rank: int, body: dict, peer: str) -> None:
        try:
            result = rank_result_from_body(body, rank, self.num_ranks)
        except Refused as exc:
            self._drop("malformed", str(exc), peer)
            return
        try:
            self._on_result(result)
        except Exception:
            logger.exception("on_result callback failed for task %s", result.task_id)

    # -- barriers (I/O thread) -------------------------------------------------------
    def _barrier(self, rank: int, body: dict, peer: str) -> None:
        try:
            refused = self._barriers.arrive(rank, *barrier_fields(body))
        except Refused as exc:
            self._drop("malformed", str(exc), peer)
            return
        if refused:
            self._drop("refused", refused, peer)

    def _expire_barriers(self) -> None:
        self._barriers.expire()

    def _live(self, rank: int) -> Session | None:
        with self._lock:
            return self._reg.live.get(rank)
