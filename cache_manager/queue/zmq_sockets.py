"""The zmq pieces both ends of the EngineCacheQueue share: socket limits, the engine's bounds on
what it takes per frame and per wake-up, readiness, routing ids, the doorbell that wakes a thread
blocked in a poll, the poller both loops block in, and a rate-limited log for what a peer can
trigger at will."""
from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import select
import threading
import time

import zmq

from cache_manager.queue import local_link, wire

POLL_MS = 1000
RECV_BATCH = 1000  # frames per socket per wake-up, so one busy socket cannot starve the others
NONCE_BYTES = 16
# The largest frames the engine receives, so a peer that has not authenticated cannot make it copy
# and MAC megabytes (16 MiB cost 11.5 ms of MAC each).  A hello (any channel) is about 150 bytes:
# every frame before a connection's hello, and every frame on the task port, is held to 4 KiB.  A
# result is the largest frame a rank sends: a storage answer lists its block ids (at most 5 bytes
# each), an error carries at most ``checks.MAX_TEXT_CHARS`` characters (4 MiB of UTF-8 at worst);
# 8 MiB holds either with room.  Tasks (engine to rank) may still use all of ``wire.MAX_FRAME_BYTES``.
MAX_HELLO_FRAME_BYTES = 4096
MAX_RESULT_FRAME_BYTES = 8 * 1024 * 1024
# Router frames (and bytes of them) handled per wake-up before the local links are served: a flood
# at a port (1,000 frames a wake-up once took local swaps to a p99 of 933 ms) then delays the local
# ranks' results by one bounded batch, and the normal path still takes every waiting frame in one
# wake-up (a few ranks' results).
ROUTER_FRAMES_PER_WAKE = 64
ROUTER_BYTES_PER_WAKE = 1024 * 1024
NOT_READING = (f"is not reading its tasks: its backlog is full ({local_link.MAX_BACKLOG_FRAMES} frames or "
               f"{local_link.MAX_BACKLOG_BYTES >> 20} MiB)")


class Unreachable(list):
    """The ranks a broadcast did not reach, as a list, with why in ``reasons[rank]`` (a phrase
    after "rank N", e.g. ``NOT_READING``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: dict[int, str] = {}


def socket_options(sock: zmq.Socket, rcvhwm: int, sndhwm: int = 0, max_frame: int = wire.MAX_FRAME_BYTES) -> None:
    """Every socket that faces a peer: a size limit and a queue bound on what it receives.

    A full receive queue of a TCP peer makes zmq stop reading that connection (back pressure),
    it does not drop.  A frame over ``max_frame`` makes zmq close that connection as soon as it
    reads the frame's length, before it buffers any of it.  Sends default to no bound (SNDHWM 0);
    a socket that gives a bound must send with ROUTER_MANDATORY and NOBLOCK, so that a full
    pipe is an error its sender reports, never a task silently dropped at the mark."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SNDHWM, sndhwm)


EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum arithmetic costs a call each
FD_IN = select.POLLIN  # raw descriptors in ``EdgePoller`` take poll(2)'s flags, not zmq's (POLLOUT differs)


def readable(sock: zmq.Socket) -> bool:
    """Whether a frame waits on ``sock``: asking costs far less than a receive that raises
    ``zmq.Again``, and every batch would otherwise end in one, on the round trip's path."""
    return bool(sock.getsockopt(EVENTS) & POLLIN)


def routing_id(label: str) -> bytes:
    """A routing id nobody can guess and claim first (a ROUTER refuses a second connection
    with a routing id it already has); the label only helps reading logs."""
    return f"{label}.".encode() + secrets.token_hex(8).encode()


def peer_name(identity: bytes) -> str:
    return repr(identity[:40])


class RateLimitedLog:
    """A warning that an attacker can trigger at will (a refused connection, a full backlog): the
    first one is logged at once, the rest are counted and summed up in at most one line per
    ``interval`` seconds, so a flood of them costs a counter each, not a log line each."""

    def __init__(self, log: logging.Logger, what: str, interval: float = 10.0, single_level: int = logging.WARNING):
        self._log, self._what, self._interval = log, what, interval
        self._single_level = single_level  # a lone event's level; a burst is always a warning
        self._lock = threading.Lock()
        self._last = -interval
        self._held = 0
        self.count = 0

    def __call__(self, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            self._held += 1
            if now - self._last < self._interval:
                return
            held, self._held, self._last = self._held, 0, now
            count = self.count
        if held == 1:
            self._log.log(self._single_level, "%s: %s (%d so far)", self._what, detail, count)
        else:
            self._log.warning("%s: %d in the last %.0fs, the latest: %s (%d so far)",
                              self._what, held, self._interval, detail, count)


class TransportCuts:
    """Connections zmq closed on the engine's ROUTERs, logged at a bounded rate (``RateLimitedLog``).

    zmq closes a connection whose frame is over the socket's MAXMSGSIZE as soon as it reads the
    length, and tells nobody; a monitor's DISCONNECTED events are the only trace.  They do not say
    why (a peer that left looks the same), so they are counted and summed up, never logged one each:
    a flood of oversized frames is a flood of them.  The owner polls ``monitors`` and calls ``drain``."""

    def __init__(self, socks: list[zmq.Socket], log: logging.Logger):
        self._socks = socks
        self.monitors = [sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) for sock in socks]
        # One such close is usually a peer that left (a rank stopping): information.  A burst of
        # them is the trace of a flood: a warning.
        self.log = RateLimitedLog(log, "connections closed by the transport (the peer left, or sent a frame over "
                                       "the port's size limit or broke the protocol)", single_level=logging.INFO)

    def drain(self, ready: set[zmq.Socket], poller: EdgePoller) -> None:
        for monitor in self.monitors:
            if monitor not in ready:
                continue
            for _ in range(RECV_BATCH):
                try:
                    event = monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.log(f"on {event[-1][:64].decode(errors='replace')}")
            else:
                poller.touch(monitor)  # more may wait: look again before blocking

    def close(self) -> None:
        """Before the sockets close (the caller holds whatever lock guards their use)."""
        for sock in self._socks:
            sock.disable_monitor()
        for monitor in self.monitors:
            monitor.close(0)


class Waker:
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
        self.ring()

    def ring(self) -> None:
        """Wake the owner with no item: it re-reads its own state."""
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


class EdgePoller:
    """One poll(2) over raw descriptors and zmq sockets, owned by one thread.

    ``zmq.Poller`` asks every zmq socket for ``ZMQ_EVENTS`` before and after each wait, and each
    ask is a poll(2) and a getpid(2) inside libzmq: ten system calls a wake-up where one would
    do.  Here a zmq socket's ``ZMQ_FD`` is in the wait, and its events are asked only when that
    descriptor fired, or when the owner ``touch``-ed the socket: after sending on it (a send may
    take the signal in passing) or after a receive batch that stopped before the socket was empty.
    The owner must drain a socket ``poll`` reports until ``readable`` says no, or touch it."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._sockets: dict[int, zmq.Socket] = {}  # ZMQ_FD -> socket
        self._touched: set[zmq.Socket] = set()
        self._watched: dict[int, int] = {}  # raw descriptor -> the events waited for

    def add_socket(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        self._sockets[fd] = sock
        self._poll.register(fd, FD_IN)
        self._touched.add(sock)  # whatever arrived before it was added

    def touch(self, sock: zmq.Socket) -> None:
        self._touched.add(sock)

    def watch(self, fd: int, flags: int) -> None:
        """Wait for ``flags`` on the raw descriptor ``fd`` from now on (a no-op when unchanged)."""
        if self._watched.get(fd) != flags:
            self._poll.register(fd, flags)  # registers, or modifies a registered one
            self._watched[fd] = flags

    def unregister(self, fd: int) -> None:
        self._poll.unregister(fd)
        self._watched.pop(fd, None)

    def poll(self, timeout_ms: int) -> tuple[set[zmq.Socket], dict[int, int]]:
        """Wait up to ``timeout_ms`` (not at all while a socket is touched); returns the zmq sockets
        with a frame to read and the raw descriptors' events."""
        look, self._touched = self._touched, set()
        fds: dict[int, int] = {}
        for fd, flags in self._poll.poll(0 if look else timeout_ms):
            sock = self._sockets.get(fd)
            if sock is None:
                fds[fd] = flags
            else:
                look.add(sock)
        return {sock for sock in look if readable(sock)}, fds
