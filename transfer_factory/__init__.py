"""Storage backends behind one KVCacheStorage interface (DESIGN §2, §3.7).

``create_storage_backend(name, namespace=..., rank=..., options=...)`` picks a backend by
name; an unknown name, or a backend whose SDK is missing, fails at once with a message.
"""
from __future__ import annotations

import importlib
from typing import Any

from .kvcache_storage import KVCacheStorage, StorageAccess, StorageConfigError

_BACKENDS = {
    "file": "transfer_factory.file_store:FileStore",
    "mooncake": "transfer_factory.mooncake_store:MooncakeStore",
}
# Accepted by the CTM's --kvcache_storage_backend for FastDeploy compatibility; their vendor
# SDKs cannot be installed here, so asking for them fails with this reason.
_UNAVAILABLE = {
    "attention_store": "the AttentionStore SDK is not installed on this host",
    "ems": "the Huawei EMS SDK is not installed on this host",
}
BACKEND_NAMES = tuple(_BACKENDS) + tuple(_UNAVAILABLE)


def create_storage_backend(name: str, *, namespace: str, rank: int, options: dict[str, Any] | None = None) -> KVCacheStorage:
    if name in _UNAVAILABLE:
        raise StorageConfigError(f"storage backend {name!r} is unavailable: {_UNAVAILABLE[name]}")
    if name not in _BACKENDS:
        raise StorageConfigError(f"unknown storage backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(namespace=namespace, rank=rank, options=options or {})


__all__ = ["BACKEND_NAMES", "KVCacheStorage", "StorageAccess", "StorageConfigError", "create_storage_backend"]
