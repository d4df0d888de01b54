"""Sessions of the EngineCacheQueue: who may say what, on which connection, in which order.

Handshake (the control connection of one rank process):

1. client -> server  ``hello {rank, pid, nonce}`` in no session (``wire.NO_SESSION``).
   Refused outright while the rank has a live session: a live rank is never displaced,
   until the engine calls ``forget_rank`` (it knows the process died, or restarts it).
2. server -> client  ``welcome {nonce, rank, task_port}`` in a fresh random session S.  The
   client accepts only the welcome that echoes its own nonce.
3. client -> server  ``ready`` in session S.  Only a holder of the secret can MAC a frame for
   a session it just heard of, so a replayed hello never gets past step 2: it registers
   nothing and displaces nobody.  The rank is live from here.

Every connection carries streams: ``stream = channel * 2 + direction`` (channel 0 control,
1 tasks, 2+i a worker thread's result channel; direction 0 to the server, 1 to the client),
and every frame carries the next counter of its stream, starting at 0.  A receiver accepts
a frame only in its connection's session, on its stream, with the counter it expects next:
a replayed, reordered or cross-connection frame is dropped.

The task channel (on the task port) and each result channel open with a ``hello`` in session
S on their own stream, counter 0.  Each can be bound to one connection, once per session, so
a replay of that hello from another connection is refused; the task channel's once covers both
transports, and outlives the connection it was bound to.

A rank on the engine's host opens its task channel on the local link instead (``local_link``):
the same hello, on a Unix socket whose peer must be the session's pid.  That channel carries the
rank's results up on the task channel's upstream, counters 1, 2, ...: no result channels.

A live rank's stream that breaks for good (its local link closes, a frame of it was lost, a send
to its connection finds it gone) is reported once to ``Registry.on_break``, and the rank is no
longer reachable: the engine declares it down and restarts it (``engine_hooks.core.rank_recovery``).
The rank, seeing its own end break, exits with ``STREAM_BROKEN_EXIT``: alive but mute, every task
sent to it would only time out.

Not thread-safe: the server serialises every call under its own lock.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from cache_manager.queue import wire

logger = logging.getLogger("cache_manager.queue.server")

UP, DOWN = 0, 1  # to the server, to the client
CONTROL, TASKS, FIRST_RESULTS = 0, 1, 2
MAX_RESULT_CHANNELS = 4096  # worker threads of one rank process
MAX_PENDING = 64  # handshakes between welcome and ready; replayed hellos fill this and nothing else
# The exit status of a rank process whose stream to the engine broke (it exits rather than linger mute).
STREAM_BROKEN_EXIT = 3
# How long a frame ahead of its turn may wait for the one before it.  Inside one connection frames
# cannot overtake each other, so only a man in the middle reorders; a frame that does not come in
# this time, or a second frame ahead of it, means it was lost (a zmq reconnect drops queued frames).
GAP_GRACE_S = 0.25
# on_break(rank, pid, why): a live rank's stream broke for good (called under the server's lock)
OnBreak = Callable[[int, int, str], None]


def stream(channel: int, direction: int) -> int:
    return channel * 2 + direction


class GapWatch:
    """Tells a reordered frame (dropped, the stream goes on) from a lost one (the stream is broken:
    every later counter would run past the one expected, forever).  One per received stream."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the first frame ahead of its turn came, while none filled the gap

    def ahead(self, now: float) -> bool:
        """A frame ahead of its turn came (it is dropped); True once the gap is a loss: a second one
        came before the frame expected (``overdue`` tells when the first waited ``GAP_GRACE_S``)."""
        if self.since is None:
            self.since = now
            return False
        return True

    def filled(self) -> None:
        """The expected frame came."""
        self.since = None

    def overdue(self, now: float) -> bool:
        return self.since is not None and now - self.since > GAP_GRACE_S


@dataclass(eq=False)
class Session:
    sid: bytes
    rank: int
    pid: int
    control: bytes  # routing id of the control connection
    live: bool = False
    task_identity: bytes | None = None
    local: object | None = None  # the local link carrying the task channel, if the rank took one
    # Where the task channel was bound ("task port" or "local link"), kept after that link
    # closes: a session binds its task channel once, so a hello captured on one transport and
    # replayed on the other cannot take the tasks of a rank whose link broke.
    task_bound: str | None = None
    result_channels: set[int] = field(default_factory=set)
    sent: dict[int, int] = field(default_factory=lambda: {CONTROL: 0, TASKS: 0})  # next counter per channel down
    broken: str | None = None  # why its stream broke for good (reported once; no longer reachable)

    def next_counter(self, channel: int) -> int:
        return self.sent[channel]

    def advance(self, channel: int) -> None:
        """Call once the frame stamped with ``next_counter(channel)`` left."""
        self.sent[channel] += 1


@dataclass(eq=False)
class Link:
    """One peer connection bound to one stream of one session."""

    session: Session
    channel: int
    expect: int = 1  # the counter of the next frame from the peer (its hello or ready was 0)
    gap: GapWatch = field(default_factory=GapWatch)


class Registry:
    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.live: dict[int, Session] = {}
        self.pending: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self.links: dict[bytes, Link] = {}  # control-port routing ids: control and result connections
        self.task_links: dict[bytes, Link] = {}  # task-port routing ids
        self.local_links: dict[object, Link] = {}  # local link -> its task channel
        self.on_break: OnBreak | None = None

    # -- lookups ------------------------------------------------------------------
    def session(self, sid: bytes) -> Session | None:
        live = next((s for s in self.live.values() if s.sid == sid), None)
        return live or self.pending.get(sid)

    def reachable(self) -> dict[int, Session]:
        """Live ranks whose task channel is bound: those a broadcast reaches."""
        return {rank: s for rank, s in self.live.items()
                if (s.task_identity is not None or s.local is not None) and s.broken is None}

    def continues(self, link: Link, env: wire.Envelope) -> str | None:
        """Why ``env`` is not the next frame of ``link``'s upstream, or None (and the link advances).
        A frame ahead of its turn is dropped too; once that gap is a loss, the stream is broken."""
        if env.session != link.session.sid:
            return "frame of another session (cross-connection or replayed)"
        if env.stream != stream(link.channel, UP):
            return f"frame of stream {env.stream} on stream {stream(link.channel, UP)}"
        if env.counter != link.expect:
            if env.counter > link.expect and link.gap.ahead(time.monotonic()):
                self.broke(link.session, f"frames lost on stream {env.stream}: counter {env.counter}, "
                                         f"expected {link.expect}")
            return f"counter {env.counter}, expected {link.expect} (replayed or reordered)"
        link.gap.filled()
        link.expect += 1
        return None

    def overdue_gaps(self, now: float) -> None:
        """Break the streams whose frame ahead of its turn waited past ``GAP_GRACE_S`` for the one before."""
        for table in (self.links, self.task_links, self.local_links):
            for link in list(table.values()):
                if link.gap.overdue(now):
                    self.broke(link.session, f"a frame lost on stream {stream(link.channel, UP)} "
                                             f"(counter {link.expect} never came)")

    def broke(self, session: Session, why: str) -> None:
        """``session``'s stream broke for good: if it is its rank's live session, report it once; the
        rank is unreachable from now on (``reachable``)."""
        if session.broken is not None or self.live.get(session.rank) is not session:
            return
        session.broken = why
        logger.warning("rank %d (pid %d): its stream to the engine broke: %s", session.rank, session.pid, why)
        if self.on_break is not None:
            try:
                self.on_break(session.rank, session.pid, why)
            except Exception:  # the caller is the queue's I/O thread: a hook must not kill it
                logger.exception("on_break hook failed for rank %d", session.rank)

    # -- handshake ----------------------------------------------------------------
    def open_control(self, identity: bytes, rank: int, pid: int) -> Session:
        """Step 1 -> 2: a pending session for a hello (the caller checked the rank is not live)."""
        session = Session(wire.new_session(), rank, pid, identity)
        self.pending[session.sid] = session
        self.links[identity] = Link(session, CONTROL, expect=0)
        while len(self.pending) > MAX_PENDING:
            _, old = self.pending.popitem(last=False)
            self._unlink(old)
        return session

    def make_live(self, session: Session) -> str | None:
        """Step 3: the session's ``ready`` arrived.  Why it cannot go live, or None."""
        current = self.live.get(session.rank)
        if current is not None:
            self.pending.pop(session.sid, None)
            self._unlink(session)
            return f"rank {session.rank} is live on another connection (pid {current.pid})"
        self.pending.pop(session.sid, None)
        session.live = True
        self.live[session.rank] = session
        return None

    def bind(self, identity: bytes, env: wire.Envelope, task_port: bool) -> str | None:
        """A task or result channel's hello: bind this connection to its stream.  Why not, or None."""
        session = self.session(env.session)
        if session is None:
            return "hello in an unknown session"
        channel, direction = divmod(env.stream, 2)
        if direction != UP or env.counter != 0:
            return f"channel hello on stream {env.stream} counter {env.counter}"
        if task_port:
            if channel != TASKS:
                return f"channel {channel} on the task port"
            if session.task_bound is not None:
                return f"task channel of rank {session.rank} already bound on the {session.task_bound} " \
                       "(replayed hello?)"
            session.task_identity, session.task_bound = identity, "task port"
            self.task_links[identity] = Link(session, TASKS)
            return None
        if not FIRST_RESULTS <= channel < FIRST_RESULTS + MAX_RESULT_CHANNELS:
            return f"channel {channel} on the control port"
        if channel in session.result_channels:
            return f"result channel {channel} of rank {session.rank} already bound (replayed hello?)"
        session.result_channels.add(channel)
        self.links[identity] = Link(session, channel)
        return None

    def bind_local(self, link: object, env: wire.Envelope, peer_pid: int) -> str | None:
        """A local link's hello: bind it as its session's task channel.  Why not, or None."""
        session = self.session(env.session)
        if session is None:
            return "hello in an unknown session"
        if (env.stream, env.counter) != (stream(TASKS, UP), 0):
            return f"local link hello on stream {env.stream} counter {env.counter}"
        if peer_pid != session.pid:
            return f"local link of pid {peer_pid} for rank {session.rank}, whose pid is {session.pid}"
        if session.task_bound is not None:
            return f"task channel of rank {session.rank} already bound on the {session.task_bound} (replayed hello?)"
        session.local, session.task_bound = link, "local link"
        self.local_links[link] = Link(session, TASKS)
        return None

    def unbind_local(self, link: object, why: str = "its local link closed") -> None:
        """The local link closed: its rank is unreachable until a new process of it registers, and
        a live rank whose bound link this was has a broken stream."""
        bound = self.local_links.pop(link, None)
        if bound is not None and bound.session.local is link:
            bound.session.local = None
            self.broke(bound.session, why)

    # -- removal -------------------------------------------------------------------
    def forget(self, rank: int) -> None:
        session = self.live.pop(rank, None)
        if session is not None:
            session.live = False  # a frame of it already being handled must not act either
            self._unlink(session)

    def _unlink(self, session: Session) -> None:
        for table in (self.links, self.task_links, self.local_links):
            for identity in [i for i, link in table.items() if link.session is session]:
                del table[identity]
        session.local = None
