"""RL weight updates on one CTM rank: the ``kv_cache_status`` protocol (DESIGN §3.9).

FastDeploy's RL flow changes the weights in place.  While it does, the engine frees its KV
memory, and afterwards any KV computed with the old weights is wrong.  The engine drives
the ranks through the shared ``kv_cache_status`` signal (NORMAL 0, UPDATING 1, CLEARING -1,
CLEARED -2); the serve loop calls ``step()`` every iteration.

**CLEARING** (each rank, once):

1. stops taking tasks: every task received from now on fails at once, naming the status (the
   engine refuses new ones itself once it has set CLEARING);
2. waits for the tasks it has in flight to finish (each has a deadline; a late storage I/O is
   waited for, bounded by ``DRAIN_TIMEOUT``), so every future resolves and none hangs;
3. closes its storage mover and backend (the namespace changes with the weights);
4. frees its host swap space when ``FD_ENABLE_SWAP_SPACE_CLEARING`` is set
   (``swap_space_ready_signal[rank] = 0``);
5. detaches every device cache and sets ``cache_ready_signal[rank] = 0`` and
   ``cache_transfer_inited_signal[rank] = 0``;
6. once every rank's ``cache_ready_signal`` is 0, sets CLEARED (any rank may; it is idempotent).

**CLEARED**: every task fails at once with a clear error.

**UPDATING** (each cleared rank): waits, bounded by ``--attach_timeout``, for the engine's
``cache_ready_signal[rank] = 1`` (the caches re-created), re-attaches them, rebuilds the swap
space (or re-plans the copies onto the kept one), re-reads the storage key prefix from
``<model_path>/version.yaml`` (FastDeploy maps ``RL-STEP12-<time>-<uuid>`` to ``RL-STEP12``) into
the namespace's model version, re-opens storage, and sets ``swap_space_ready`` and
``cache_transfer_inited``.  Once every rank is inited it sets NORMAL.  KV written under the old
weights lives under the old namespace: it is never served after the update.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np

from cache_manager.cache_spec import key_prefix_from_version
from cache_manager.cache_data import (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, KV_CACHE_STATUS_SIGNAL,
                         SWAP_SPACE_READY_SIGNAL, KVCacheStatus, cache_name)

if TYPE_CHECKING:
    from cache_manager.cache_transfer_manager import CacheTransferManager

SWAP_CLEARING_ENV = "FD_ENABLE_SWAP_SPACE_CLEARING"
DRAIN_TIMEOUT = 60.0  # seconds of draining after which a rank logs the tasks that still hold its blocks


def _enabled(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class KvCacheLifecycle:
    def __init__(self, ctm: "CacheTransferManager"):
        self.ctm = ctm
        self.cleared = False  # refusing tasks: a clear began and no restore ended it
        self.detached = False  # the caches are detached (a clear finished draining)
        self._drain_started = 0.0
        self._drain_overdue_logged = False
        self._swap_freed = False
        self._kept_host: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ state
    def status(self) -> int:
        sig = self.ctm.signals.get(KV_CACHE_STATUS_SIGNAL)
        return int(sig.value[0]) if sig is not None else int(KVCacheStatus.NORMAL)

    def refusal(self) -> str | None:
        """Why a task cannot run now, or None while the caches are attached and normal."""
        status = self.status()
        if self.cleared or status == KVCacheStatus.CLEARED:  # tasks received before the clear began drain
            name = next((m.name for m in KVCacheStatus if m == status), str(status))
            return (f"kv caches of rank {self.ctm.rank} are cleared for a weight update (kv_cache_status {name}); "
                    f"restore them first")
        return None

    @property
    def draining(self) -> bool:
        """A clear began and waits for the rank's tasks to release their blocks."""
        return self.cleared and not self.detached

    def step(self) -> None:
        status = self.status()
        if status == KVCacheStatus.CLEARING and not self.cleared:
            self._begin_clear()
        if self.draining and status == KVCacheStatus.CLEARING:
            self._finish_clear_when_drained()
        if self.detached and status == KVCacheStatus.CLEARING and self._all(CACHE_READY_SIGNAL, 0):
            self._set_status(KVCacheStatus.CLEARED)
        if status == KVCacheStatus.UPDATING and self.detached:
            self._restore()
        if status == KVCacheStatus.UPDATING and not self.cleared and self._all(CACHE_TRANSFER_INITED_SIGNAL, 1):
            self._set_status(KVCacheStatus.NORMAL)

    def _all(self, name: str, value: int) -> bool:
        return bool(np.all(self.ctm.signals[name].value == value))

    def _set_status(self, status: KVCacheStatus) -> None:
        sig = self.ctm.signals[KV_CACHE_STATUS_SIGNAL]
        if int(sig.value[0]) != status:
            sig.value[0] = int(status)
            self.ctm.log.info("[RL] kv_cache_status -> %s", status.name)

    # ------------------------------------------------------------------ clear
    def _begin_clear(self) -> None:
        self.ctm.log.info("[RL] clearing caches: refusing new tasks, draining %d in flight", self.ctm.scheduler.active())
        self.cleared = True  # refusal() answers every task from here on
        self._drain_started = time.monotonic()
        self._drain_overdue_logged = False

    def _finish_clear_when_drained(self) -> None:
        """Detach once no task holds a block.  A task whose I/O outlived its deadline still holds
        its blocks (it may yet write them): the caches stay attached, however long that takes, so
        the engine never frees memory an I/O can still touch.  The engine's clear fails at its
        own timeout naming this rank; restarting the rank ends the I/O."""
        ctm, log = self.ctm, self.ctm.log
        if ctm.scheduler.active():
            if not self._drain_overdue_logged and time.monotonic() - self._drain_started > DRAIN_TIMEOUT:
                self._drain_overdue_logged = True
                log.error("[RL] %d tasks still hold their blocks after %.0fs; the caches stay attached until "
                          "they release them (restart this rank to end their I/O)", ctm.scheduler.active(),
                          DRAIN_TIMEOUT)
            return
        if ctm.storage is not None:
            ctm.storage.close()
            ctm.storage = None
        rank = ctm.rank
        if _enabled(SWAP_CLEARING_ENV):
            for g in ctm.groups:
                for ptr in g.host_ptrs:
                    ctm.platform.host_free(ptr)
            self._swap_freed = True
            self._kept_host = {}
            ctm.signals[SWAP_SPACE_READY_SIGNAL].value[rank] = 0
        else:
            self._kept_host = {g.kind: g.host_ptrs for g in ctm.groups}
        self._detach()
        self.detached = True
        ctm.signals[CACHE_TRANSFER_INITED_SIGNAL].value[rank] = 0
        ctm.signals[CACHE_READY_SIGNAL].value[rank] = 0
        log.info("[RL] rank %d cleared: caches detached%s", rank, ", swap space freed" if self._swap_freed else "")

    def _detach(self) -> None:
        ctm = self.ctm
        for g in ctm.groups:
            for layer, t in enumerate(g.tensors):
                ctm.platform.unset_data_ipc(t, cache_name(g.kind, layer, ctm.rank, ctm.args.device_id), True, False)
        ctm.groups = []

    # ------------------------------------------------------------------ restore
    def _restore(self) -> None:
        ctm, log, rank = self.ctm, self.ctm.log, self.ctm.rank
        log.info("[RL] restoring caches: waiting for cache_ready_signal")
        try:
            ctm._wait_cache_ready()
            ctm._attach_caches()
            if self._swap_freed:
                ctm._alloc_swap_space()
            else:
                n = ctm.args.num_cpu_blocks
                for g in ctm.groups:
                    g.host_ptrs = self._kept_host.get(g.kind, [])
                    if n and g.host_ptrs:
                        g.swap_plan = ctm.platform.plan_all_layers(g.tensors, g.host_ptrs, n)
            if ctm.args.kvcache_storage_backend != "none":
                ctm.args.model_version = key_prefix_from_version(ctm.args.model_path)
                log.info("[RL] storage key prefix (model version) is now %r", ctm.args.model_version)
                ctm._open_storage()
        except Exception:
            log.exception("[RL] rank %d failed to restore its caches; it stays cleared", rank)
            if ctm.storage is not None:
                ctm.storage.close()
                ctm.storage = None
            self._detach()
            ctm.stop_event.wait(0.5)  # the status stays UPDATING; the engine's restore names this rank
            return
        self.cleared, self.detached, self._swap_freed, self._kept_host = False, False, False, {}
        ctm.signals[SWAP_SPACE_READY_SIGNAL].value[rank] = 1
        ctm.signals[CACHE_TRANSFER_INITED_SIGNAL].value[rank] = 1
        log.info("[RL] rank %d restored (namespace %s)", rank, ctm.namespace())
