"""The sending side of the engine's queue: every task, to every rank, in one order.

``TaskSender`` owns what only the sending side touches: the task port (a ROUTER socket that ranks
on another host connect their task channel to), the send lock and the broadcast sequence number.
Every task stream, a local link's too, advances only under that lock (``local_links`` is handed the
same lock), so a stream's counter needs no other guard and every rank sees the tasks in one order.

The sessions themselves stay the server's (``session.Registry``, under the server's registry lock):
the sender reads which ranks are reachable, binds the task connections that say hello, and reports
a task channel found gone (``Registry.broke``), each under that lock.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable

import zmq

from cache_manager.queue import wire
from cache_manager.queue.checks import DropLog, LoopErrors
from cache_manager.queue.local_link import MAX_BACKLOG_FRAMES
from cache_manager.queue.session import DOWN, TASKS, Registry, Session, stream
from cache_manager.queue.zmq_sockets import (MAX_HELLO_FRAME_BYTES, NOT_READING, ROUTER_FRAMES_PER_WAKE,
                                             RateLimitedLog, Unreachable, peer_name, socket_options)

__all__ = ["TaskSender", "open_router_frame"]


def open_router_frame(frames: list[bytes], secret: bytes, drop: DropLog, peer: str) -> wire.Envelope | None:
    """``[identity, frame]`` as a ROUTER reads it: the frame's envelope once its MAC checks, else None
    (the frame dropped and counted)."""
    if len(frames) != 2:
        drop("bad frame", f"{len(frames) - 1} frames, expected 1", peer)
        return None
    try:
        return wire.open_frame(frames[1], secret)
    except wire.BadFrame as exc:
        drop("bad frame", str(exc), peer)
        return None


class TaskSender:
    """Sends tasks from the submitting thread (no hand-off to the server's I/O thread)."""

    def __init__(self, ctx: zmq.Context, host: str, num_ranks: int, secret: bytes, registry: Registry,
                 registry_lock: threading.Lock, drop: DropLog, errors: LoopErrors, log: logging.Logger):
        """``drop``, ``errors`` and ``log`` are the server's, so what happens here is counted and
        logged where the engine looks for the queue's drops, survived faults and lines."""
        self._num_ranks = num_ranks
        self._secret = secret
        self._reg, self._reg_lock = registry, registry_lock
        self._drop, self._errors = drop, errors
        self.socket = ctx.socket(zmq.ROUTER)
        # Only one hello per rank comes in here.  What goes out waits at most MAX_BACKLOG_FRAMES per
        # rank, as on a local link: a rank that stops reading makes sends fail (EAGAIN), not memory grow.
        socket_options(self.socket, rcvhwm=64, sndhwm=MAX_BACKLOG_FRAMES, max_frame=MAX_HELLO_FRAME_BYTES)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.lock = threading.Lock()  # its holder alone uses the socket and advances the task streams
        self._seq = itertools.count()
        self._not_reading = RateLimitedLog(log, "tasks refused to ranks that do not read")

    def broadcast(self, task: dict) -> Unreachable:
        """``EngineCacheQueueServer.broadcast``: ``task`` to every rank, after all earlier ones."""
        with self.lock:
            with self._reg_lock:
                targets = self._reg.reachable()
            if len(targets) < self._num_ranks:  # a rank may have said hello since: register it first
                self._register_hellos_locked()
                with self._reg_lock:
                    targets = self._reg.reachable()
            payload = wire.pack({"type": "task", "seq": next(self._seq), "task": task})
            missed = Unreachable()
            for rank in range(self._num_ranks):
                why = self.send_task(targets.get(rank), payload)
                if why is not None:
                    missed.append(rank)
                    missed.reasons[rank] = why
            return missed

    def send_task(self, session: Session | None, payload: bytes) -> str | None:
        """None once the task is on its way to ``session``'s rank, else why it is not (caller holds ``lock``).

        A method ``broadcast`` looks up on the instance for each rank: the fault tests replace it to
        lose one frame (``EngineCacheQueueServer._send_task``)."""
        # Only a holder of the send lock advances a task stream, so its counter needs no other lock.
        if session is None:
            return "is not connected to the queue"
        frame = wire.seal(payload, self._secret, session.sid, stream(TASKS, DOWN), session.next_counter(TASKS))
        link = session.local
        if link is not None:
            if not link.send(frame):
                return self._broke(session, "is not connected: its local link closed") if link.broken else \
                    self._refused(session.rank)  # not broken: its backlog is full
            session.advance(TASKS)
            return None
        try:
            self.socket.send_multipart([session.task_identity, frame], zmq.NOBLOCK)
        except zmq.Again:  # its pipe holds MAX_BACKLOG_FRAMES (SNDHWM): it does not read
            return self._refused(session.rank)
        except zmq.ZMQError:  # EHOSTUNREACH: disconnected (a reconnect drops what its old pipe held)
            return self._broke(session, "is not connected to the queue: its task connection dropped")
        session.advance(TASKS)
        return None

    def _broke(self, session: Session, why: str) -> str:
        """A send found ``session``'s task channel gone: its stream is broken (``Registry.broke``).  Returns ``why``."""
        with self._reg_lock:
            self._reg.broke(session, why)
        return why

    def _refused(self, rank: int) -> str:
        self._not_reading(f"rank {rank} {NOT_READING}")
        return NOT_READING

    def register_hellos(self) -> None:
        """Bind the task connections that said hello on the task port since the last look."""
        with self.lock:
            self._register_hellos_locked()

    def _register_hellos_locked(self) -> None:
        if self.socket.closed:
            return
        for _ in range(ROUTER_FRAMES_PER_WAKE):  # hellos only; the caller holds the send lock
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._task_port_frame(frames)
            except Exception:  # the caller is the engine's supervisor: never let a frame kill it
                self._errors()

    def _task_port_frame(self, frames: list[bytes]) -> None:
        identity, peer = frames[0], peer_name(frames[0])
        env = open_router_frame(frames, self._secret, self._drop, peer)
        if env is None:
            return
        with self._reg_lock:
            if identity in self._reg.task_links:
                self._drop("unexpected", "the task channel carries nothing upstream after its hello", peer)
                return
        body = self._drop.parsed(env, peer)
        if body is None:
            return
        if body["type"] != "hello" or body.get("channel") != "tasks":
            self._drop("unauthenticated", f"{body['type']!r} on the task port before a hello", peer)
            return
        with self._reg_lock:
            problem = self._reg.bind(identity, env, task_port=True)
        if problem:
            self._drop("refused", problem, peer)

    def close(self, detach: Callable[[], None]) -> None:
        """Close the task port once no send is under way.  ``detach`` runs first, under the send lock:
        whatever watches the socket (the server's ``TransportCuts`` monitor) must let go of it before it closes."""
        with self.lock:
            detach()
            self.socket.close(0)
