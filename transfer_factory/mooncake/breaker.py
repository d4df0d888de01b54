"""The circuit breaker that keeps a MooncakeStore's calls bounded while its master is down.

Why: against a dead master every Mooncake call blocks ~4.5 s, against a hung one for the RPC
timeout (see ``connection.py``), so a storage mover's threads would pile up behind it.

How: a batch that fails at the RPC level (-9xx) or raises marks the store *down*.  While down,
calls are refused at once (the store answers ``UNAVAILABLE`` without touching the client),
except that at most once per ``retry_interval`` one caller first probes the master with a TCP
connect (``probe_timeout``); only if it answers does that caller's batch go through, and its
result decides whether the store is up again.  So while the master is dead every call returns
in about a millisecond (at most ``probe_timeout``); while it hangs, at most one call per
``retry_interval`` waits for the RPC timeout (5 s by default, plus up to ~2 s when a
reconnect's ``close`` holds the GIL meanwhile).  Calls already in flight when the master dies
return on their own (first -900 at once, otherwise ~4.5 s or the RPC timeout).

The breaker also says when a reconnect is due: the master has answered probes for
``reconnect_after`` seconds and batches still fail at the RPC level (at most once per
``max(reconnect_after, retry_interval)``).  Only results from the client in place count: a late
answer from a replaced client says nothing about the new one.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("transfer_factory.mooncake.store")  # the store's log lines keep their logger name

# A probe answers (whether the master answered, why not).
Probe = Callable[[], tuple[bool, str]]


class CircuitBreaker:
    """Up/down state of one store's master, and the pacing of probes and reconnects."""

    def __init__(self, probe: Probe, *, retry_interval: float, reconnect_after: float, rank: int,
                 master: str) -> None:
        self.retry_interval = float(retry_interval)
        self.reconnect_after = float(reconnect_after)
        self._probe = probe
        self._rank = rank                 # for log lines only
        self._master = master
        self._lock = threading.Lock()
        self._down = False
        self._down_since = 0.0
        self._reachable_since: float | None = None   # while down: when the master began answering probes
        self._next_probe = 0.0
        self._next_reconnect = 0.0
        self._generation: int | None = None            # the client in place, whose results count
        self._stats = {"calls": 0, "fast_failed": 0, "failed_batches": 0, "probes": 0}

    def stats(self) -> dict[str, int]:
        """Counters: calls asked for, refused (fast_failed), failed batches, probes."""
        with self._lock:
            return dict(self._stats)

    def is_down(self) -> bool:
        with self._lock:
            return self._down

    def client_changed(self, generation: int | None) -> None:
        """A new client is in place (None: none, the store closed): only its results count from now
        on, and the next call may try it at once."""
        with self._lock:
            self._generation = generation
            self._next_probe = 0.0

    def admit(self) -> bool:
        """Whether a call may go to the client; False to fail fast.  While down, the one caller whose
        turn it is probes the master first (outside the lock: the probe may take ``probe_timeout``)."""
        with self._lock:
            self._stats["calls"] += 1
            if not self._down:
                return True
            now = time.monotonic()
            if now < self._next_probe:
                self._stats["fast_failed"] += 1
                return False
            self._next_probe = now + self.retry_interval    # this caller probes; the others fail fast
        ok, _ = self._probe()
        with self._lock:
            self._stats["probes"] += 1
            if not ok:
                self._reachable_since = None
                self._stats["fast_failed"] += 1
                return False
            if self._reachable_since is None:
                self._reachable_since = time.monotonic()
        return True

    def record(self, failed: bool, what: str, generation: int) -> None:
        """The outcome of a batch on client ``generation``: ``failed`` at the RPC level, ``what`` says how."""
        with self._lock:
            if generation != self._generation:
                return                  # a late answer from a replaced client says nothing about the new one
            now = time.monotonic()
            if failed:
                self._stats["failed_batches"] += 1
                if not self._down:
                    self._down, self._down_since, self._reachable_since = True, now, None
                    log.warning("mooncake store rank %d: master %s unavailable (%s); failing fast, probing every %.1fs",
                                self._rank, self._master, what, self.retry_interval)
                self._next_probe = max(self._next_probe, now + self.retry_interval)
            elif self._down:
                self._down, self._reachable_since = False, None
                log.warning("mooncake store rank %d: master %s available again after %.1fs",
                            self._rank, self._master, now - self._down_since)

    def reconnect_due(self) -> bool:
        """Whether to build a new client now; a True answer starts the wait until the next one may be."""
        with self._lock:
            now = time.monotonic()
            if (not self._down or self._reachable_since is None or now - self._reachable_since < self.reconnect_after
                    or now < self._next_reconnect):
                return False
            self._next_reconnect = now + max(self.reconnect_after, self.retry_interval)
            return True
