"""Cache states, task kinds and the names the engine and the CTMs agree on."""
from __future__ import annotations

import os
from enum import IntEnum
from typing import Mapping


class CacheStatus(IntEnum):
    """Where a block is, or which way a task moves it (FastDeploy's values)."""

    CTRL = -1
    GPU = 0
    SWAP2CPU = 1
    SWAP2GPU = 2
    CPU = 3
    GPU2STORAGE = 4
    STORAGE2GPU = 5
    # Ours, not FastDeploy's: a decode rank reads a prefill instance's blocks (DESIGN §3.11).
    PEER_PULL = 20
    PEER_PUSH = 21  # a prefill rank writes blocks into a decode instance's reserved blocks, layer by layer


class KVCacheStatus(IntEnum):
    """Values of the ``kv_cache_status`` signal."""

    NORMAL = 0
    UPDATING = 1
    CLEARING = -1
    CLEARED = -2


def cache_name(kind: str, layer: int, rank: int, device_id: int) -> str:
    """FastDeploy's IPC name of one layer's cache tensor, e.g. ``key_caches_3_rank1.device1``.

    ``kind`` is one of ``key_caches``, ``value_caches``, ``key_cache_scales``, ``value_cache_scales``.
    """
    return f"{kind}_{layer}_rank{rank}.device{device_id}"


# Signal names (DESIGN §3.5); the suffix is the engine_worker_queue_port.
CACHE_READY_SIGNAL = "cache_ready_signal"
SWAP_SPACE_READY_SIGNAL = "swap_space_ready_signal"
CACHE_TRANSFER_INITED_SIGNAL = "cache_transfer_inited_signal"
WORKER_HEALTHY_LIVE_SIGNAL = "worker_healthy_live_signal"
KV_CACHE_STATUS_SIGNAL = "kv_cache_status"
PER_RANK_SIGNALS = (CACHE_READY_SIGNAL, SWAP_SPACE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL)

# FastDeploy's control requests, ``(CacheStatus.CTRL, ControlRequest)``: the methods the CTMs serve.  On the
# wire a request is a control task whose command is ``ctrl_<method>`` (``cache_tasks.ControlTask``).
CONTROL_METHODS = ("pause", "resume", "update_weights", "sleep", "wakeup")
CONTROL_COMMAND_PREFIX = "ctrl_"
KV_CACHE_TAG = "kv_cache"  # a sleep/wakeup tag: the KV caches are released/re-created (FastDeploy's default tags
DEFAULT_SLEEP_TAGS = ("weight", KV_CACHE_TAG)  # are "weight,kv_cache")
# FastDeploy's PrefixCacheManager creates these; a CTM publishes its pause ([0]) and whether it has tasks in flight ([rank])
CACHE_TASK_IS_PAUSED_SIGNAL = "cache_task_is_paused"
CACHE_TASK_INFLIGHT_SIGNAL = "cache_task_inflight"

SWAP_CLEARING_ENV = "FD_ENABLE_SWAP_SPACE_CLEARING"


def swap_clearing(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FD_ENABLE_SWAP_SPACE_CLEARING`` is set in ``environ`` (a CTM's: this process's by
    default): a clear or a sleep then frees the swap space, and its contents are gone.  The engine
    asks the same of the environment it gives its CTMs."""
    env = os.environ if environ is None else environ
    return env.get(SWAP_CLEARING_ENV, "").strip().lower() in ("1", "true", "yes", "on")
