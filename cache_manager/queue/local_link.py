"""The queue's local link: tasks and results over a Unix stream socket, for ranks on the engine's host.

Why not zmq for these.  A zmq message crosses two I/O threads, one in each process, besides
the threads that send and receive it.  On a 2-core VM that hop took most of a round trip:
a bare zmq request and reply cost 224 us at the median, the same frames over a Unix socket
35 us.  The tasks and results of ranks on the engine's host take this link; the handshake,
barriers and ranks on other hosts stay on zmq (``engine_cache_queue``).

What stays the same.  Every frame is the queue's sealed frame (``wire``), in the rank's
session, on the task channel's streams, with the next counter under the MAC: tasks go down,
results come up.  Replayed, reordered or foreign frames are dropped as on zmq.  On top of
that, the engine accepts a connection only from a process of its own uid, and binds it to a rank
only if the kernel's peer credentials name that rank's pid.

The socket's name is in Linux's abstract namespace (a random name, no file): it goes away with
the engine's process however that ends, SIGKILL included, so nothing is left in /tmp.

Framing: a 4-byte big-endian length, then the frame.  A length over the stream's ``max_frame``
(at most ``wire.MAX_FRAME_BYTES``) cannot be resynchronised from, so it closes the connection (``LinkClosed``).

Threads: ``send``, ``flush`` and ``drain`` of one ``FrameStream`` must be serialised by its
owner (one lock per stream); ``recv_frames`` and ``serve`` belong to the one thread that polls
it.  Sends never block: what the socket does not take waits, in order, in the stream's backlog.
The first such send calls ``on_backlog`` (the owner's doorbell), and the polling thread, which
waits for ``wanted_events``, flushes the backlog in ``serve`` once the socket turns writable.
"""
from __future__ import annotations

import collections
import secrets
import select
import socket
import struct
import threading
import time
from typing import Callable

from cache_manager.queue import wire

LENGTH = struct.Struct(">I")
RECV_BYTES = 64 * 1024  # under malloc's mmap threshold: no mmap and page faults per read
SOCKET_BUFFER_BYTES = 1024 * 1024
MAX_UNBOUND_CONNECTIONS = 64  # accepted, hello not yet seen
# What the engine holds for one rank that does not read its tasks (SIGSTOP, a hung process): past
# either bound ``send`` refuses the frame and the task fails for that rank at once, instead of the
# engine's memory growing with every task (10,000 tasks once grew it by 353 MiB).  4,096 tasks is
# far more than a reading rank ever leaves queued; 64 MiB holds 900 tasks of 1,000 storage keys.
MAX_BACKLOG_FRAMES = 4096
MAX_BACKLOG_BYTES = 64 * 1024 * 1024
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# A peer that is gone is an error to handle, never a signal: an engine that embeds Python need
# not ignore SIGPIPE (zmq sends with this flag too).
_NO_SIGPIPE = socket.MSG_NOSIGNAL
_READ_EVENTS = select.POLLIN | select.POLLERR | select.POLLHUP | select.POLLNVAL


class LinkClosed(ConnectionError):
    """The peer closed the link, it broke, or it sent a length no frame can have."""


class FrameStream:
    """Length-prefixed frames over one connected, non-blocking Unix stream socket."""

    def __init__(self, sock: socket.socket, on_backlog: Callable[[], None] | None = None,
                 max_frame: int = wire.MAX_FRAME_BYTES, bounded: bool = False):
        sock.setblocking(False)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            except OSError:  # a smaller buffer only means more trips through the backlog
                pass
        self.sock = sock
        # A frame split across reads: its length prefix while incomplete (``_head``), then its
        # buffer, allocated once at the frame's full size (``_body``, ``_filled`` bytes in).
        # Every byte is copied into it once: a 16 MiB frame arriving 64 KiB a read is not
        # re-copied each read, as a growing inbox re-joined per read was (quadratic).
        self._head = bytearray()
        self._body: bytearray | None = None
        self._filled = 0
        self.partial_bytes_copied = 0  # bytes copied into _head or _body from reads (tests: linear)
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._backlog_bytes = 0
        self._on_backlog = on_backlog
        self.broken = False
        # The longest frame this end accepts: a length over it closes the link (the engine lowers
        # it to what a rank legitimately sends, and to a hello's size before the hello).
        self.max_frame = max_frame
        # Only the engine bounds its backlog (``MAX_BACKLOG_*``): a rank's results wait whatever it
        # takes for a paused engine, since a refused result would leave a gap in its stream.
        self._bounded = bounded
        self.refused_frames = 0  # sends refused because the backlog was full

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def backlogged(self) -> bool:
        return bool(self._backlog)

    @property
    def wanted_events(self) -> int:
        """What its poller should wait for: frames, and room while bytes wait in the backlog."""
        return select.POLLIN | (select.POLLOUT if self._backlog else 0)

    def send(self, frame: bytes) -> bool:
        """Queue ``frame`` after every earlier one and send what the socket takes now.
        False if the link is broken (``broken``), or bounded and the frame would take its backlog
        past ``MAX_BACKLOG_FRAMES`` or ``MAX_BACKLOG_BYTES``: then nothing of it is queued."""
        if self.broken:
            return False
        data = LENGTH.pack(len(frame)) + frame
        if self._backlog:
            if self._bounded and (len(self._backlog) >= MAX_BACKLOG_FRAMES
                                  or self._backlog_bytes + len(data) > MAX_BACKLOG_BYTES):
                self.refused_frames += 1
                return False
            self._backlog.append(memoryview(data))
            self._backlog_bytes += len(data)
            return self.flush()
        try:
            sent = self.sock.send(data, _NO_SIGPIPE)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.broken = True
            return False
        if sent < len(data):
            self._backlog.append(memoryview(data)[sent:])
            self._backlog_bytes += len(data) - sent
            if self._on_backlog is not None:
                self._on_backlog()  # the poller waits for room from now on
        return True

    def flush(self) -> bool:
        """Send queued bytes until the socket takes no more; False if the link is broken."""
        while self._backlog and not self.broken:
            head = self._backlog[0]
            try:
                sent = self.sock.send(head, _NO_SIGPIPE)
            except BlockingIOError:
                return True
            except OSError:
                self.broken = True
                return False
            self._backlog_bytes -= sent
            if sent == len(head):
                self._backlog.popleft()
            else:
                self._backlog[0] = head[sent:]
        return not self.broken

    def drain(self, timeout: float) -> bool:
        """Flush the backlog, waiting up to ``timeout`` seconds for the peer to read (at close)."""
        deadline = time.monotonic() + timeout
        while self.backlogged and not self.broken and time.monotonic() < deadline:
            self.flush()
            if self.backlogged:
                time.sleep(0.001)
        return not self.backlogged

    def serve(self, events: int, send_lock: threading.Lock, limit: int) -> list[bytes]:
        """One poll's ``events`` on this link: flush the backlog when there is room (under the
        owner's send lock), and read when frames came, the peer went, or a send found the link
        broken; returns the whole frames read.  Raises ``LinkClosed``."""
        if events & select.POLLOUT:
            with send_lock:
                self.flush()
        if events & _READ_EVENTS or self.broken:
            return self.recv_frames(limit)
        return []

    def recv_frames(self, limit: int) -> list[bytes]:
        """The whole frames that arrived, at most ``limit`` reads' worth; raises ``LinkClosed``."""
        frames: list[bytes] = []
        for _ in range(limit):
            body = self._body
            direct = body is not None and len(body) - self._filled >= RECV_BYTES
            try:
                if direct:  # a large frame's rest: read straight into its buffer, no copy here
                    want = len(body) - self._filled
                    got = self.sock.recv_into(memoryview(body)[self._filled:], want)
                else:
                    want = RECV_BYTES
                    chunk = self.sock.recv(RECV_BYTES)
                    got = len(chunk)
            except BlockingIOError:
                break
            except OSError as exc:
                raise LinkClosed(f"link broke: {exc}") from None
            if not got:
                raise LinkClosed("peer closed the link")
            if direct:
                self._filled += got
                if self._filled == len(body):
                    frames.append(bytes(body))
                    self._body = None
            else:
                self._take(chunk, frames)
            if got < want:  # the socket is empty: save the read that would only say so
                break
        return frames

    def _take(self, data: bytes, frames: list[bytes]) -> None:
        """Append the frames that ``data`` completes to ``frames``; keep the bytes of a partial one."""
        view = memoryview(data)
        at, end = 0, len(data)
        while at < end:
            body = self._body
            if body is None:
                head = self._head
                if not head and end - at >= LENGTH.size:
                    (size,) = LENGTH.unpack_from(data, at)
                    at += LENGTH.size
                else:
                    take = min(LENGTH.size - len(head), end - at)
                    head += view[at:at + take]
                    at += take
                    self.partial_bytes_copied += take
                    if len(head) < LENGTH.size:
                        return
                    (size,) = LENGTH.unpack(head)
                    head.clear()
                if size > self.max_frame:
                    raise LinkClosed(f"frame length {size} over the {self.max_frame}-byte limit")
                if end - at >= size:  # the whole frame is in this read
                    frames.append(data[at:at + size])
                    at += size
                    continue
                body = self._body = bytearray(size)
                self._filled = 0
            take = min(len(body) - self._filled, end - at)
            body[self._filled:self._filled + take] = view[at:at + take]
            self._filled += take
            at += take
            self.partial_bytes_copied += take
            if self._filled == len(body):
                frames.append(bytes(body))
                self._body = None

    def close(self) -> None:
        self.broken = True
        self._backlog.clear()
        self._backlog_bytes = 0
        self.sock.close()


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that connected ``sock``, as the kernel recorded them."""
    pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def connect(path: str, on_backlog: Callable[[], None] | None = None, timeout: float = 5.0) -> FrameStream:
    """Connect to an engine's local link at ``path``; raises ``OSError`` if there is none here."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return FrameStream(sock, on_backlog)


class LocalListener:
    """The engine's listening socket, under a random abstract name."""

    def __init__(self) -> None:
        self.path = "\0ctm-queue-" + secrets.token_hex(16)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            self.sock.listen(64)
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, limit: int) -> list[tuple[socket.socket, int, int]]:
        """Up to ``limit`` waiting connections, each with its peer's (pid, uid).  The bound keeps a
        connect flood from holding the polling thread: the rest wait in the kernel's queue, the
        listener stays readable, and the next wake-up takes the next ``limit``."""
        out = []
        for _ in range(limit):
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            try:
                pid, uid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            out.append((conn, pid, uid))
        return out

    def close(self) -> None:
        self.sock.close()
