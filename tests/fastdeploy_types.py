"""FastDeploy's own engine-side types, as its engine puts them on the cache queue (upstream
``develop``, 2026-05), for the tests that drive our façade exactly as FastDeploy does: its
``CacheStatus`` (a plain ``Enum``, not ours), its ``ReadStorageTask``/``WriteStorageTask``
(``fastdeploy/cache_manager/cache_tasks.py``) and its ``ControlRequest``
(``fastdeploy/engine/request.py``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FDCacheStatus(enum.Enum):
    CTRL = -1
    SWAP2CPU = 1
    SWAP2GPU = 2
    GPU2STORAGE = 4
    STORAGE2GPU = 5


@dataclass(frozen=True, kw_only=True)
class FDWriteStorageTask:
    task_id: str
    keys: list
    token_ids: list | None
    gpu_block_ids: list
    timeout: float = 30.0


@dataclass(frozen=True, kw_only=True)
class FDReadStorageTask:  # keys[i] loads into gpu_block_ids[i]; start_read_block_idx: where keys[0] sits
    task_id: str
    keys: list
    token_ids: list | None
    gpu_block_ids: list
    start_read_block_idx: int
    timeout: float = 30.0


@dataclass
class FDControlRequest:
    request_id: str
    method: str
    args: dict = field(default_factory=dict)
