"""A CTM rank's swap tasks (DESIGN §3.2, §3.8): device blocks to and from the host swap space, for
every block group of the cache layout, whole or layer by layer, and a request's state slot.

Block groups of one block size share one kernel call (``SwapPlans``).  A swap that names
``state_slots`` (device slot, host state slot) also moves the state groups' slot: a swap-in before
its first layer is published landed (a layer lands with its state), a swap-out after every layer
was computed (the state is final only then).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ops

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import Outcome, SwapTask
from cache_manager.rank.layerwise_copy import RankLayerBoard, copy_layerwise, publishing
from cache_manager.rank.resources import RankResources
from cache_manager.rank.swap_plans import SwapPlans


class RankSwaps:
    def __init__(self, platform: Any, resources: RankResources, layer_board: RankLayerBoard,
                 stop_event: threading.Event, num_cpu_blocks: int):
        self._platform, self._resources, self._layer_board = platform, resources, layer_board
        self._stop_event, self._num_cpu_blocks = stop_event, num_cpu_blocks
        self._plans = SwapPlans()  # the groups' swap plans merged, rebuilt when the plans change

    def run(self, task: SwapTask, deadline: float | None) -> Outcome:
        mode = ops.DEVICE_TO_HOST if task.event_type == CacheStatus.SWAP2CPU else ops.HOST_TO_DEVICE
        groups = self._resources.block_groups()
        plans = [g.swap_plan for g in groups]
        state = self._state(task, mode)
        if task.layerwise is None:  # no board to mark FAILED: spare the round trip a context manager
            self._check_swap_space(task)
            for plan in self._plans.whole(plans) if self._platform.merges_swap_plans else plans:
                self._platform.run_plan(plan, task.gpu_block_ids, task.cpu_block_ids, mode)
            state()
        else:
            publisher = self._layer_board.publisher(task.layerwise)
            with publishing(publisher):
                self._check_swap_space(task)
                if mode == ops.HOST_TO_DEVICE:  # a layer is published landed only with its state
                    state()
                copy_layerwise(self._platform, plans, task.gpu_block_ids, task.cpu_block_ids, mode, publisher,
                               deadline if deadline is not None else time.monotonic() + 30.0,
                               task.layerwise.await_compute, self._stop_event, self._plans,
                               [g.spec.layers for g in groups])
                if mode == ops.DEVICE_TO_HOST:  # the state is final once every layer is computed
                    state()
        return Outcome(bytes_moved=len(task.gpu_block_ids) * self._resources.block_bytes_all_layers)

    def _state(self, task: SwapTask, mode: int) -> Callable[[], None]:
        """The copy of the request's state slot the swap names (``state_slots``), to run in its turn."""
        if task.state_slots is None:
            return lambda: None
        device, host = task.state_slots
        state = [g for g in self._resources.groups if not g.moves_by_block]
        if not state:
            raise ValueError("state_slots: this cache layout has no state group")
        if any(g.swap_plan is None for g in state):
            raise ValueError("state_slots: this CTM has no host state slots (--num_cpu_state_slots 0)")

        def copy() -> None:
            for g in state:
                self._platform.run_plan(g.swap_plan, [device], [host], mode)
        return copy

    def _check_swap_space(self, task: SwapTask) -> None:
        if self._num_cpu_blocks == 0 and task.gpu_block_ids:
            raise ValueError("this CTM has no host swap space (--num_cpu_blocks 0)")
