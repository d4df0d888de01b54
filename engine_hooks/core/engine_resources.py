"""What the engine shares with its CTMs through memory: the device caches, the IPC signals (DESIGN
§3.5) and the model version the storage keys are namespaced under.

``EngineResources`` is their one owner.  The service creates it, reads and sets the signals through
it, and closes it; the RL weight-update code (``kv_cache_control``) drives the cache lifecycle and
the model version through its methods.  The engine creates and unlinks every signal; the CTMs only
attach.

It also owns the caches' *generation* (DESIGN §3.8): a number that changes whenever the memory is
replaced.  Whatever is derived from the caches (a prefill/decode side's exposure board, whose
generation word peer links are checked against) subscribes with ``watch_generation``; it hears
``NO_GENERATION`` when a replacement begins (``retire_generation``, before the ranks let go and the
memory is freed), and the new generation once new memory exists.  Every replacement goes through
``retire_generation``, ``free_caches`` and ``recreate_caches``, whoever drives it.
"""
from __future__ import annotations

import logging
import time
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import numpy as np

from cache_manager.cache_data import (
    CACHE_READY_SIGNAL,
    CACHE_TRANSFER_INITED_SIGNAL,
    KV_CACHE_STATUS_SIGNAL,
    PER_RANK_SIGNALS,
    SWAP_SPACE_READY_SIGNAL,
    WORKER_HEALTHY_LIVE_SIGNAL,
    KVCacheStatus,
)
from cache_manager.cache_layout import CacheLayout
from cache_manager.cache_spec import CacheSpec, key_prefix_from_version
from cache_manager.ipc_signal import IPCSignal
from ops.platform import Platform
from transfer_factory.keys import Namespace
from transfer_factory.peer.handles import NO_GENERATION, new_generation

from .device_caches import DeviceCaches

logger = logging.getLogger(__name__)


class EngineResources:
    """The device caches of every rank, the IPC signals (suffix ``signal_suffix``: the
    ``engine_worker_queue_port`` with the engine's random token, ``ipc_signal.ipc_suffix``, so that
    no other user can create the names first) and the current model version."""

    def __init__(self, platform: Platform, spec: CacheSpec | CacheLayout, tp: int, device_ids: Sequence[int],
                 signal_suffix: int | str, model_id: str, model_version: str):
        self.platform = platform
        self.spec = spec
        self.tp = tp
        self.device_ids = list(device_ids)
        self.model_id = model_id
        self._suffix = signal_suffix
        self._model_version = model_version
        self._signals: dict[str, IPCSignal] = {}
        self._caches: DeviceCaches | None = None
        self._generation = NO_GENERATION
        self._last_generation = NO_GENERATION
        self._watchers: list[Callable[[int], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def create(self) -> None:
        """Create the signals, then every rank's caches (each rank's ``cache_ready`` set once they
        are exported).  On failure the caller closes what was created."""
        zeros = np.zeros(self.tp, np.int32)
        for name in PER_RANK_SIGNALS:
            self._signals[name] = IPCSignal(name, zeros, suffix=self._suffix, create=True)
        for name in (WORKER_HEALTHY_LIVE_SIGNAL, KV_CACHE_STATUS_SIGNAL):
            self._signals[name] = IPCSignal(name, np.zeros(1, np.int32), suffix=self._suffix, create=True)
        self._create_caches()

    def _create_caches(self) -> None:
        self._caches = DeviceCaches(self.platform, self.spec, self.tp, self.device_ids)
        for rank in range(self.tp):
            self._caches.create_rank(rank)
        self._set_generation(new_generation(self._last_generation))
        for rank in range(self.tp):
            self._signals[CACHE_READY_SIGNAL].value[rank] = 1

    def free_caches(self) -> None:
        """Free every rank's device caches (the ranks have detached; the signals stay).  Everything
        derived from them hears ``NO_GENERATION`` first."""
        self.retire_generation()
        if self._caches is not None:
            self._caches.close()

    # ------------------------------------------------------------------ generations
    @property
    def generation(self) -> int:
        """The generation of the caches now attached; ``NO_GENERATION`` while there are none."""
        return self._generation

    def retire_generation(self) -> None:
        """The caches are about to be replaced: nothing derived from them may move or count a byte
        from now on (their watchers hear ``NO_GENERATION``).  Idempotent."""
        self._set_generation(NO_GENERATION)

    def watch_generation(self, watcher: Callable[[int], None]) -> Callable[[], None]:
        """Call ``watcher(generation)`` now and at every change; returns the call that stops it."""
        self._watchers.append(watcher)
        watcher(self._generation)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    def _set_generation(self, generation: int) -> None:
        if generation == self._generation:
            return
        self._generation = generation
        if generation != NO_GENERATION:
            self._last_generation = generation
        for watcher in list(self._watchers):
            try:
                watcher(generation)
            except Exception:  # one watcher's failure must not keep the memory from being freed
                logger.exception("a cache-generation watcher failed")

    def recreate_caches(self) -> None:
        """Free the caches if still there, allocate and export them anew, set ``cache_ready`` on every rank."""
        self.free_caches()
        self._create_caches()

    def close(self) -> None:
        """Free the caches and unlink every signal.  Idempotent."""
        self.free_caches()
        for sig in self._signals.values():
            sig.clear()
        self._signals.clear()

    # ------------------------------------------------------------------ inspection
    @property
    def caches(self) -> DeviceCaches | None:
        """The engine's device caches (``tensors[rank][kind][layer]``); None before ``create``."""
        return self._caches

    @property
    def signals(self) -> Mapping[str, IPCSignal]:
        """Every IPC signal by name, read-only (set them through the methods)."""
        return MappingProxyType(self._signals)

    # ------------------------------------------------------------------ signals
    def beat(self) -> None:
        """The heartbeat: ``worker_healthy_live_signal`` = now, in epoch seconds."""
        self._signals[WORKER_HEALTHY_LIVE_SIGNAL].value[0] = int(time.time())

    def kv_cache_status(self) -> KVCacheStatus:
        return KVCacheStatus(int(self._signals[KV_CACHE_STATUS_SIGNAL].value[0]))

    def set_kv_cache_status(self, status: KVCacheStatus) -> None:
        self._signals[KV_CACHE_STATUS_SIGNAL].value[0] = int(status)

    def rank_flags(self, name: str) -> list[int]:
        """One per-rank signal's values, by rank."""
        return [int(v) for v in self._signals[name].value[:self.tp]]

    def rank_serving(self, rank: int) -> bool:
        """The rank says it serves: ``cache_transfer_inited``; or, during an RL clear, it has
        cleared itself (``cache_transfer_inited`` and ``cache_ready`` back to 0, which a rank
        started while clearing does within a millisecond of its start)."""
        if self._signals[CACHE_TRANSFER_INITED_SIGNAL].value[rank] == 1:
            return True
        clearing = self.kv_cache_status() in (KVCacheStatus.CLEARING, KVCacheStatus.CLEARED)
        return clearing and self._signals[CACHE_READY_SIGNAL].value[rank] == 0

    def reset_rank(self, rank: int) -> None:
        """A rank is being replaced: its swap space and transfer readiness start over."""
        for name in (SWAP_SPACE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL):
            self._signals[name].value[rank] = 0

    # ------------------------------------------------------------------ model version
    @property
    def model_version(self) -> str:
        return self._model_version

    def reread_model_version(self) -> str:
        """Adopt the storage key prefix of ``<model_id>/version.yaml`` (FastDeploy's), as the ranks
        do on an RL restore; returns it."""
        self._model_version = key_prefix_from_version(self.model_id)
        return self._model_version

    def namespace(self) -> Namespace:
        """The storage namespace the CTMs key their objects under."""
        return self.spec.storage_namespace(self.model_id, self._model_version, self.tp)
