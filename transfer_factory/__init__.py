"""Storage backends behind one KVCacheStorage interface (DESIGN §2, §3.7).

``create_storage_backend(name, namespace=..., rank=..., options=...)`` picks a backend by
name; an unknown name, or a backend whose SDK is missing, fails at once with a message naming
the missing module.  Object stores (``file``, ``mooncake``) are ``KVCacheStorage``s; backends
that move device blocks themselves (``ems``, ``attention_store``) are ``DeviceKVStorage``s.
More backends plug in without touching this package: ``CTM_STORAGE_PLUGINS`` lists
``name=module:Class`` pairs (comma-separated), each a ``KVCacheStorage`` taking the same
keyword arguments; the CTM's ``--kvcache_storage_backend`` then accepts those names too.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

from transfer_factory.device_storage import Addressing, BlockSpan, DeviceKVStorage, RankCaches
from transfer_factory.kvcache_storage import KVCacheStorage, StorageAccess, StorageConfigError

_BACKENDS = {
    "file": "transfer_factory.file.store:FileStore",
    "mooncake": "transfer_factory.mooncake.store:MooncakeStore",
    "attention_store": "transfer_factory.attention_store:AttentionStore",
    "ems": "transfer_factory.ems_store:EmsStore",
}
BACKEND_NAMES = tuple(_BACKENDS)
PLUGINS_ENV = "CTM_STORAGE_PLUGINS"


def plugin_backends(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``CTM_STORAGE_PLUGINS`` (of ``env``, default the process's) as {name: "module:Class"};
    a malformed entry is an error naming it."""
    out = {}
    text = (os.environ if env is None else env).get(PLUGINS_ENV, "")
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, _, target = entry.partition("=")
        module, _, cls = target.partition(":")
        if not name or not module or not cls:
            raise StorageConfigError(f"{PLUGINS_ENV} entry {entry!r} must be name=module:Class")
        out[name] = target
    return out


def backend_names(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    return BACKEND_NAMES + tuple(n for n in plugin_backends(env) if n not in BACKEND_NAMES)


def create_storage_backend(name: str, *, namespace: str, rank: int,
                           options: dict[str, Any] | None = None) -> KVCacheStorage | DeviceKVStorage:
    known = {**plugin_backends(), **_BACKENDS}
    if name not in known:
        raise StorageConfigError(f"unknown storage backend {name!r}; known: {', '.join(backend_names())}")
    module, cls = known[name].split(":")
    return getattr(importlib.import_module(module), cls)(namespace=namespace, rank=rank, options=options or {})


__all__ = ["BACKEND_NAMES", "backend_names", "plugin_backends", "KVCacheStorage", "DeviceKVStorage", "Addressing",
           "BlockSpan", "RankCaches", "StorageAccess", "StorageConfigError", "create_storage_backend"]
