"""Tasks the engine sends to every rank, and the results each rank sends back.

On the wire every task and result is a plain dict of ints, strings and lists
(msgpack), never a pickled object.  ``task_from_wire`` checks the shape of what
arrives; a malformed task becomes an error result, not a crash.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .cache_data import CacheStatus

SWAP_EVENTS = (CacheStatus.SWAP2CPU, CacheStatus.SWAP2GPU)


class TaskFormatError(ValueError):
    """A task dict that does not have the fields its event type needs."""


@dataclass
class SwapTask:
    """Swap blocks between device and host: ``(event_type, task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)``."""

    event_type: int
    task_id: str
    swap_node_ids: list[int]
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]

    def result(self) -> tuple:
        return (self.event_type, self.task_id, self.swap_node_ids, self.gpu_block_ids, self.cpu_block_ids)


@dataclass
class ReadStorageTask:
    task_id: str
    keys: list[str]
    token_ids: list[int]
    gpu_block_ids: list[int]
    start_read_block_idx: int = 0
    timeout: float = 30.0
    event_type: int = int(CacheStatus.STORAGE2GPU)


@dataclass
class WriteStorageTask:
    task_id: str
    keys: list[str]
    token_ids: list[int]
    gpu_block_ids: list[int]
    timeout: float = 30.0
    event_type: int = int(CacheStatus.GPU2STORAGE)


@dataclass
class ControlTask:
    """Engine-to-CTM control (e.g. ``ping``), answered by every rank."""

    task_id: str
    command: str
    args: dict = field(default_factory=dict)
    event_type: int = int(CacheStatus.CTRL)


Task = SwapTask | ReadStorageTask | WriteStorageTask | ControlTask


def task_to_wire(task: Task) -> dict:
    return asdict(task)


def _int_list(d: dict, key: str) -> list[int]:
    value = d.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TaskFormatError(f"task field {key!r} must be a list of integers, got {value!r:.80}")
    return value


def _str(d: dict, key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str):
        raise TaskFormatError(f"task field {key!r} must be a string, got {value!r:.80}")
    return value


def task_from_wire(d: Any) -> Task:
    """Rebuild a task from its wire dict; raises ``TaskFormatError`` naming the bad field."""
    if not isinstance(d, dict):
        raise TaskFormatError(f"a task must be a map, got {type(d).__name__}")
    event = d.get("event_type")
    if not isinstance(event, int) or isinstance(event, bool):
        raise TaskFormatError(f"event_type {event!r} must be an integer")
    try:
        status = CacheStatus(event)
    except ValueError:
        raise TaskFormatError(f"unknown event type {event}") from None
    task_id = _str(d, "task_id")
    if status in SWAP_EVENTS:
        return SwapTask(event, task_id, _int_list(d, "swap_node_ids"), _int_list(d, "gpu_block_ids"),
                        _int_list(d, "cpu_block_ids"))
    if status == CacheStatus.CTRL:
        args = d.get("args", {})
        if not isinstance(args, dict):
            raise TaskFormatError("control task field 'args' must be a map")
        return ControlTask(task_id, _str(d, "command"), args)
    keys = d.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TaskFormatError("task field 'keys' must be a list of strings")
    timeout = d.get("timeout", 30.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise TaskFormatError(f"task timeout {timeout!r} must be a positive number")
    if status == CacheStatus.STORAGE2GPU:
        start = d.get("start_read_block_idx", 0)
        if not isinstance(start, int) or start < 0:
            raise TaskFormatError(f"start_read_block_idx {start!r} must be a non-negative integer")
        return ReadStorageTask(task_id, keys, _int_list(d, "token_ids"), _int_list(d, "gpu_block_ids"), start,
                               float(timeout))
    if status == CacheStatus.GPU2STORAGE:
        return WriteStorageTask(task_id, keys, _int_list(d, "token_ids"), _int_list(d, "gpu_block_ids"),
                                float(timeout))
    raise TaskFormatError(f"event type {status.name} ({event}) is not a task the CTM runs")


@dataclass
class RankResult:
    """One rank's answer to one task.  ``error`` is set exactly when ``ok`` is false."""

    task_id: str
    rank: int
    ok: bool
    value: Any = None  # per kind: None for swaps, loaded/written block ids for storage, anything for CTRL
    error: str | None = None
    recv_seq: int = -1  # the order in which this rank received the task
    elapsed_ms: float = 0.0
