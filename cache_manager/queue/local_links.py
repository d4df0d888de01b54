"""The engine's end of the local links (``local_link``): accept, bind, read, flush and close them.

The queue server's I/O thread owns this object: it polls the listening socket and every link.
A link's first frame must be a task channel's hello in a session whose pid is the link's peer
(``Registry.bind_local``); after it, the link carries that rank's results, each handed to the
server's ``on_result``.  Tasks are sent by the broadcasting thread under the server's send lock;
a link is closed only under that lock too, so no send can reach a file descriptor number the
kernel already gave to something else.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Callable


from cache_manager.queue import wire
from cache_manager.queue.local_link import MAX_UNBOUND_CONNECTIONS, FrameStream, LinkClosed, LocalListener
from cache_manager.queue.checks import DropLog
from cache_manager.queue.session import Registry
from cache_manager.queue.zmq_sockets import (FD_IN, MAX_HELLO_FRAME_BYTES, MAX_RESULT_FRAME_BYTES, EdgePoller,
                                             RateLimitedLog)

logger = logging.getLogger("cache_manager.queue.server")

READS_PER_WAKE = 64  # socket reads per link per wake-up, so one busy rank cannot starve the rest
# Connections taken per wake-up: the listener's name is in /proc/net/unix for every user to read, and
# a connect flood (76,166 connects from another uid once held swaps at 87 ms) must leave the loop
# free to serve the ranks' links between batches.  The rest wait in the kernel's listen queue.
ACCEPTS_PER_WAKE = 16


class LocalLinks:
    def __init__(self, secret: bytes, send_lock: threading.Lock, registry_lock: threading.Lock, registry: Registry,
                 drop: DropLog, on_result: Callable[[int, dict, str], None], on_error: Callable[[], None],
                 wake: Callable[[], None]):
        self.listener = LocalListener()
        self._secret = secret
        self._send_lock, self._lock, self._reg = send_lock, registry_lock, registry
        self._drop, self._on_result, self._on_error, self._wake = drop, on_result, on_error, wake
        self._links: dict[int, tuple[FrameStream, int]] = {}  # fd -> (link, peer pid)
        self._unbound: collections.OrderedDict[FrameStream, None] = collections.OrderedDict()
        self._poller: EdgePoller | None = None
        self.refused = RateLimitedLog(logger, "refused local links from other users")

    @property
    def path(self) -> str:
        return self.listener.path

    def register(self, poller: EdgePoller) -> None:
        """Poll the listener and, from now on, every link on ``poller`` (the I/O thread's)."""
        self._poller = poller
        poller.watch(self.listener.fileno(), FD_IN)

    def handle(self, fds: dict[int, int]) -> None:
        """Serve one poll's events on raw descriptors (I/O thread)."""
        if self.listener.fileno() in fds:
            self._accept()
        for fd, flags in fds.items():
            entry = self._links.get(fd)
            if entry is None:
                continue
            self._read(*entry, flags)
        for fd, (link, _) in self._links.items():
            self._poller.watch(fd, link.wanted_events)

    def _accept(self) -> None:
        for conn, pid, uid in self.listener.accept(ACCEPTS_PER_WAKE):
            if uid != os.geteuid():
                conn.close()
                self.refused(f"pid {pid} of uid {uid} (the engine runs as uid {os.geteuid()})")
                continue
            # Until its hello, a link may send only a hello's bytes; its backlog is bounded, so a
            # rank that stops reading cannot grow the engine (``local_link.MAX_BACKLOG_*``).
            link = FrameStream(conn, self._wake, max_frame=MAX_HELLO_FRAME_BYTES, bounded=True)
            fd = link.fileno()
            self._links[fd] = (link, pid)
            self._poller.watch(fd, link.wanted_events)
            self._unbound[link] = None
            while len(self._unbound) > MAX_UNBOUND_CONNECTIONS:  # connections that never said hello
                oldest = next(iter(self._unbound))
                self.close(oldest, "too many local links without a hello")

    def _read(self, link: FrameStream, pid: int, events: int) -> None:
        try:
            frames = link.serve(events, self._send_lock, READS_PER_WAKE)
        except LinkClosed as exc:
            self.close(link, str(exc))
            return
        for frame in frames:
            if link.broken:
                return
            try:
                self._frame(link, pid, frame)
            except Exception:  # one frame's failure costs that frame, not the thread
                self._on_error()

    def _frame(self, link: FrameStream, pid: int, frame: bytes) -> None:
        peer = f"local link of pid {pid}"
        try:
            env = wire.open_frame(frame, self._secret)
        except wire.BadFrame as exc:
            self._drop("bad frame", str(exc), peer)
            return
        with self._lock:
            bound = self._reg.local_links.get(link)
            problem = self._reg.continues(bound, env) if bound is not None else None
        if bound is None:
            self._bind(link, pid, env, peer)
            return
        body = self._drop.continued(problem, env, peer)
        if body is None:
            return
        if body["type"] == "result" and bound.session.live:
            self._on_result(bound.session.rank, body, peer)
        else:
            self._drop("unexpected", f"{body['type']!r} on the local link of rank {bound.session.rank}", peer)

    def _bind(self, link: FrameStream, pid: int, env: wire.Envelope, peer: str) -> None:
        body = self._drop.parsed(env, peer)
        if body is None or body["type"] != "hello" or body.get("channel") != "tasks":
            problem = "its first frame is not a task channel's hello"
        else:
            with self._lock:
                problem = self._reg.bind_local(link, env, pid)
        if problem:  # a link is good for one session's task channel, or for nothing
            self._drop("refused", problem, peer)
            self.close(link, problem)
        else:
            self._unbound.pop(link, None)
            link.max_frame = MAX_RESULT_FRAME_BYTES  # an authenticated rank's results

    def close(self, link: FrameStream, reason: str) -> None:
        """Close one link (I/O thread, or after it stopped) and tell the server."""
        fd = link.fileno()
        entry = self._links.pop(fd, None)
        self._unbound.pop(link, None)
        if self._poller is not None and entry is not None:
            self._poller.unregister(fd)
        if entry is not None:
            logger.info("local link of pid %d closed: %s", entry[1], reason)
        with self._send_lock:
            with self._lock:
                self._reg.unbind_local(link)  # its rank is unreachable until a new process registers
            link.close()

    def close_all(self) -> None:
        for link, _ in list(self._links.values()):
            self.close(link, "the queue is closing")
        self.listener.close()
