"""A storage write that outlives its task stores nothing after the answer (DESIGN §3.8, issue 24 item 10).

* The file store under a ``CommitLease``: a revoked lease, a passed deadline or a closed store
  refuses the commit (nothing appended, the keys are misses); a live lease commits.
* A real TP=2 CTM on the file store whose ``batch_set`` stalls past the task's deadline
  (``tests/slow_commit_store.py``), racing an RL clear: the task answers 0 blocks in time with its
  blocks released, the clear completes without closing the backend under the running call, and
  when the call resumes it stores nothing: after the answer and the clear the keys are not
  readable (``exists`` 0, ``batch_get`` a miss, a read through the restored CTM a miss).
"""
from __future__ import annotations

import json
import os
import re
import time

import numpy as np

from cache_manager.cache_data import KV_CACHE_STATUS_SIGNAL, SWAP_CLEARING_ENV, KVCacheStatus
from tests.service_helpers import SMALL, fill_distinct, start_service
from transfer_factory.file.store import FileStore
from transfer_factory.file.store_io import address_of
from transfer_factory.keys import chain_hash_ids
from transfer_factory.kvcache_storage import NOT_FOUND, OK, TIMEOUT, UNAVAILABLE, CommitLease, commit_lease

PLUGIN_ENV = {"CTM_STORAGE_PLUGINS": "slowcommit=tests.slow_commit_store:SlowCommitStore"}
TIMEOUT_S = 0.5      # the write task's budget
STALL_S = 2.5        # how long its batch_set stalls before it gets to the commit


def _objects(n: int, size: int = 4096) -> tuple[list[str], list[bytearray]]:
    keys = [f"ns/blk{i}/0/{kind}" for i in range(n) for kind in ("k", "v")]
    rng = np.random.default_rng(n)
    return keys, [bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for _ in keys]


def _set(store: FileStore, keys: list[str], bufs: list[bytearray]) -> list[int]:
    return store.batch_set(keys, [address_of(b) for b in bufs], [len(b) for b in bufs])


def _misses(store: FileStore, keys: list[str]) -> bool:
    bufs = [bytearray(4096) for _ in keys]
    got = store.batch_get(keys, [address_of(b) for b in bufs], [len(b) for b in bufs])
    return store.exists(keys) == [0] * len(keys) and all(r == NOT_FOUND for r in got)


def test_the_file_store_commits_only_under_a_live_lease(tmp_path):
    store = FileStore("ns", 0, {"root": str(tmp_path), "fsync": False})
    try:
        keys, bufs = _objects(2)
        revoked = CommitLease(time.monotonic() + 60)
        assert revoked.revoke() is False                      # no commit was under way
        with commit_lease(revoked):
            assert _set(store, keys, bufs) == [TIMEOUT] * len(keys)
        expired = CommitLease(time.monotonic() - 0.001)
        with commit_lease(expired):
            assert _set(store, keys, bufs) == [TIMEOUT] * len(keys)
        assert _misses(store, keys) and len(store) == 0 and store.disk_bytes == 0
        live = CommitLease(time.monotonic() + 60)
        with commit_lease(live):
            assert _set(store, keys, bufs) == [OK] * len(keys)
        assert live.revoke() is False                         # the commit was over before the revoke
        assert store.exists(keys) == [1] * len(keys)
    finally:
        store.close()


def test_a_call_running_when_the_store_closes_commits_nothing(tmp_path):
    store = FileStore("ns", 0, {"root": str(tmp_path), "fsync": False})
    keys, bufs = _objects(2)
    store._writer.closed = True          # what close() sets first, as a running call would find it at its commit
    try:
        assert _set(store, keys, bufs) == [UNAVAILABLE] * len(keys)
    finally:
        store.close()
    reopened = FileStore("ns", 0, {"root": str(tmp_path), "fsync": False})
    try:
        assert _misses(reopened, keys) and len(reopened) == 0
    finally:
        reopened.close()


def _rank_log(svc, rank: int) -> str:
    with open(os.path.join(svc.log_dir, f"cache_transfer_manager_rank{rank}.log")) as f:
        return f.read()


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_late_staged_write_racing_an_rl_clear_stores_nothing(tmp_path):
    stall_dir, root, model = tmp_path / "stall", tmp_path / "store", tmp_path / "model"
    stall_dir.mkdir()
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP1-20251103-aaaa\n")
    svc = start_service(SMALL, storage_backend="slowcommit", storage_transfer="staged", extra_env=PLUGIN_ENV,
                        storage_options={"root": str(root), "stall_dir": str(stall_dir), "fsync": False},
                        model_id=str(model), model_version="RL-STEP1")
    try:
        fill_distinct(svc, seed=3)
        hashes = chain_hash_ids(["late-write-0", "late-write-1"])
        (stall_dir / "batch_set").write_text(str(STALL_S))
        t0 = time.monotonic()
        future = svc.write_storage(hashes, [1, 2], timeout=TIMEOUT_S)
        assert future.result(timeout=TIMEOUT_S + 10) == []                 # the answer: 0 blocks, in time
        assert time.monotonic() - t0 < STALL_S - 0.5, "the task waited for the stalled call"
        future.released.result(timeout=1.0)   # its lease revoked before the commit: nothing of it can land
        assert all((stall_dir / f"batch_set.entered.{r}").exists() for r in (0, 1))
        assert not any((stall_dir / f"batch_set.done.{r}").exists() for r in (0, 1)), "the call did not stall"

        t1 = time.monotonic()
        svc.clear_caches(timeout=30)                                       # races the stalled calls
        assert svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] == KVCacheStatus.CLEARED
        cleared_s = time.monotonic() - t1
        _wait_for(lambda: all((stall_dir / f"batch_set.done.{r}").exists() for r in (0, 1)), STALL_S + 10,
                  "the late calls to return")
        for r in (0, 1):
            codes = json.loads((stall_dir / f"batch_set.done.{r}").read_text())
            assert codes and all(c != OK for c in codes), f"rank {r}: the late call stored objects: {codes}"
            # TIMEOUT, not UNAVAILABLE: the backend was still open (the clear did not close it under the
            # running call) and refused the commit because the task's lease was revoked.
            assert all(c == TIMEOUT for c in codes), codes
            assert re.search(r"lease is revoked; the late call stores nothing", _rank_log(svc, r))
        (stall_dir / "batch_set").unlink()

        # Nothing under any namespace or rank: exists 0 and batch_get a miss for every key.
        namespaces = [p.name for p in root.iterdir() if p.is_dir()]
        assert namespaces, "the store never opened"
        for ns in namespaces:
            for rank in (0, 1):
                store = FileStore(ns, rank, {"root": str(root), "fsync": False})
                try:
                    keys = [f"{ns}/{h}/{rank}/{kind}" for h in hashes for kind in ("k", "v")]
                    assert len(store) == 0 and _misses(store, keys), f"{ns} rank {rank} holds the late objects"
                finally:
                    store.close()
        # The CTM, restored at the same model version (the same namespace), misses them too.
        svc.restore_caches(timeout=60)
        fill_distinct(svc, seed=4)
        assert svc.read_storage(hashes, [5, 6]).result(timeout=30) == []
        assert svc.write_storage(hashes, [1, 2]).result(timeout=30) == [1, 2]   # and it still stores
        assert svc.read_storage(hashes, [5, 6]).result(timeout=30) == [5, 6]
        assert svc.control("ping").result(timeout=10)
        assert cleared_s < STALL_S + 10, f"the clear took {cleared_s:.1f}s"
    finally:
        svc.shutdown()


def test_a_clear_waits_for_storage_calls_off_the_serve_thread_and_counts_those_that_outlive_it(monkeypatch):
    """The clear's storage close on one rank: begun without blocking, polled from ``step``; a call
    that outlives ``STORAGE_CLOSE_WAIT`` is counted and logged, and the clear goes on (the mover
    closes its backend only once the call returns)."""
    import logging
    import threading
    from types import SimpleNamespace

    from cache_manager.cache_data import CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, SWAP_SPACE_READY_SIGNAL
    from cache_manager.queue.client import BarrierAnswer
    from cache_manager.rank import lifecycle

    monkeypatch.setattr(lifecycle, "STORAGE_CLOSE_WAIT", 0.3)
    monkeypatch.delenv(SWAP_CLEARING_ENV, raising=False)
    signals = {name: SimpleNamespace(value=np.ones(2, np.int32)) for name in
               (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, SWAP_SPACE_READY_SIGNAL)}
    signals[KV_CACHE_STATUS_SIGNAL] = SimpleNamespace(value=np.array([int(KVCacheStatus.CLEARING)], np.int32))
    calls: list[str] = []
    storage = SimpleNamespace(begin_close=lambda: calls.append("begin_close"), closed=lambda: False,
                              calls_running=lambda: 1)
    resources = SimpleNamespace(storage=storage, close_storage=lambda: calls.append("close_storage"),
                                free_swap=lambda: None, detach=lambda: calls.append("detach"))
    life = lifecycle.KvCacheLifecycle(
        resources, SimpleNamespace(active=lambda: 0), signals,
        SimpleNamespace(arrive=lambda name, value, timeout: BarrierAnswer(False, None, [1])), rank=0,
        log=logging.getLogger("test.lifecycle"), stop_event=threading.Event(), barrier_timeout=0.02)
    try:
        started = time.monotonic()
        while not life.detached:
            t = time.monotonic()
            life.step()
            assert time.monotonic() - t < 0.1, "a step blocked on the storage close"
            assert time.monotonic() - started < 5
            time.sleep(0.01)
        assert time.monotonic() - started >= 0.3                  # it waited for the running call first
        assert calls == ["begin_close", "close_storage", "detach"]
        assert life.late_storage_calls == 1
    finally:
        life.close()
        life.join()
