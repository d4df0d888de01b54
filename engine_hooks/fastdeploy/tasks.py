"""FastDeploy's transfer tasks, as its engine puts them, checked and turned into our wire tasks.

A swap is ``(event_type, transfer_task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)``; a storage
task ``(STORAGE2GPU, ReadStorageTask)`` / ``(GPU2STORAGE, WriteStorageTask)`` (FastDeploy's or ours),
or FastDeploy's older ``(event_type, task_id, keys, gpu_block_ids, timeout)``; a control request
``(CTRL, ControlRequest)`` (``engine_hooks.fastdeploy.control``).  The engine's own event member, ids and keys are
kept in an ``Entry`` to report the done signal (or the control response) with.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import ReadStorageTask as OurReadStorageTask

from .control import is_control_item, parse_control_request

SWAPS = (int(CacheStatus.SWAP2CPU), int(CacheStatus.SWAP2GPU))
STORAGE = (int(CacheStatus.GPU2STORAGE), int(CacheStatus.STORAGE2GPU))


def _event(value: Any, where: str) -> tuple[int, Any]:
    """(the event's int, the object to report it with): an enum member is kept, an int becomes ours."""
    raw = value.value if isinstance(value, enum.Enum) else value
    if isinstance(raw, bool) or not isinstance(raw, (int, np.integer)) or int(raw) not in SWAPS + STORAGE:
        raise ValueError(f"{where}: event_type {value!r} is not SWAP2CPU, SWAP2GPU, GPU2STORAGE or STORAGE2GPU "
                         "(nor CTRL with a control request: (CTRL, ControlRequest))")
    return int(raw), value if isinstance(value, enum.Enum) else CacheStatus(int(raw))


def _ids(value: Any, what: str) -> list[int]:
    value = value.tolist() if isinstance(value, np.ndarray) else value
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list of block ids, got {type(value).__name__}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{what}: {v!r} is not a non-negative integer")
        out.append(int(v))
    return out


def _task_id(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError(f"{what} {value!r} must be a non-empty string or an integer")
    return str(value)


@dataclass
class Entry:
    """What the engine gave, to build its done signal from."""

    task_id: Any
    event: Any
    kind: str  # "swap", "read", "write", "control"
    report: tuple  # swap: (swap_node_ids, gpu, cpu); storage: (keys,); control: (ControlCall,)
    cleared: bool = False  # forgotten (clear_transfer_task or close): no done signal is delivered

    def forget(self) -> None:
        self.cleared = True


ParsedTask = tuple[dict, Entry, float, float]  # (wire task, entry, timeout, grace)


def parse_transfer_task(item: Any, task_timeout: float, storage_grace: float,
                        control_timeout: float = 60.0) -> ParsedTask:
    """FastDeploy's transfer task ``item`` as (wire task, entry, timeout, grace); ``ValueError`` names
    what is wrong with a malformed one (``control.ControlRefused`` for a control request
    that is answered at once)."""
    if is_control_item(item):
        call = parse_control_request(item[1])
        return call.wire_task(), Entry(call.request_id, item[0], "control", (call,)), control_timeout, 0.0
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 5):
        raise ValueError(f"a transfer task is a 5-tuple (swap, or legacy storage) or a 2-tuple "
                         f"(event_type, storage task), got {type(item).__name__} of length "
                         f"{len(item) if isinstance(item, (tuple, list)) else '-'}")
    event, report_event = _event(item[0], "transfer task")
    if len(item) == 5 and event in SWAPS:
        _, tid, nodes, gpu, cpu = item
        gpu, cpu = _ids(gpu, "gpu_block_ids"), _ids(cpu, "cpu_block_ids")
        if len(gpu) != len(cpu):
            raise ValueError(f"swap task: {len(gpu)} gpu_block_ids but {len(cpu)} cpu_block_ids")
        if not isinstance(nodes, (list, tuple, np.ndarray)):
            raise ValueError(f"swap_node_ids must be a list, got {type(nodes).__name__}")
        nodes = list(nodes)  # opaque to the CTMs (FastDeploy's may hold None): echoed from here
        wire_task = {"event_type": event, "task_id": _task_id(tid, "transfer_task_id"), "swap_node_ids": [],
                     "gpu_block_ids": gpu, "cpu_block_ids": cpu}
        return wire_task, Entry(tid, report_event, "swap", (nodes, gpu, cpu)), task_timeout, 0.0
    if len(item) == 5:  # FastDeploy before ReadStorageTask: (event, task_id, keys, gpu_block_ids, timeout)
        _, tid, keys, gpu, timeout = item
        fields = {"task_id": tid, "keys": keys, "token_ids": None, "gpu_block_ids": gpu, "timeout": timeout,
                  "start_read_block_idx": 0}
    elif event in STORAGE:
        names = ("task_id", "keys", "token_ids", "gpu_block_ids", "timeout") + \
            (("start_read_block_idx",) if event == CacheStatus.STORAGE2GPU else ())
        missing = [n for n in names if not hasattr(item[1], n)]
        if missing:
            raise ValueError(f"storage task {type(item[1]).__name__} has no attribute(s) {missing}")
        fields = {n: getattr(item[1], n) for n in names}
    else:
        raise ValueError(f"a swap task is a 5-tuple (event_type, transfer_task_id, swap_node_ids, "
                         f"gpu_block_ids, cpu_block_ids), got a {len(item)}-tuple")
    return _storage(event, report_event, fields, isinstance(item[1], OurReadStorageTask), storage_grace)

def _storage(event: int, report_event: Any, f: dict, ours: bool, storage_grace: float) -> ParsedTask:
    keys = f["keys"]
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError("storage task keys must be a list of non-empty strings (block hashes)")
    keys = list(keys)
    gpu = _ids(f["gpu_block_ids"], "gpu_block_ids")
    tokens = _ids(f["token_ids"] if f["token_ids"] is not None else [], "token_ids")
    timeout = f["timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise ValueError(f"storage task timeout {timeout!r} must be a positive number of seconds")
    wire_task = {"event_type": event, "task_id": _task_id(f["task_id"], "task_id"), "token_ids": tokens,
                 "timeout": float(timeout)}
    if event == CacheStatus.GPU2STORAGE:
        if len(keys) != len(gpu):
            raise ValueError(f"write task: {len(keys)} keys but {len(gpu)} gpu_block_ids")
        wire_task.update(keys=keys, gpu_block_ids=gpu)
    else:
        start = f["start_read_block_idx"]
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start_read_block_idx {start!r} must be a non-negative integer")
        if ours:  # our ReadStorageTask: keys is the whole chain, loaded from keys[start:]
            if len(gpu) != len(keys) - start:
                raise ValueError(f"read task: {len(keys) - start} keys from {start} on, {len(gpu)} gpu_block_ids")
            wire_task.update(keys=keys, gpu_block_ids=gpu, start_read_block_idx=start)
        else:  # FastDeploy's: keys[i] loads into gpu_block_ids[i] (which may hold one more, a partial
            # block); start is where keys[0] sits in the request, for token-addressed stores.
            if len(gpu) < len(keys):
                raise ValueError(f"read task: {len(keys)} keys but only {len(gpu)} gpu_block_ids")
            wire_task.update(keys=[""] * start + keys, gpu_block_ids=gpu[:len(keys)], start_read_block_idx=start)
    kind = "read" if event == CacheStatus.STORAGE2GPU else "write"
    return wire_task, Entry(f["task_id"], report_event, kind, (keys,)), float(timeout), storage_grace
