"""The engine's side of two-phase completion (DESIGN §3.8): what a task's future says about the
blocks it touched.

A task that failed or timed out may still be acted on by a rank (a stalled rank, a storage call
that outlived its deadline) until the service resolves ``future.released``.  Until then the
engine must not reuse the task's device blocks or host slots: ``Quarantine`` keeps them out of
circulation and hands them back once released.  ``bytes_moved`` reads what the ranks report
having moved, the only honest source for byte counts.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable

logger = logging.getLogger(__name__)


def released_of(future: Future) -> Future:
    """The future that resolves once every rank let go of the task's blocks.  A service without
    two-phase completion has none: its task is over when the future is."""
    released = getattr(future, "released", None)
    return released if released is not None else future


def bytes_moved(future: Future) -> int:
    """Bytes the ranks report having moved for the task, summed over ranks (0 when none answered)."""
    results = getattr(future, "rank_results", None) or {}
    return sum(int(getattr(r, "bytes_moved", 0) or 0) for r in results.values())


def outcome(future: Future, timeout: float) -> tuple[bool, Any, BaseException | None]:
    """(usable, value, error) of a task, waiting at most ``timeout`` for its answer.  Usable means
    it succeeded on every rank *and* is released: a task answered in time while one of its I/Os
    still runs (``released`` pending) is treated as failed, since its blocks may still change."""
    try:
        value = future.result(timeout)
    except Exception as exc:  # any failure: the engine recomputes; the blocks wait for the release
        return False, None, exc
    if not released_of(future).done():
        return False, value, None
    return True, value, None


@dataclass
class _Held:
    released: Future
    blocks: list[int]
    slots: list[int]
    what: str


class Quarantine:
    """Device blocks and host slots that late tasks may still touch: in no free list, no LRU, no
    lease, until the task is released."""

    def __init__(self) -> None:
        self._held: list[_Held] = []

    def hold(self, future: Future, blocks: Iterable[int], slots: Iterable[int], what: str) -> bool:
        """Quarantine ``blocks``/``slots`` of ``future``'s task.  False when it is released already
        (a dead or restarted rank, a task that never reached a rank): the caller keeps them."""
        held = _Held(released_of(future), list(blocks), list(slots), what)
        if held.released.done() or not (held.blocks or held.slots):
            return False
        logger.warning("%s failed while a rank may still act on it: holding device blocks %s and host slots %s "
                       "until every rank has released it", what, held.blocks[:8], held.slots[:8])
        self._held.append(held)
        return True

    def reap(self) -> tuple[list[int], list[int]]:
        """Take out what has been released: (device blocks, host slots)."""
        blocks: list[int] = []
        slots: list[int] = []
        keep = []
        for held in self._held:
            if held.released.done():
                logger.info("%s released: device blocks %s and host slots %s back in use", held.what,
                            held.blocks[:8], held.slots[:8])
                blocks += held.blocks
                slots += held.slots
            else:
                keep.append(held)
        self._held = keep
        return blocks, slots

    def pending(self) -> list[Future]:
        """The releases still awaited."""
        return [h.released for h in self._held if not h.released.done()]

    def blocks(self) -> set[int]:
        return {b for h in self._held for b in h.blocks}

    def slots(self) -> set[int]:
        return {s for h in self._held for s in h.slots}

    def __len__(self) -> int:
        return len(self._held)
