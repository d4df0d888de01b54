"""The engine's record of which host swap slots hold what, for one generation of each rank's swap space.

A rank's host swap space lives in its CTM process: a rank restarted (by the service), or a CTM that
rejoins the queue (FastDeploy launches its own), has new, empty swap space.  A swap-in from a slot
written before that would load zeros on that rank and the old bytes on the others.  ``HostSlots``
remembers the slots written since the last replacement of any rank, and which slots a replacement
emptied: a swap-in from one fails before it is sent, naming the rank and the slots, so an engine that
did not hear of the restart never computes on wrong bytes (DESIGN §3.8, "Generations").

What writes a slot: a swap-out (``SWAP2CPU``, its ``cpu_block_ids``) and a prefill/decode pull into
host swap space (``PEER_PULL`` with ``"placement": "host"``, its ``dst_block_ids``).  What reads one:
a swap-in (``SWAP2GPU``, its ``cpu_block_ids``).  A write makes its slots good again.  A swap's
``state_slots`` (device slot, host slot) write or read a host *state* slot the same way: host
state slots are a space of their own, recorded as ``("state", slot)``.
"""
from __future__ import annotations

import threading

from cache_manager.cache_data import CacheStatus

from .errors import TaskFailedError

MAX_NAMED_SLOTS = 8  # an error names at most this many slots


def _state(task: dict) -> list:
    slots = task.get("state_slots")
    return [("state", slots[1])] if isinstance(slots, list) and len(slots) == 2 else []


def slots_written(task: dict) -> list | None:
    """The host slots ``task`` writes (as given; a state slot as ``("state", slot)``), or None."""
    event = task.get("event_type")
    if event == CacheStatus.SWAP2CPU:
        return list(task.get("cpu_block_ids") or []) + _state(task)
    if event == CacheStatus.PEER_PULL and task.get("placement") == "host":
        return task.get("dst_block_ids")
    return None


def slots_read(task: dict) -> list | None:
    """The host slots ``task`` reads (as given; a state slot as ``("state", slot)``), or None."""
    if task.get("event_type") == CacheStatus.SWAP2GPU:
        return list(task.get("cpu_block_ids") or []) + _state(task)
    return None


class HostSlots:
    """The slots written since the last replacement of any rank, and the slots a replacement emptied
    (slot -> the rank whose replacement emptied it) since the engine last wrote them."""

    def __init__(self, num_slots: int | None):
        """``num_slots``: the ranks' swap slots (ids outside are refused by the ranks, not recorded);
        None when the engine does not know it (FastDeploy's façade): every non-negative id counts."""
        self._num_slots = num_slots
        self._lock = threading.Lock()
        self._written: set[int] = set()
        self._lost: dict[int, int] = {}

    def rank_restarted(self, rank: int) -> None:
        """Rank ``rank``'s swap space was replaced by a new, empty one."""
        with self._lock:
            for slot in self._written:
                self._lost.setdefault(slot, rank)
            self._written.clear()

    def lost(self) -> dict[int, int]:
        """Slot -> the rank whose replacement emptied it (for inspection)."""
        with self._lock:
            return dict(self._lost)

    def refusal(self, task: dict) -> TaskFailedError | None:
        """Why ``task`` must fail before it is sent (a swap-in from a slot a replacement emptied), or
        None; a task that writes slots makes them good again (recorded here, at submission)."""
        written, read = slots_written(task), slots_read(task)
        given = written if written is not None else read
        if not isinstance(given, list):
            return None
        slots = [s for s in given if (type(s) is int and s >= 0 and (self._num_slots is None or s < self._num_slots))
                 or (isinstance(s, tuple) and type(s[1]) is int and s[1] >= 0)]  # the ranks refuse the rest
        with self._lock:
            if written is not None:
                self._written.update(slots)
                for slot in slots:
                    self._lost.pop(slot, None)
                return None
            lost = {slot: self._lost[slot] for slot in slots if slot in self._lost}
        if not lost:
            return None
        rank = min(lost.values())
        named = sorted((s for s, r in lost.items() if r == rank), key=lambda s: (isinstance(s, tuple), str(s)
                       if isinstance(s, tuple) else s))
        return TaskFailedError(task.get("task_id", "(not submitted)"),
                               {rank: f"host slots {named[:MAX_NAMED_SLOTS]} lost their contents when this rank's "
                                      "CTM was replaced (restarted or rejoined with new swap space): write the "
                                      "blocks into them again before swapping them in"})
