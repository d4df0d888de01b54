"""What one CTM rank holds while it serves (DESIGN §3.4, §3.9): the device caches it attached
(one ``CacheGroup`` per group of the cache layout), the host swap space behind them, the storage mover and its
backend, and the model version in the storage namespace.

The CacheTransferManager serves tasks through these; the RL lifecycle (``lifecycle``) detaches
and re-attaches them through the methods here.  The model version is state of the rank, not a
flag: a weight update re-reads it from ``<model_path>/version.yaml``.
"""
from __future__ import annotations

import argparse
import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ops.platform import Platform
from transfer_factory import StorageAccess, StorageConfigError, create_storage_backend
from transfer_factory.keys import Namespace

from cache_manager.cache_data import CACHE_READY_SIGNAL, cache_name
from cache_manager.cache_layout import CacheLayout, TensorGroup
from cache_manager.cache_spec import key_prefix_from_version
from cache_manager.engine_watch import EngineGone
from cache_manager.ipc_signal import signal_segment_name
from cache_manager.rank.signals import RankSignals
from cache_manager.storage.device_mover import DeviceStorageMover
from cache_manager.storage.staged_mover import StorageMover
from cache_manager.storage.transfer_modes import staging_blocks


@dataclass
class CacheGroup:
    """One group's attached caches (``tensors[i]`` is model layer ``spec.layers[i]``'s), and its
    host swap space.  ``kind`` is the group's name, the kind in its IPC names."""

    kind: str
    tensors: list[Any]
    spec: TensorGroup
    host_ptrs: list[int] = field(default_factory=list)
    swap_plan: Any = None  # checked once when planned, reused by every swap task

    @property
    def moves_by_block(self) -> bool:
        """Swaps, storage and P/D address it by block id (a state group is addressed by slot)."""
        return not self.spec.per_request


class RankResources:
    def __init__(self, args: argparse.Namespace, layout: CacheLayout, platform: Platform, signals: RankSignals,
                 log: logging.Logger, stop_event: threading.Event, check_engine: Callable[[], None]):
        self._args = args
        self.layout = layout
        self._platform = platform
        self._signals = signals
        self._log = log
        self._stop_event = stop_event
        self._check_engine = check_engine  # raises EngineGone
        self.rank: int = args.rank
        self.model_version: str = args.model_version
        self.groups: list[CacheGroup] = []
        self.storage: StorageMover | DeviceStorageMover | None = None
        self._kept_host: dict[str, list[int]] = {}  # swap space kept while the caches are detached
        self.block_bytes_all_layers = 0  # one block of every kind and layer
        # The generation of this rank's memory (caches and swap space): it changes at every attach,
        # detach, allocation and free, so whatever registered or mapped the memory can tell it is
        # stale.  ``watch_release`` callbacks run before memory is let go (a Transfer Engine
        # registration must end before the memory does).
        self.memory_generation = 0
        self._release_watchers: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ device caches
    def wait_cache_ready(self) -> None:
        """Wait, bounded by ``--attach_timeout``, for the engine's ``cache_ready_signal[rank]``."""
        timeout = self._args.attach_timeout
        deadline = time.monotonic() + timeout
        while True:
            self._check_engine()
            try:
                sig = self._signals.get(CACHE_READY_SIGNAL) or self._signals.attach(CACHE_READY_SIGNAL,
                                                                                   self._args.mp_num)
                if sig.value[self.rank] == 1:
                    return
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                name = signal_segment_name(CACHE_READY_SIGNAL, self._signals.suffix)
                raise TimeoutError(f"cache_ready_signal ({name}) not set for rank {self.rank} within {timeout}s")
            if self._stop_event.wait(0.05):
                raise EngineGone("stopped while waiting for caches")

    def watch_release(self, watcher: Callable[[], None]) -> None:
        """Call ``watcher()`` before any of this rank's caches or swap space is let go."""
        self._release_watchers.append(watcher)

    def _releasing(self) -> None:
        self.memory_generation += 1
        for watcher in self._release_watchers:
            try:
                watcher()
            except Exception:  # the memory goes anyway: the watcher logs what it could not undo
                self._log.exception("a memory-release watcher failed")

    def attach(self) -> None:
        """Attach every group's device caches, each of the group's layers (extra layers, scales,
        indexers and state included)."""
        import paddle

        self.memory_generation += 1

        for group in self.layout.groups:
            template = paddle.empty([], dtype=group.dtype)
            tensors = [
                self._platform.share_external_data_(template, self._cache_name(group.name, layer),
                                                    [rows] + list(group.block_shape))
                for layer, rows in zip(group.layers, self.layout.rows(group))
            ]
            self.groups.append(CacheGroup(group.name, tensors, group))
        self.block_bytes_all_layers = sum(int(np.prod(t.shape[1:])) * t.element_size()
                                          for g in self.block_groups() for t in g.tensors)
        self._log.info("attached %d cache groups over %d layers", len(self.groups), self.layout.total_layers)

    def block_groups(self) -> list[CacheGroup]:
        """The attached groups a block id addresses (all but state groups)."""
        return [g for g in self.groups if g.moves_by_block]

    def layer_counts(self) -> dict[str, int]:
        """Per group, how many layer tensors it has (a peer's exports must match)."""
        return {g.kind: len(g.tensors) for g in self.groups}

    @staticmethod
    def rows(group: CacheGroup, layers: range) -> range:
        """The indices of ``group.tensors`` that hold model layers ``layers`` (a step-1 range)."""
        have = group.spec.layers
        return range(bisect.bisect_left(have, layers.start), bisect.bisect_left(have, layers.stop))

    def detach(self) -> None:
        """Detach every device cache; the swap space stays (``free_swap`` frees it) and is
        re-planned onto the caches of the next ``attach``."""
        if self.groups:
            self._releasing()
        for g in self.groups:
            if g.host_ptrs:
                self._kept_host[g.kind] = g.host_ptrs
            for layer, t in zip(g.spec.layers, g.tensors):
                self._platform.unset_data_ipc(t, self._cache_name(g.kind, layer), True, False)
        self.groups = []

    @property
    def num_layers(self) -> int:
        """The model's layers (speculative layers included) while caches are attached, else 0."""
        return self.layout.total_layers if self.groups else 0

    def _cache_name(self, kind: str, layer: int) -> str:
        return cache_name(kind, layer, self.rank, self._args.device_id)

    # ------------------------------------------------------------------ host swap space
    def alloc_swap(self) -> None:
        """Give every attached kind its host swap space and plan its copies: the space kept from
        before a detach if there is one, else newly allocated."""
        slots = {True: self._args.num_cpu_blocks, False: getattr(self._args, "num_cpu_state_slots", 0)}
        if not any(slots[g.moves_by_block] for g in self.groups):
            return
        self.memory_generation += 1
        allocated = 0
        for g in self.groups:  # blocks, and a state group's host state slots
            n = slots[g.moves_by_block]
            if n == 0:
                continue
            kept = self._kept_host.pop(g.kind, None)
            if kept is None:
                t = g.tensors[0]
                block_bytes = int(np.prod(t.shape[1:])) * t.element_size()
                kept = [self._platform.host_alloc(n * block_bytes) for _ in g.tensors]
                allocated += n * block_bytes * len(g.tensors)
            g.host_ptrs = kept
            g.swap_plan = self._platform.plan_all_layers(g.tensors, g.host_ptrs, n)
        if allocated:
            self._log.info("allocated %.1f MiB of host swap space (%d blocks, %d state slots)", allocated / 2**20,
                           slots[True], slots[False])
        else:
            self._log.info("host swap space kept; copies re-planned onto the attached caches")

    def free_swap(self) -> None:
        """Free the host swap space, kept or in use: its contents are gone."""
        if any(g.host_ptrs for g in self.groups) or self._kept_host:
            self._releasing()
        for ptrs in [g.host_ptrs for g in self.groups] + list(self._kept_host.values()):
            for ptr in ptrs:
                self._platform.host_free(ptr)
        for g in self.groups:
            g.host_ptrs, g.swap_plan = [], None
        self._kept_host = {}

    # ------------------------------------------------------------------ storage
    def namespace(self) -> Namespace:
        return self.layout.storage_namespace(self._args.model_path, self.model_version, self._args.mp_num)

    def reload_model_version(self) -> None:
        """Re-read the storage key prefix from ``<model_path>/version.yaml`` (after a weight update)."""
        if self._args.kvcache_storage_backend != "none":
            self.model_version = key_prefix_from_version(self._args.model_path)
            self._log.info("[RL] storage key prefix (model version) is now %r", self.model_version)

    def open_storage(self) -> None:
        """Open the backend and its mover over the attached caches (nothing with backend none)."""
        a = self._args
        if a.kvcache_storage_backend == "none":
            return
        backend = create_storage_backend(a.kvcache_storage_backend, namespace=str(self.namespace()), rank=self.rank,
                                         options=a.storage_options)
        groups = [(g.spec.tag, g.tensors, g.spec.window_blocks(self.layout.block_size, aligned=True), g.spec.per_request)
                  for g in self.groups]
        block_size = self.layout.block_size
        try:
            if backend.access == StorageAccess.DEVICE_DIRECT:
                if self.layout.legacy is None:
                    raise StorageConfigError(f"{backend.name} stores FastDeploy's K/V caches only; the cache layout "
                                             f"{self.layout.name or 'given'} has groups "
                                             f"{', '.join(g.kind for g in self.groups)}: use the file or Mooncake store")
                if a.storage_transfer == "staged":
                    raise StorageConfigError(f"--storage_transfer staged: {backend.name} moves device blocks itself "
                                             f"and cannot stage")
                self.storage = DeviceStorageMover(backend, groups, self.rank, a.mp_num, a.device_id, block_size,
                                                  self._log)
            else:
                self.storage = StorageMover(self._platform, backend, groups, self.namespace(), self.rank,
                                            staging_blocks(a.max_model_len, block_size), a.storage_transfer,
                                            self._log)
        except BaseException:
            backend.close()
            raise

    def close_storage(self) -> None:
        if self.storage is not None:
            storage, self.storage = self.storage, None
            storage.close()

    # ------------------------------------------------------------------ all
    def close(self) -> None:
        """Release everything, storage first (it reads the caches), then swap space and caches."""
        self.close_storage()
        self.free_swap()
        self.detach()
