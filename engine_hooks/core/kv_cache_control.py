"""The engine's side of the cache lifecycle: RL weight updates (``clear_caches`` and
``restore_caches``, DESIGN §3.9) and FastDeploy's sleep and wakeup (``sleep_caches`` and
``wakeup_caches``).  They are two faces of one lifecycle: both retire the caches' generation first
(``EngineResources.retire_generation``: peer links stop counting bytes of them, exposed handles are
retracted), let every rank drain and detach, free the memory, and later re-create it under a new
generation that the ranks attach.  The host-slot guard hears of swap space freed either way (the
engine core's ``swap_freed``).  They differ only in how the ranks are told: the ``kv_cache_status``
signal for an RL update, a control request for a sleep (FastDeploy's ``ctrl_sleep``/``ctrl_wakeup``,
answered by every rank).

``clear_caches`` sets ``kv_cache_status`` to CLEARING and waits, bounded, until every rank has
drained its tasks, detached its caches and the status reads CLEARED; then the engine frees its
device caches.  A rank that dies meanwhile fails the clear at once (``CacheUpdateError`` naming
it) instead of hanging it; restart it with ``restart_rank`` and clear again.  A rank whose task
still has an I/O that may touch its blocks (one that outlived its deadline) keeps its caches
attached until that I/O ends, however long: the clear times out naming it, and the engine's
memory is not freed.  Calling ``clear_caches`` again goes on waiting; ``restart_rank`` ends the
I/O with the process.

``restore_caches`` re-creates the device caches, sets ``cache_ready_signal`` for every rank,
re-reads the storage key prefix from ``<model_path>/version.yaml`` when storage is on, sets
UPDATING and waits, bounded, for NORMAL.  KV written under the old weights lives under the old
namespace and is never served again; the engine's prefix cache must forget its device and host
entries too (``TieredPrefixCache.forget_all()``).

While the status is not NORMAL, every task fails at once with ``CachesClearedError``.  Both
functions drive the caches, signals and model version through ``EngineResources``, and learn of
dead ranks through ``rank_failures`` (rank -> what happened to it, for the ranks found dead).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from cache_manager.cache_data import CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, KVCacheStatus

from .engine_resources import EngineResources
from .errors import CacheUpdateError

logger = logging.getLogger(__name__)
_TICK = 0.02

RankFailures = Callable[[], dict[int, str]]  # the ranks found dead -> the description of their failure


def _wait(resources: EngineResources, rank_failures: RankFailures, tp: int, want: KVCacheStatus, timeout: float,
          what: str, pending_signal: str) -> None:
    deadline = time.monotonic() + timeout
    while resources.kv_cache_status() != want:
        dead = rank_failures()
        if dead:
            first = min(dead)
            raise CacheUpdateError(f"{what} failed: rank(s) {sorted(dead)} died ({dead[first]})")
        if time.monotonic() > deadline:
            flags = resources.rank_flags(pending_signal)
            behind = [r for r in range(tp) if (flags[r] != 0 if want == KVCacheStatus.CLEARED else flags[r] != 1)]
            hint = ("; a rank keeps its caches attached while a task's I/O may still touch them: call "
                    "clear_caches again to wait on, or restart_rank to end that I/O"
                    if want == KVCacheStatus.CLEARED else "")
            raise CacheUpdateError(f"{what} timed out after {timeout:g}s (kv_cache_status "
                                   f"{resources.kv_cache_status().name}); ranks not done: {behind}{hint}")
        time.sleep(_TICK)


def clear_caches(resources: EngineResources, rank_failures: RankFailures, tp: int, timeout: float = 60.0) -> None:
    current = resources.kv_cache_status()
    if current not in (KVCacheStatus.NORMAL, KVCacheStatus.CLEARING, KVCacheStatus.CLEARED):
        raise CacheUpdateError(f"clear_caches needs kv_cache_status NORMAL (or CLEARING or CLEARED, to finish a "
                               f"clear that timed out), it is {current.name}")
    t0 = time.monotonic()
    resources.retire_generation()  # first: peer links stop counting bytes of these caches
    if current == KVCacheStatus.NORMAL:
        resources.set_kv_cache_status(KVCacheStatus.CLEARING)
    _wait(resources, rank_failures, tp, KVCacheStatus.CLEARED, timeout, "clear_caches", CACHE_READY_SIGNAL)
    resources.free_caches()  # every rank has detached: the engine frees its KV memory
    logger.info("[RL] caches cleared on %d ranks in %.2fs", tp, time.monotonic() - t0)


def restore_caches(resources: EngineResources, rank_failures: RankFailures, tp: int, timeout: float = 120.0,
                   reread_model_version: bool = False) -> None:
    """``reread_model_version``: storage is on, so the ranks adopt ``<model_path>/version.yaml``'s
    key prefix, and so does the engine."""
    current = resources.kv_cache_status()
    if current != KVCacheStatus.CLEARED:
        raise CacheUpdateError(f"restore_caches needs kv_cache_status CLEARED, it is {current.name}")
    t0 = time.monotonic()
    if reread_model_version:
        resources.reread_model_version()  # the namespace the ranks will use
    # every rank is detached (CLEARED); a clear that timed out at its end left the caches allocated
    resources.recreate_caches()
    resources.set_kv_cache_status(KVCacheStatus.UPDATING)
    _wait(resources, rank_failures, tp, KVCacheStatus.NORMAL, timeout, "restore_caches", CACHE_TRANSFER_INITED_SIGNAL)
    logger.info("[RL] caches restored on %d ranks in %.2fs (model version %r)", tp, time.monotonic() - t0,
                resources.model_version)


Control = Callable[[str, float], list]  # (command, timeout) -> every rank's answer; raises naming a failed rank
SLEEP_TAGS = ["kv_cache"]  # FastDeploy's sleep/wakeup tags, as far as the CTMs are concerned


def sleep_caches(resources: EngineResources, control: Control, timeout: float = 60.0) -> list:
    """FastDeploy's sleep: every rank drains and lets go of its caches, then the engine frees them.
    A rank that fails keeps the caches allocated (``CacheUpdateError`` naming it); sleep again, or
    restart the rank.  Returns every rank's answer."""
    current = resources.kv_cache_status()
    if current != KVCacheStatus.NORMAL:
        raise CacheUpdateError(f"sleep needs kv_cache_status NORMAL, it is {current.name}")
    resources.retire_generation()  # first: peer links stop counting bytes of these caches
    try:
        answers = control("ctrl_sleep", timeout)
    except Exception as exc:
        raise CacheUpdateError(f"sleep failed; the caches stay allocated: {exc}") from exc
    resources.free_caches()
    logger.info("[sleep] caches released on every rank")
    return answers


def wakeup_caches(resources: EngineResources, control: Control, timeout: float = 120.0,
                  reread_model_version: bool = False) -> list:
    """FastDeploy's wakeup: the engine creates new caches (a new generation), every rank attaches
    them.  ``reread_model_version``: adopt ``<model_path>/version.yaml``'s prefix, as the ranks do
    when the file is there."""
    if reread_model_version:
        resources.reread_model_version()
    resources.recreate_caches()
    try:
        answers = control("ctrl_wakeup", timeout)
    except Exception as exc:
        raise CacheUpdateError(f"wakeup failed: {exc}") from exc
    logger.info("[wakeup] every rank attached the new caches (model version %r)", resources.model_version)
    return answers
