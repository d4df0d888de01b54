"""The engine's side of the queue's rank barriers (the server's I/O thread owns it).

``arrive`` records a rank's value; when every rank arrived, each gets ``barrier_done`` with the
minimum.  A barrier whose server-side deadline passes fails on every rank that arrived, and is
remembered, so a rank that arrives later fails at once: all ranks take the same path.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

MAX_OPEN_BARRIERS = 4096
MAX_FAILED_BARRIERS = 4096

logger = logging.getLogger("cache_manager.queue.server")


class Barriers:
    def __init__(self, num_ranks: int, answer: Callable[[int, dict], None]):
        self.num_ranks = num_ranks
        self._answer = answer  # (rank, barrier_done body)
        self._open: dict[str, dict] = {}
        self._failed: collections.OrderedDict[str, None] = collections.OrderedDict()

    def arrive(self, rank: int, name: str, value: int, timeout: float) -> str | None:
        """Record ``rank`` at ``name``; why it is refused, or None."""
        if name in self._failed:
            self._answer(rank, {"type": "barrier_done", "name": name, "ok": False})
            return None
        if name not in self._open and len(self._open) >= MAX_OPEN_BARRIERS:
            return f"more than {MAX_OPEN_BARRIERS} open barriers"
        barrier = self._open.setdefault(name, {"deadline": time.monotonic() + timeout, "values": {}})
        barrier["values"][rank] = value
        if len(barrier["values"]) == self.num_ranks:
            del self._open[name]
            reduced = min(barrier["values"].values())
            for r in barrier["values"]:
                self._answer(r, {"type": "barrier_done", "name": name, "ok": True, "value": reduced})
        return None

    def poll_timeout_ms(self, longest_ms: int) -> int:
        """How long the I/O thread may block before the soonest barrier deadline."""
        if not self._open:
            return longest_ms
        soonest = min(b["deadline"] for b in self._open.values())
        return max(0, min(longest_ms, int((soonest - time.monotonic()) * 1000) + 1))

    def expire(self) -> None:
        if not self._open:
            return
        now = time.monotonic()
        for name in [n for n, b in self._open.items() if b["deadline"] <= now]:
            barrier = self._open.pop(name)
            missing = sorted(set(range(self.num_ranks)) - set(barrier["values"]))
            logger.warning("barrier %r timed out waiting for ranks %s", name, missing)
            self._failed[name] = None
            while len(self._failed) > MAX_FAILED_BARRIERS:
                self._failed.popitem(last=False)
            for r in barrier["values"]:
                self._answer(r, {"type": "barrier_done", "name": name, "ok": False, "missing": missing})
