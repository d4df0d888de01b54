"""What the LLM-DataDist stand-in's "clusters" know of each other (tests only).

The real library exchanges memory descriptors over its links; the stand-in's clusters are the
processes of one test, so they share a table under ``$ACL_STANDIN_DIR``
(``llm_datadist_registry.json``), rewritten atomically under an exclusive ``fcntl.flock`` of
``llm_datadist_registry.lock`` and read without the lock (a reader sees the old or the new file)::

    {"servers": {"<cluster>": {"pid": 1, "token": "..", "listen": "ip:port", "mem_pool": N}},
     "caches":  {"<cluster>/<cache_id>": {"cluster": .., "cache_id": .., "seq": ns, "placement": "DEVICE",
                 "num_tensors": .., "shape": [..], "data_type": "DT_BF16", "batch_dim": 0, "blocks": true,
                 "key": [cluster, model_id] | null, "cache_keys": [[cluster, req, model, prefix], ..],
                 "remote_accessible": true, "tensors": [location, ..], "pid": 1}},
     "links":   {"<client>><server>": {"client_pid": .., "server_pid": .., "seq": ns, "mode": "clusters"}},
     "comms":   {"<comm_name>": {"members": {"<cluster>": rank}, "joined": {"<cluster>": pid}}}}

A cluster is published here when it listens (``llm.listenIpInfo``) or joins a communication domain
(``link``); a cluster that only links out as a client needs nobody to find it.  Entries of dead
processes are dropped at the next update, as the runtime tears down a dead peer's resources; a
client that linked remembers the server's pid, so it still tells "peer gone" from "never there".
``seq`` values are ``time.monotonic_ns()``: one clock for every process of a host, so "registered
after the link" is decidable across processes.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from acl._shared import pid_alive  # the pyACL stand-in this one runs on: one liveness rule for both

REGISTRY_FILE = "llm_datadist_registry.json"
LOCK_FILE = "llm_datadist_registry.lock"
_EMPTY = {"servers": {}, "caches": {}, "links": {}, "comms": {}}
_READ_RETRIES = 20


def _root() -> Path:
    value = os.environ.get("ACL_STANDIN_DIR")
    if not value:
        raise RuntimeError("the LLM-DataDist stand-in runs on the pyACL stand-in and needs $ACL_STANDIN_DIR")
    return Path(value)


def now() -> int:
    return time.monotonic_ns()


def _empty() -> dict[str, Any]:
    return json.loads(json.dumps(_EMPTY))


def read() -> dict[str, Any]:
    """A consistent snapshot, without the lock (writers replace the file atomically)."""
    path = _root() / REGISTRY_FILE
    for attempt in range(_READ_RETRIES):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return _empty()
        if not text.strip():
            return _empty()
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # only a foreign writer could leave this; retry briefly
            if attempt == _READ_RETRIES - 1:
                raise
            time.sleep(0.002)
    return _empty()


def _gc(table: dict[str, Any]) -> None:
    alive: dict[int, bool] = {}

    def live(pid: int) -> bool:
        if pid not in alive:
            alive[pid] = pid_alive(pid)
        return alive[pid]

    table["servers"] = {k: v for k, v in table["servers"].items() if live(v["pid"])}
    table["caches"] = {k: v for k, v in table["caches"].items() if live(v["pid"])}
    table["links"] = {k: v for k, v in table["links"].items() if live(v["client_pid"]) and live(v["server_pid"])}
    for name, comm in list(table["comms"].items()):
        comm["joined"] = {c: p for c, p in comm["joined"].items() if live(p)}
        if not comm["joined"]:
            del table["comms"][name]


_THREAD_LOCK = threading.Lock()  # flock is per open file description; threads of a process queue here


@contextmanager
def update() -> Iterator[dict[str, Any]]:
    """The table, locked against every process, written back if the block returns normally."""
    root = _root()
    root.mkdir(parents=True, exist_ok=True)
    with _THREAD_LOCK, open(root / LOCK_FILE, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            table = read()
            for key, value in _EMPTY.items():
                table.setdefault(key, type(value)())
            _gc(table)
            yield table
            tmp = root / f"{REGISTRY_FILE}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(table, sort_keys=True))
            os.replace(tmp, root / REGISTRY_FILE)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def cache_entry(cluster: int, cache: Any, pid: int) -> dict[str, Any]:
    """What a peer needs to reach one registered cache of ``cluster``."""
    desc = cache.cache_desc
    key = cache._blocks_key
    return {"cluster": cluster, "cache_id": cache.cache_id, "seq": cache._seq, "placement": desc.placement.name,
            "num_tensors": desc.num_tensors, "shape": desc.shape, "data_type": desc.data_type.name,
            "batch_dim": desc.batch_dim, "blocks": cache.is_blocks_cache,
            "key": None if key is None else [key.cluster_id, key.model_id],
            "cache_keys": [k.wire() for k in cache._cache_keys], "remote_accessible": cache._remote_accessible,
            "tensors": cache._locations, "pid": pid}


def publish_cache(cluster: int, cache: Any) -> None:
    with update() as table:
        table["caches"][f"{cluster}/{cache.cache_id}"] = cache_entry(cluster, cache, os.getpid())


def withdraw_cache(cluster: int, cache_id: int) -> None:
    with update() as table:
        table["caches"].pop(f"{cluster}/{cache_id}", None)


def find_cache(table: dict[str, Any], cluster: int, *, cache_id: int | None = None,
               blocks_key: tuple[int, int] | None = None, cache_key: list[int] | None = None) -> dict | None:
    """The cache of ``cluster`` named by its id, its BlocksCacheKey or a bound CacheKey."""
    if cache_id is not None:
        return table["caches"].get(f"{cluster}/{cache_id}")
    for entry in table["caches"].values():
        if entry["cluster"] != cluster:
            continue
        if blocks_key is not None and entry["key"] == list(blocks_key):
            return entry
        if cache_key is not None and cache_key in entry["cache_keys"]:
            return entry
    return None
