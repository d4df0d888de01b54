"""The prefix cache's storage writes in flight.  Each pins the device blocks it reads until its
future is done *and* released (DESIGN §3.8): a late write must never read a reused block."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable

from ..core.late_tasks import released_of


@dataclass
class StorageWrite:
    future: Future
    blocks: list[int]  # the device blocks it pins until it is done and released
    hashes: list[str]

    def over(self) -> bool:
        """Done and released: its blocks may be unpinned."""
        return self.future.done() and released_of(self.future).done()


class StorageWrites:
    def __init__(self) -> None:
        self._writes: list[StorageWrite] = []

    def add(self, future: Future, blocks: Iterable[int], hashes: Iterable[str]) -> StorageWrite:
        write = StorageWrite(future, list(blocks), list(hashes))
        self._writes.append(write)
        return write

    def take_over(self) -> list[StorageWrite]:
        """Remove and return the writes that are done and released."""
        over = [w for w in self._writes if w.over()]
        self._writes = [w for w in self._writes if not any(w is o for o in over)]
        return over

    def pending(self) -> list[Future]:
        """What to wait on for the next write to be over: its answer, then its release."""
        waiting = [w.future if not w.future.done() else released_of(w.future) for w in self._writes]
        return [f for f in waiting if not f.done()]

    def includes_any(self, writes: Iterable[StorageWrite]) -> bool:
        """Whether any of ``writes`` is still in flight (not taken over)."""
        return any(w is x for w in writes for x in self._writes)

    def blocks(self) -> set[int]:
        """The device blocks pinned by writes in flight."""
        return {b for w in self._writes for b in w.blocks}

    def hashes(self) -> set[str]:
        """The block hashes being written."""
        return {h for w in self._writes for h in w.hashes}

    def __len__(self) -> int:
        return len(self._writes)
