"""The decode side of a push (DESIGN §3.11, LLM-DataDist's ``push_cache``): blocks this instance
reserved for a prefill instance to write, and the slot of this engine's layer board where each of
the prefill ranks that write here (``writers``: every prefill rank, or with MLA and a smaller decode
TP only those some decode rank reads from) publishes the layers it wrote, in its ``pushed`` column.

``wait_for_layer(i)`` returns once every writer wrote layer ``i`` (so every decode rank holds all of
its heads of it) and raises as soon as one writer published FAILED.  A writer's word is *final*
once it says every layer or FAILED: that rank writes no more.  ``released`` holds once every
writer's word is final; until then the reserved blocks must not be reused (a late write could
still land), and the slot stays held.

The reservation is fenced (``layer_progress``): the slot's ticket word holds a digest of the task's
seq and the reserved blocks while writes are welcome, and every writer checks it before its first
byte and before each layer, so a ticket that was cancelled, closed, pushed a second time, altered
(other block ids) or swapped for another reservation's writes nothing.  A writer whose process is
gone (``writer_gone``: a same-host writer's pid, watched through a pidfd) writes no more either:
its word counts as final, so a target whose writers died is released instead of held for good.
Across hosts nobody can see a writer die; ``force_release`` is the operator's way out once the
prefill instance was restarted (or its link torn down).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from cache_manager.layer_progress import (FAILED, FENCED, PUSH_WRITERS, LayerwiseRef, reservation_word, unpack,
                                          wait_until)

from ..core.errors import CacheServiceError
from ..core.layerwise import LayerWaitTimeout, LayerwiseTasks

logger = logging.getLogger(__name__)


class PushFailed(CacheServiceError):
    """A prefill rank gave up on the push; the message names the peer and the rank."""


def check_writers(peer_id: str, writers: list[int]) -> None:
    """A layer board has ``PUSH_WRITERS`` push columns: a prefill instance with more ranks writing
    here can be pulled from, but cannot push (refused here, not failed on its ranks)."""
    if writers and max(writers) >= PUSH_WRITERS:
        raise ValueError(f"instance {peer_id!r} would push from rank {max(writers)}: at most {PUSH_WRITERS} prefill "
                         "ranks can push into one instance (pull from it instead)")


class PushTarget:
    def __init__(self, tasks: LayerwiseTasks, ref: LayerwiseRef, instance_id: str, peer_id: str,
                 dst_blocks: list[int], layers: int, deadline: float, writers: list[int],
                 writer_gone: Callable[[int], bool] | None = None, salt_tag: str = ""):
        self._tasks, self.ref = tasks, ref
        self.writers = list(writers)
        self.instance_id, self.peer_id = instance_id, peer_id
        self.dst_blocks = dst_blocks
        self.layers, self.deadline = layers, deadline
        self._writer_gone = writer_gone or (lambda writer: False)
        self._freed = False
        self.salt_tag = salt_tag  # the tenant's: a push of another tenant's request matches no reservation
        self._tasks.board.set_ticket(ref.slot, reservation_word(ref.seq, dst_blocks, salt_tag))  # before it leaves

    @property
    def ticket(self) -> dict:
        """What the prefill instance needs to push here (plain data, for the router to carry)."""
        return {"instance_id": self.instance_id, "slot": self.ref.slot, "seq": self.ref.seq,
                "dst_block_ids": list(self.dst_blocks)}

    def _words(self) -> list[int | None]:
        board = self._tasks.board
        return [unpack(board.pushed(self.ref.slot, writer), self.ref.seq) for writer in self.writers]

    def _final(self, writer: int, value: int | None) -> bool:
        """Writer ``writer`` writes no more: its word says every layer or FAILED, or it is gone."""
        return value in (self.layers, FAILED) or self._writer_gone(writer)

    def _landed(self, layer: int) -> bool:
        words = self._words()
        for writer, value in zip(self.writers, words):
            if value == FAILED:
                raise PushFailed(f"push from {self.peer_id}: its rank {writer} gave up before layer {layer} landed")
            if (value is None or value <= layer) and self._writer_gone(writer):
                raise PushFailed(f"push from {self.peer_id}: its rank {writer} is gone (its process ended) before "
                                 f"layer {layer} landed")
        return all(value is not None and value > layer for value in words)

    def missing(self, layer: int) -> list[int]:
        """The writer ranks that have not written ``layer`` yet (for the error that names them)."""
        return [w for w, value in zip(self.writers, self._words()) if value is None or value <= layer]

    def wait_for_layer(self, layer: int, timeout: float | None = None) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer!r} must be an integer in [0, {self.layers})")
        deadline = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        try:
            wait_until(lambda: self._landed(layer), deadline, "")
        except PushFailed:
            raise
        except TimeoutError:
            raise LayerWaitTimeout(f"push from {self.peer_id}: layer {layer} had not landed in time; "
                                   f"its ranks {self.missing(layer)} had not written it") from None

    def result(self, timeout: float | None = None) -> list[int]:
        """Every layer landed on every rank: the destination blocks."""
        self.wait_for_layer(self.layers - 1, timeout)
        return list(self.dst_blocks)

    @property
    def released(self) -> bool:
        """No prefill rank will write into the reserved blocks any more."""
        return self._freed or all(self._final(w, value) for w, value in zip(self.writers, self._words()))

    def wait_released(self, timeout: float) -> bool:
        try:
            wait_until(lambda: self.released, time.monotonic() + timeout, "push not released")
        except TimeoutError:
            return False
        return True

    def cancel(self) -> bool:
        """Fence the ticket (no writer starts after this) and give the slot back if no writer had
        started: True.  False if one had: the blocks are released once every writer that started
        stopped (``released``; a fenced writer stops before its next layer)."""
        if self._freed:
            return True
        self._fence()
        if any(value is not None and not self._writer_gone(w) for w, value in zip(self.writers, self._words())):
            return False
        self._free()
        return True

    def close(self) -> bool:
        """Fence the ticket (a push of it again writes nothing) and give the board slot back once
        released; False (slot kept, logged) while a rank may still write, so the slot never goes to
        a newer task under a late writer."""
        if self._freed:
            return True
        self._fence()
        if not self.released:
            logger.error("push from %s into blocks %s not released: its slot %d stays held", self.peer_id,
                         self.dst_blocks[:8], self.ref.slot)
            return False
        self._free()
        return True

    def force_release(self) -> None:
        """The operator's word that no writer of this push can write any more (its prefill instance
        was restarted, or the link torn down so its writes are refused): fence and free the slot.
        The reserved blocks may be reused from now on."""
        if not self._freed:
            logger.warning("push from %s into blocks %s force-released (slot %d)", self.peer_id, self.dst_blocks[:8],
                           self.ref.slot)
            self._fence()
            self._free()

    def _fence(self) -> None:
        self._tasks.board.set_ticket(self.ref.slot, FENCED)

    def _free(self) -> None:
        self._freed = True
        self._tasks.free(self.ref)
