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
3. closes its storage mover and backend (the namespace changes with the weights), off the serve
   thread: it waits, polling, up to ``STORAGE_CLOSE_WAIT`` for backend calls that outlived their
   tasks (the backend is never closed under a running call: it closes once they return), then
   goes on, logging and counting (``late_storage_calls``) those still running.  None of them can
   store an object: a write that could kept its task active (``Outcome.still_storing``) and held
   the drain of step 2, and the others' commit leases are revoked (DESIGN §3.8);
4. frees its host swap space when ``FD_ENABLE_SWAP_SPACE_CLEARING`` is set
   (``swap_space_ready_signal[rank] = 0``);
5. detaches every device cache and sets ``cache_ready_signal[rank] = 0`` and
   ``cache_transfer_inited_signal[rank] = 0``;
6. arrives at the ranks' CLEARED barrier (``lockstep``): once every rank has detached, every rank
   sets CLEARED (idempotent); a barrier that times out sets nothing on any rank, logs the ranks
   still missing, and the rank arrives at the next one.

**CLEARED**: every task fails at once with a clear error.

**UPDATING** (each cleared rank): waits, bounded by ``--attach_timeout``, for the engine's
``cache_ready_signal[rank] = 1`` (the caches re-created), re-attaches them, rebuilds the swap
space (or re-plans the copies onto the kept one), re-reads the storage key prefix from
``<model_path>/version.yaml`` (FastDeploy maps ``RL-STEP12-<time>-<uuid>`` to ``RL-STEP12``) into
the namespace's model version, re-opens storage, and sets ``swap_space_ready`` and
``cache_transfer_inited``, then arrives at the ranks' NORMAL barrier: once every rank has restored
(a rank restarted meanwhile, attached at its start, arrives too), every rank sets NORMAL.  A rank
that fails to restore stays detached and the status stays UPDATING, so the engine's restore
times out naming it.  KV written under the old weights lives under the old namespace: it is never
served after the update.

The lifecycle drives the rank's ``RankResources`` through their methods only (and their storage
mover's ``begin_close``/``closed``/``calls_running``, to close it without blocking); it is given them,
the task scheduler, the rank's signals and the queue (for the barriers), never the CTM.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from cache_manager.cache_data import (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, KV_CACHE_STATUS_SIGNAL,
                                      SWAP_SPACE_READY_SIGNAL, KVCacheStatus)
from cache_manager.cache_data import swap_clearing
from cache_manager.rank.lockstep import BarrierQueue, StatusLockstep
from cache_manager.rank.resources import RankResources
from cache_manager.rank.signals import RankSignals

DRAIN_TIMEOUT = 60.0  # seconds of draining after which a rank logs the tasks that still hold its blocks
STORAGE_CLOSE_WAIT = 5.0  # seconds a clear waits for storage calls that outlived their tasks, then goes on
RESTORE_RETRY_PAUSE = 0.5  # seconds between a failed restore and the next try (the status stays UPDATING)
CLEARED_STEP, RESTORED_STEP = "cleared", "restored"  # the lock-step barriers' steps


def detach_rank(resources: RankResources, signals: RankSignals, rank: int) -> bool:
    """Let go of the engine's caches: close the storage mover (it reads them; bounded), free the host
    swap space when ``FD_ENABLE_SWAP_SPACE_CLEARING`` is set (else it is kept and re-planned onto the
    next caches), detach every cache, and say so (``cache_ready`` and ``cache_transfer_inited`` of
    ``rank`` to 0: the next attach waits for the engine's new ``cache_ready``).  Only once no task
    holds a block.  Returns whether the swap space was freed.  The RL clear and FastDeploy's sleep
    (``rank.control``) share it."""
    resources.close_storage()
    swap_freed = swap_clearing()
    if swap_freed:
        resources.free_swap()
        signals[SWAP_SPACE_READY_SIGNAL].value[rank] = 0
    resources.detach()
    signals[CACHE_TRANSFER_INITED_SIGNAL].value[rank] = 0
    signals[CACHE_READY_SIGNAL].value[rank] = 0
    return swap_freed


def reattach_rank(resources: RankResources, signals: RankSignals, rank: int, reread_version: bool) -> None:
    """Attach the engine's (new) caches once its ``cache_ready`` says they exist, rebuild the swap space
    (or re-plan the kept one), re-read the storage key prefix from ``<model_path>/version.yaml`` when
    ``reread_version``, re-open storage under that namespace, and set ``swap_space_ready`` and
    ``cache_transfer_inited``.  On failure the rank is left detached and the error raised."""
    try:
        resources.attach()
        resources.alloc_swap()
        if reread_version:
            resources.reload_model_version()
        resources.open_storage()
    except BaseException:
        resources.close_storage()
        resources.detach()
        raise
    signals[SWAP_SPACE_READY_SIGNAL].value[rank] = 1
    signals[CACHE_TRANSFER_INITED_SIGNAL].value[rank] = 1


class ActiveTasks(Protocol):
    def active(self) -> int: ...


class KvCacheLifecycle:
    def __init__(self, resources: RankResources, scheduler: ActiveTasks, signals: RankSignals, queue: BarrierQueue,
                 rank: int, log: logging.Logger, stop_event: threading.Event, barrier_timeout: float):
        self._resources = resources
        self._scheduler = scheduler
        self._signals = signals
        self._rank = rank
        self._log = log
        self._stop_event = stop_event
        self._lockstep = StatusLockstep(queue, rank, barrier_timeout, log, self._on_barrier_passed)
        self.cleared = False  # refusing tasks: a clear began and no restore ended it
        self.detached = False  # the caches are detached (a clear finished draining)
        self._drain_started = 0.0
        self._drain_overdue_logged = False
        self._swap_freed = False
        self._storage_closing_since: float | None = None
        self.late_storage_calls = 0  # backend calls still running when a clear went on without them

    # ------------------------------------------------------------------ state
    def status(self) -> int:
        sig = self._signals.get(KV_CACHE_STATUS_SIGNAL)
        return int(sig.value[0]) if sig is not None else int(KVCacheStatus.NORMAL)

    def refusal(self) -> str | None:
        """Why a task cannot run now, or None while the caches are attached and normal."""
        status = self.status()
        if self.cleared or status == KVCacheStatus.CLEARED:  # tasks received before the clear began drain
            name = next((m.name for m in KVCacheStatus if m == status), str(status))
            return (f"kv caches of rank {self._rank} are cleared for a weight update (kv_cache_status {name}); "
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
        if status == KVCacheStatus.UPDATING and self.detached:
            self._restore()
        if status == KVCacheStatus.CLEARING and self.detached:
            self._lockstep.request(CLEARED_STEP)
        elif status == KVCacheStatus.UPDATING and not self.cleared:
            self._lockstep.request(RESTORED_STEP)
        elif self._lockstep.waiting_for is not None:
            self._lockstep.cancel()  # the status moved on without this rank's barrier

    def close(self) -> None:
        """Stop arriving at barriers (a wait in progress ends when the queue closes: then ``join``)."""
        self._lockstep.stop()

    def join(self) -> None:
        self._lockstep.join()

    def _on_barrier_passed(self, step: str) -> None:
        """Every rank reached ``step``: move the status on, unless the engine or another rank did."""
        expected, new = ((KVCacheStatus.CLEARING, KVCacheStatus.CLEARED) if step == CLEARED_STEP
                         else (KVCacheStatus.UPDATING, KVCacheStatus.NORMAL))
        sig = self._signals[KV_CACHE_STATUS_SIGNAL]
        if int(sig.value[0]) == expected:
            sig.value[0] = int(new)
            self._log.info("[RL] kv_cache_status -> %s", new.name)

    # ------------------------------------------------------------------ clear
    def _begin_clear(self) -> None:
        self._log.info("[RL] clearing caches: refusing new tasks, draining %d in flight", self._scheduler.active())
        self.cleared = True  # refusal() answers every task from here on
        self._drain_started = time.monotonic()
        self._drain_overdue_logged = False
        self._storage_closing_since = None

    def _finish_clear_when_drained(self) -> None:
        """Detach once no task holds a block.  A task whose I/O outlived its deadline still holds
        its blocks (it may yet write them): the caches stay attached, however long that takes, so
        the engine never frees memory an I/O can still touch.  The engine's clear fails at its
        own timeout naming this rank; restarting the rank ends the I/O."""
        held = self._scheduler.active()
        if held:
            if not self._drain_overdue_logged and time.monotonic() - self._drain_started > DRAIN_TIMEOUT:
                self._drain_overdue_logged = True
                self._log.error("[RL] %d tasks still hold their blocks after %.0fs; the caches stay attached until "
                                "they release them (restart this rank to end their I/O)", held, DRAIN_TIMEOUT)
            return
        if not self._storage_closed():
            return
        # the namespace changes with the weights (the storage close began: no wait there)
        self._swap_freed = detach_rank(self._resources, self._signals, self._rank)
        self.detached = True
        self._log.info("[RL] rank %d cleared: caches detached%s", self._rank,
                       ", swap space freed" if self._swap_freed else "")

    def _storage_closed(self) -> bool:
        """Begins closing the storage mover without waiting, and says whether the clear may go on:
        every backend call has returned and the backend is closed, or ``STORAGE_CLOSE_WAIT`` is over
        (then those still running are counted and logged; they store nothing, and the old backend
        closes when they return).  Polled from ``step``, so the serve thread never blocks on I/O."""
        storage = getattr(self._resources, "storage", None)
        if storage is None or not hasattr(storage, "begin_close"):
            return True
        if self._storage_closing_since is None:
            storage.begin_close()
            self._storage_closing_since = time.monotonic()
        if storage.closed():
            return True
        if time.monotonic() - self._storage_closing_since < STORAGE_CLOSE_WAIT:
            return False
        running = storage.calls_running()
        self.late_storage_calls += running
        self._log.error("[RL] %d storage calls still running %.0fs into the clear; it goes on without them: they "
                        "store nothing (their tasks answered, their leases are revoked), and the old backend closes "
                        "when they return", running, STORAGE_CLOSE_WAIT)
        return True

    # ------------------------------------------------------------------ restore
    def _restore(self) -> None:
        rank, resources = self._rank, self._resources
        self._log.info("[RL] restoring caches: waiting for cache_ready_signal")
        try:
            resources.wait_cache_ready()
            reattach_rank(resources, self._signals, rank, reread_version=True)
        except Exception:
            self._log.exception("[RL] rank %d failed to restore its caches; it stays cleared", rank)
            self._stop_event.wait(RESTORE_RETRY_PAUSE)  # the status stays UPDATING; the engine's restore names this rank
            return
        self.cleared, self.detached, self._swap_freed = False, False, False
        self._log.info("[RL] rank %d restored (namespace %s)", rank, resources.namespace())
