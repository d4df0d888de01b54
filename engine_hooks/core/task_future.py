"""TaskFuture: the future an engine holds for one task (DESIGN §3.8).

Besides the task's result it carries what the ranks reported (``rank_results``), the second phase
of completion (``released``), and for a layer-wise task the per-layer methods ``wait_for_layer`` /
``layer_computed``.  The tracker and the layer-wise board fill these in through methods, so the
future stays the one owner of its state.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Mapping, Protocol

from cache_manager.cache_tasks import RankResult


class LayerWaiter(Protocol):
    """What a layer-wise task's future delegates its per-layer methods to (``engine_hooks.core.layerwise``)."""

    def wait(self, layer: int, timeout: float | None = None) -> int: ...

    def computed(self, count: int) -> None: ...


class TaskFuture(Future):
    """A task's future, running from the start (a submitted task cannot be cancelled).

    ``released`` is done once no rank may still touch the task's blocks.  Nearly every task is
    released with its answer and nobody asks, so that second Future (a Condition and an RLock to
    build, a notify to resolve: a few microseconds of every round trip) is made on first access."""

    def __init__(self, released: bool = False):
        super().__init__()
        self.set_running_or_notify_cancel()
        self._released: Future | None = None
        self._let_go = released
        self._rank_results: dict[int, RankResult] = {}
        self._layerwise: LayerWaiter | None = None
        self._observer: tuple[Callable[[BaseException | None], None], Callable[[], None]] | None = None

    # ------------------------------------------------------------------ an observer (transfer records)
    def observe(self, on_done: Callable[[BaseException | None], None], on_released: Callable[[], None]) -> None:
        """Have ``on_done(error)`` and ``on_released()`` called as the task resolves and is released,
        *before* anyone waiting on it wakes (so a caller that got the result sees them done); at once
        for what already happened.  Each may be called twice in a race with the resolution: they must
        be idempotent.  One observer per future."""
        with self._condition:
            if self._observer is not None:
                raise RuntimeError("this future has its observer already")
            self._observer = (on_done, on_released)
            done, let_go = self.done(), self._let_go
        if done:
            on_done(self.exception())
        if let_go:
            on_released()

    def set_result(self, result) -> None:
        if self._observer is not None:
            self._observer[0](None)
        super().set_result(result)

    def set_exception(self, exception) -> None:
        if self._observer is not None:
            self._observer[0](exception)
        super().set_exception(exception)

    # ------------------------------------------------------------------ two-phase completion
    @property
    def released(self) -> Future:
        with self._condition:  # the future's own lock: let_go may run on the queue's thread
            released = self._released
            if released is None:
                released = self._released = Future()
                if self._let_go:
                    released.set_result(None)
        return released

    def let_go(self) -> None:
        """Resolve ``released`` (the tracker, once every rank let go; a second call does nothing)."""
        with self._condition:
            self._let_go = True
            released = self._released
        if self._observer is not None:
            self._observer[1]()
        if released is not None and not released.done():
            released.set_result(None)

    # ------------------------------------------------------------------ what the ranks reported
    @property
    def rank_results(self) -> dict[int, RankResult]:
        """Each rank's ``RankResult`` so far, in rank order (empty until the task resolves)."""
        return self._rank_results

    def set_rank_results(self, results: Mapping[int, RankResult]) -> None:
        """The tracker records the ranks' answers, before it resolves the future (so whoever sees
        the result sees them too)."""
        self._rank_results = dict(sorted(results.items()))

    # ------------------------------------------------------------------ layer-wise tasks
    def attach_layerwise(self, waiter: LayerWaiter) -> None:
        """Give a layer-wise task its per-layer waiter; once, right after submission."""
        with self._condition:
            if self._layerwise is not None:
                raise RuntimeError("this future has its layer-wise waiter already")
            self._layerwise = waiter

    def wait_for_layer(self, layer: int, timeout: float | None = None) -> int:
        """Block until layer ``layer`` landed on every rank; the leading blocks it holds on all of
        them (``engine_hooks.core.layerwise``)."""
        return self._waiter().wait(layer, timeout)

    def layer_computed(self, count: int) -> None:
        """The model has computed layers ``[0, count)``: a layer-wise store may copy them out."""
        self._waiter().computed(count)

    def _waiter(self) -> LayerWaiter:
        waiter = self._layerwise
        if waiter is None:
            # The error a caller got when these methods existed only on layer-wise futures.
            raise AttributeError("wait_for_layer / layer_computed need a task submitted with layerwise=True")
        return waiter
