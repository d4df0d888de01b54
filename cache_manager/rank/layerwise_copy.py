"""A rank's side of layer-wise tasks (DESIGN §3.8): copy layer by layer and publish each one.

A layer-wise swap-in copies layer ``l`` of every block, for every cache kind, then publishes "``l + 1``
layers landed" on the board; the engine's ``wait_for_layer(l)`` returns on that store.  A layer-wise
swap-out (a store) first waits for the engine's "``l + 1`` layers computed".  Whatever goes wrong,
the rank publishes ``FAILED`` before it answers, so a waiter fails at once, and it never publishes a
layer whose copy did not return.  Storage tasks publish through the same ``LayerPublisher``.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ops.layout import CopyPlan

from cache_manager.ipc_signal import signal_segment_name
from cache_manager.layer_progress import LAYER_PROGRESS_SIGNAL, LayerBoard, LayerPublisher, LayerwiseRef
from cache_manager.rank.swap_plans import SwapPlans


class RankLayerBoard:
    """The board as one rank sees it: attached on the first layer-wise task, so a CTM that never
    gets one (or an engine without a board) pays nothing."""

    def __init__(self, tp: int, suffix: object, rank: int, log: logging.Logger):
        self.tp, self.suffix, self.rank, self.log = tp, suffix, rank, log
        self._board: LayerBoard | None = None
        self._lock = threading.Lock()

    def publisher(self, ref: LayerwiseRef) -> LayerPublisher:
        with self._lock:
            if self._board is None:
                try:
                    self._board = LayerBoard(self.tp, self.suffix)
                except FileNotFoundError:
                    name = signal_segment_name(LAYER_PROGRESS_SIGNAL, self.suffix)
                    raise ValueError(f"layer-wise task, but the engine created no progress board ({name})") from None
                self.log.info("attached the layer progress board")
        return LayerPublisher(self._board, self.rank, ref)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()  # detaches only: the engine created it
            self._board = None


@contextmanager
def publishing(publisher: LayerPublisher | None) -> Iterator[LayerPublisher | None]:
    """Marks the task ``FAILED`` on the board when its body raises."""
    try:
        yield publisher
    except BaseException:
        if publisher is not None:
            publisher.fail()
        raise


def copy_layerwise(platform: Any, plans: Sequence[CopyPlan], device_ids: Sequence[int], host_ids: Sequence[int],
                   mode: int, publisher: LayerPublisher, deadline: float, await_compute: bool,
                   stop: threading.Event | None = None, swap_plans: SwapPlans | None = None,
                   plan_layers: Sequence[Sequence[int]] | None = None) -> None:
    """Copy the blocks of every plan (one per cache group), layer by layer, publishing each model
    layer once every group that has it copied it (``plan_layers``: each plan's model layers)."""
    per_layer = (swap_plans or SwapPlans()).per_layer(plans, plan_layers)
    publisher.set_blocks(len(device_ids))
    for layer, layer_plans_ in enumerate(per_layer):
        if await_compute:
            publisher.wait_computed(layer + 1, deadline, stop)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"deadline passed before layer {layer} was copied")
        for plan in layer_plans_:
            platform.run_plan(plan, device_ids, host_ids, mode)
        publisher.layers_done(layer + 1)
