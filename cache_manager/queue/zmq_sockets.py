"""The zmq pieces both ends of the EngineCacheQueue share: socket limits, readiness, routing ids,
the doorbell that wakes a thread blocked in a poll, and the poller both loops block in."""
from __future__ import annotations

import itertools
import os
import queue
import secrets
import select
import threading

import zmq

from cache_manager.queue import wire

POLL_MS = 1000
RECV_BATCH = 1000  # frames per socket per wake-up, so one busy socket cannot starve the others
NONCE_BYTES = 16


def socket_options(sock: zmq.Socket, rcvhwm: int, sndhwm: int = 0) -> None:
    """Every socket that faces a peer: a size limit and a queue bound on what it receives.

    A full receive queue of a TCP peer makes zmq stop reading that connection (back pressure),
    it does not drop.  Sends default to no bound (SNDHWM 0): ordered task delivery must
    never silently lose a task at a high-water mark."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
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
