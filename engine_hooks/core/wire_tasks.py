"""The service's tasks as the ranks receive them (DESIGN §3.3): built from the engine's arguments,
which are checked here, so a bad argument raises ``ValueError`` before anything is sent."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from cache_manager.cache_data import CacheStatus
from ops.layout import plain_int_list
from transfer_factory.keys import salted_hashes


def block_ids(ids: Any, what: str) -> list[int]:
    """Block ids as plain ints for the wire; a float or other non-integer is refused here."""
    if plain_int_list(ids):
        return list(ids)
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integers, got dtype {ids.dtype}")
        return ids.astype(np.int64).tolist()
    out = []
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{what}: block id {v!r} is not an integer")
        out.append(int(v))
    return out


def swap_task(event: CacheStatus, gpu_block_ids: Any, cpu_block_ids: Any, swap_node_ids: Any,
              state_slots: Any = None, device_slots: int = 0, host_slots: int = 0) -> dict:
    """A SWAP2CPU or SWAP2GPU task; ``state_slots``: (device slot, host state slot) of the request's
    state, checked against the layout's ``device_slots`` and the ranks' ``host_slots``."""
    nodes = block_ids(swap_node_ids if swap_node_ids is not None else [], "swap_node_ids")
    task = {"event_type": int(event), "swap_node_ids": nodes, "gpu_block_ids": block_ids(gpu_block_ids, "gpu_block_ids"),
            "cpu_block_ids": block_ids(cpu_block_ids, "cpu_block_ids")}
    if state_slots is not None:
        if not isinstance(state_slots, (list, tuple)) or len(state_slots) != 2:
            raise ValueError(f"state_slots {state_slots!r:.60} must be (device slot, host state slot)")
        if not host_slots:
            raise ValueError("state_slots: the CTMs have no host state slots (num_cpu_state_slots 0)")
        task["state_slots"] = [state_slot(state_slots[0], device_slots, "state_slots[0]"),
                               state_slot(state_slots[1], host_slots, "state_slots[1] (a host state slot)")]
    return task


def state_slot(slot: Any, slots: int, what: str = "state_slot") -> int:
    """A request's slot of the cache layout's state groups (``slots`` of them; 0: none)."""
    if not slots:
        raise ValueError(f"{what} {slot!r}: this cache layout has no state group")
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < slots:
        raise ValueError(f"{what} {slot!r} must be an integer in [0, {slots})")
    return int(slot)


def storage_task(event: CacheStatus, keys: Sequence[str], gpu_block_ids: Any, token_ids: Sequence[int] | None,
                 timeout: float, start_read_block_idx: int | None = None, state_slot: int | None = None,
                 cache_salt: str | None = None) -> dict:
    """A GPU2STORAGE task, or (with ``start_read_block_idx``) a STORAGE2GPU one; ``timeout`` is the
    ranks' own, past which they answer with 0 blocks.  ``state_slot`` (checked by the caller): the
    request's state, stored with the write's last block, loaded with the read run's last.
    ``cache_salt``: the tenant's salt; the keys sent are the salted hashes (``keys.salted_hashes``),
    so every storage key of a salted request differs from every other tenant's."""
    if start_read_block_idx is not None and (not isinstance(start_read_block_idx, int) or start_read_block_idx < 0):
        raise ValueError(f"start_read_block_idx {start_read_block_idx!r} must be a non-negative integer")
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise ValueError("keys must be a list of block-hash strings")
    task = {"event_type": int(event), "keys": salted_hashes(keys, cache_salt), "gpu_block_ids": block_ids(gpu_block_ids, "gpu_block_ids"),
            "token_ids": block_ids(token_ids or [], "token_ids"), "timeout": timeout}
    if start_read_block_idx is not None:
        task["start_read_block_idx"] = start_read_block_idx
    if state_slot is not None:
        task["state_slot"] = state_slot
    return task
