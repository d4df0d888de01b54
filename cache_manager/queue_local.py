"""The engine's end of the local links (``local_link``): accept, read, flush and close them.

The queue server's I/O thread owns this object: it polls the listening socket and every link,
and hands each whole frame to the server (``on_frame``), which binds a link to a rank at its
hello and takes results from it after.  Tasks are sent by the broadcasting thread under the
server's send lock; a link is closed only under that lock too, so no send can reach a file
descriptor number the kernel already gave to something else.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Callable

import zmq

from .local_link import MAX_UNBOUND_CONNECTIONS, FrameStream, LinkClosed, LocalListener

logger = logging.getLogger("cache_manager.engine_cache_queue")

_POLLIN, _POLLOUT, _POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)
READS_PER_WAKE = 64  # socket reads per link per wake-up, so one busy rank cannot starve the rest


class LocalLinks:
    def __init__(self, send_lock: threading.Lock, on_frame: Callable[[FrameStream, int, bytes], None],
                 on_closed: Callable[[FrameStream], None], on_error: Callable[[], None]):
        self.listener = LocalListener()
        self._send_lock = send_lock
        self._on_frame, self._on_closed, self._on_error = on_frame, on_closed, on_error
        self._links: dict[int, tuple[FrameStream, int]] = {}  # fd -> (link, peer pid)
        self._interest: dict[int, int] = {}  # fd -> poll flags registered
        self._unbound: collections.OrderedDict[FrameStream, None] = collections.OrderedDict()
        self._poller: zmq.Poller | None = None

    @property
    def path(self) -> str:
        return self.listener.path

    def register(self, poller: zmq.Poller) -> None:
        """Poll the listener and, from now on, every link on ``poller`` (the I/O thread's)."""
        self._poller = poller
        poller.register(self.listener.fileno(), _POLLIN)

    def bound(self, link: FrameStream) -> None:
        """The server bound ``link`` to a rank: it no longer counts against the unbound limit."""
        self._unbound.pop(link, None)

    def handle(self, events: dict) -> None:
        """Serve one poll's events (I/O thread)."""
        if self.listener.fileno() in events:
            self._accept()
        for fd, flags in events.items():
            entry = self._links.get(fd) if type(fd) is int else None
            if entry is None:
                continue
            link, pid = entry
            if flags & _POLLOUT:
                with self._send_lock:
                    link.flush()
            if flags & (_POLLIN | _POLLERR) or link.broken:
                self._read(link, pid)
        self._watch_backlogs()

    def _accept(self) -> None:
        for link, pid, uid in self.listener.accept():
            if uid != os.geteuid():
                logger.warning("refused a local link from pid %d of uid %d (the engine runs as uid %d)",
                               pid, uid, os.geteuid())
                link.close()
                continue
            fd = link.fileno()
            self._links[fd] = (link, pid)
            self._interest[fd] = _POLLIN
            self._poller.register(fd, _POLLIN)
            self._unbound[link] = None
            while len(self._unbound) > MAX_UNBOUND_CONNECTIONS:  # connections that never said hello
                oldest = next(iter(self._unbound))
                self.close(oldest, "too many local links without a hello")

    def _read(self, link: FrameStream, pid: int) -> None:
        try:
            frames = link.recv_frames(READS_PER_WAKE)
        except LinkClosed as exc:
            self.close(link, str(exc))
            return
        for frame in frames:
            if link.broken:
                return
            try:
                self._on_frame(link, pid, frame)
            except Exception:  # one frame's failure costs that frame, not the thread
                self._on_error()

    def _watch_backlogs(self) -> None:
        """Watch for writability exactly while a link holds bytes the socket did not take."""
        for fd, (link, _) in self._links.items():
            want = _POLLIN | (_POLLOUT if link.backlogged else 0)
            if self._interest[fd] != want:
                self._poller.modify(fd, want)
                self._interest[fd] = want

    def close(self, link: FrameStream, reason: str) -> None:
        """Close one link (I/O thread, or after it stopped) and tell the server."""
        fd = link.fileno()
        entry = self._links.pop(fd, None)
        self._interest.pop(fd, None)
        self._unbound.pop(link, None)
        if self._poller is not None and entry is not None:
            self._poller.unregister(fd)
        if entry is not None:
            logger.info("local link of pid %d closed: %s", entry[1], reason)
        try:
            self._on_closed(link)
        finally:
            with self._send_lock:
                link.close()

    def close_all(self) -> None:
        for link, _ in list(self._links.values()):
            self.close(link, "the queue is closing")
        self.listener.close()
