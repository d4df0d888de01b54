"""The engine's side of layer-wise tasks: slots of the progress board and ``wait_for_layer``.

A layer-wise load (``swap_to_gpu`` / ``read_storage`` with ``layerwise=True``) returns the usual
``TaskFuture`` with a waiter attached (``bind``), which its two per-layer methods delegate to:

* ``future.wait_for_layer(layer, timeout=None) -> int`` returns as soon as layer ``layer`` has landed
  on every rank, with the number of leading blocks that layer holds on every rank (all of them for
  a swap; the blocks found, for a storage read).  It raises the task's own error as soon as the task
  failed (also when the layer had landed: a failed load is recomputed as a whole), and
  ``LayerWaitTimeout`` at ``timeout`` or at the task's deadline, whichever comes first.
* A layer-wise store (``swap_to_cpu`` / ``write_storage`` with ``layerwise=True``) has
  ``future.layer_computed(count)``: the model has computed layers ``[0, count)``, so the ranks may
  copy them out while later layers are computed.  The ranks wait for it until the task's deadline.

A slot goes back to the free list only when ``future.released`` is done, so a late rank never writes
into a slot that a newer task uses.  When every slot is taken the task runs whole-task, and
``wait_for_layer`` waits for the whole task: slower, never wrong.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable

from cache_manager.layer_progress import FAILED, MAX_SEQ, SLOTS, LayerBoard, LayerwiseRef, pack, unpack, wait_until

from .errors import CacheServiceError
from .task_future import TaskFuture

logger = logging.getLogger(__name__)


class LayerWaitTimeout(CacheServiceError, TimeoutError):
    """``wait_for_layer`` gave up: the layer had not landed on every rank in time."""


class LayerwiseTasks:
    """Owns the board (created by the engine) and hands out its slots."""

    def __init__(self, tp: int, suffix: object):
        self.tp = tp
        self.board = LayerBoard(tp, suffix, create=True)
        self._lock = threading.Lock()
        self._free = list(range(SLOTS - 1, -1, -1))
        self._seqs = itertools.count(1)
        self._fallbacks = 0

    def acquire(self, await_compute: bool) -> LayerwiseRef | None:
        with self._lock:
            if not self._free:
                self._fallbacks += 1
                if self._fallbacks in (1, 10, 100) or self._fallbacks % 1000 == 0:
                    logger.warning("all %d layer-wise slots are held by unreleased tasks; %d tasks ran whole-task",
                                   SLOTS, self._fallbacks)
                return None
            slot = self._free.pop()
            seq = next(self._seqs)
        if seq > MAX_SEQ:
            raise OverflowError("layer-wise sequence numbers exhausted")
        return LayerwiseRef(slot, seq, await_compute)

    def free(self, ref: LayerwiseRef) -> None:
        """Give back a slot acquired for a task this engine watches itself (a push into it)."""
        self._free_slot(ref.slot)

    def _free_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def bind(self, future: TaskFuture, task_id: str, deadline: float, ref: LayerwiseRef | None,
             layers: int) -> TaskFuture:
        """Attach ``future``'s layer-wise waiter; the slot frees itself once the task is released."""
        if ref is None:
            future.attach_layerwise(_WholeTaskWaiter(future, layers, deadline))
            return future
        future.attach_layerwise(_LayerWaiter(self.board, ref, future, layers, deadline, task_id))
        future.released.add_done_callback(lambda _: self._free_slot(ref.slot))
        return future

    def submit(self, task: dict, timeout: float, await_compute: bool, layers: int,
               send: Callable[[dict], TaskFuture]) -> TaskFuture:
        """Send ``task`` (which has its ``task_id``) layer-wise through ``send``, which stamps the
        ranks' deadline ``timeout`` seconds on; returns its future with the layer methods bound."""
        ref = self.acquire(await_compute)
        if ref is not None:
            task["layerwise"] = ref.to_wire()
        deadline = time.monotonic() + timeout  # at or before the one send() stamps on the ranks' copy
        return self.bind(send(task), task["task_id"], deadline, ref, layers)

    def close(self) -> None:
        self.board.close()


def _check_layer(layer: Any, layers: int) -> int:
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < layers:
        raise ValueError(f"layer {layer!r} must be an integer in [0, {layers})")
    return layer


class _WholeTaskWaiter:
    """No slot was free: the task runs whole-task, so a layer has landed once the task is done."""

    def __init__(self, future: Future, layers: int, deadline: float):
        self.future, self.layers, self.deadline = future, layers, deadline

    def wait(self, layer: int, timeout: float | None = None) -> int:
        _check_layer(layer, self.layers)
        remaining = self.deadline - time.monotonic()
        limit = remaining if timeout is None else min(timeout, remaining)
        try:
            value = self.future.result(timeout=max(0.0, limit))
        except FutureTimeout:
            raise LayerWaitTimeout(f"layer {layer} not loaded within {max(0.0, limit):.3f}s") from None
        return len(value[3]) if isinstance(value, tuple) else len(value)

    def computed(self, count: int) -> None:
        """A whole-task store copies every layer at once, when its turn comes: nothing to tell it."""


class _LayerWaiter:
    def __init__(self, board: LayerBoard, ref: LayerwiseRef, future: Future, layers: int, deadline: float,
                 task_id: str):
        self.board, self.ref, self.future = board, ref, future
        self.layers, self.deadline, self.task_id = layers, deadline, task_id
        # A word of this task is seq << 24 | value: "layer l landed" is a plain comparison of the
        # word, since words of other tasks lie below the base or above the failure mark.
        self._base = pack(ref.seq, 0)
        self._failed = pack(ref.seq, FAILED)
        self._blocks: int | None = None  # blocks on every rank, once all published (never changes)

    def _raise_if_failed(self) -> None:
        if self.future.done() and self.future.exception() is not None:
            raise self.future.exception()

    def _landed(self, layer: int) -> bool:
        """Called once per layer of every load, mostly for a layer already there: one read of the
        slot's row and integer comparisons, no per-rank calls."""
        self._raise_if_failed()
        wanted, failed = self._base + layer + 1, self._failed
        for word in self.board.landed_row(self.ref.slot):
            if word < wanted or word >= failed:
                return self._landed_per_rank(layer)
        return True

    def _landed_per_rank(self, layer: int) -> bool:
        for rank in range(self.board.tp):
            value = unpack(self.board.landed(self.ref.slot, rank), self.ref.seq)
            if value == FAILED:
                # The rank's error is on its way; wait for it briefly, so the caller gets the real reason.
                try:
                    self.future.exception(timeout=max(0.0, min(1.0, self.deadline - time.monotonic())))
                except FutureTimeout:
                    pass
                self._raise_if_failed()
                raise CacheServiceError(f"task {self.task_id}: rank {rank} gave up before layer {layer} landed")
            if value is None or value <= layer:
                return False
        return True

    def wait(self, layer: int, timeout: float | None = None) -> int:
        """Blocks until ``layer`` is complete on every rank; returns the blocks it holds on all of them."""
        _check_layer(layer, self.layers)
        if not self._landed(layer):
            deadline = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
            try:
                wait_until(lambda: self._landed(layer), deadline,
                           f"task {self.task_id}: layer {layer} had not landed on every rank in time")
            except TimeoutError as exc:
                if isinstance(exc, CacheServiceError):
                    raise
                self._raise_if_failed()
                raise LayerWaitTimeout(str(exc)) from None
        if self._blocks is None:
            counts = [unpack(self.board.blocks(self.ref.slot, rank), self.ref.seq) for rank in range(self.board.tp)]
            if any(c is None for c in counts):  # a rank publishes blocks before its first layer
                raise CacheServiceError(f"task {self.task_id}: a rank published layers without its block count")
            self._blocks = min(counts)  # type: ignore[type-var]
        return self._blocks

    def computed(self, count: int) -> None:
        """The model has computed layers ``[0, count)`` (a layer-wise store copies them out)."""
        if not self.ref.await_compute:
            raise ValueError("layer_computed() is for layer-wise stores (swap_to_cpu / write_storage)")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= self.layers:
            raise ValueError(f"layer count {count!r} must be an integer in [0, {self.layers}]")
        current = unpack(self.board.computed(self.ref.slot), self.ref.seq) or 0
        if count > current:
            self.board.set_computed(self.ref.slot, pack(self.ref.seq, count))
