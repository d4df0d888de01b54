"""RL weight updates through kv_cache_status (DESIGN §3.9) at TP=2 with real CTMs: clear, restore, and
KV from the old weights never served after the update; with file and Mooncake storage."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from engine_hooks import CachesClearedError, CacheUpdateError, RankDiedError
from engine_hooks.prefix_cache import TieredPrefixCache
from cache_manager.cache_data import CACHE_READY_SIGNAL, KV_CACHE_STATUS_SIGNAL, SWAP_CLEARING_ENV, KVCacheStatus
from cache_manager.cache_spec import key_prefix_from_version
from tests.service_helpers import SMALL, block_bytes, fill_distinct, segments_of, start_service, views
from transfer_factory.keys import chain_hash_ids


def status_of(svc) -> KVCacheStatus:
    return KVCacheStatus(int(svc.signals[KV_CACHE_STATUS_SIGNAL].value[0]))


def status_of_signal(signals) -> KVCacheStatus:
    return KVCacheStatus(int(signals[KV_CACHE_STATUS_SIGNAL].value[0]))


def set_version(model_dir, version: str) -> None:
    (model_dir / "version.yaml").write_text(f"# written by the RL trainer\nversion: {version}\n")


def swap_round_trip_is_exact(svc, block: int, slot: int, into: int) -> bool:
    """Swap device block ``block`` out to host slot ``slot`` and back into block ``into``: whether
    ``into`` then holds ``block``'s bytes on every rank, kind and layer."""
    want = block_bytes(svc, [block])
    assert svc.swap_to_cpu([block], [slot]).result(timeout=30)
    assert svc.swap_to_gpu([into], [slot]).result(timeout=30)
    got = block_bytes(svc, [into])
    return all(np.array_equal(got[k], want[k]) for k in want)


def latched_direct_service(tmp_path, **kw):
    """TP=2 CTMs on the latched file store (``tests/latched_store.py``) with direct reads, storing
    for a model at RL-STEP1: ``(service, latch, model directory)``."""
    from tests.fault_helpers import PLUGIN_ENV, Latch

    latch = Latch(tmp_path / "latch")
    model = tmp_path / "model"
    model.mkdir()
    set_version(model, "RL-STEP1-20251103-aaaa")
    svc = start_service(SMALL, storage_backend="latched", storage_transfer="direct", extra_env=PLUGIN_ENV,
                        storage_options={"root": str(tmp_path / "store"), "latch_dir": str(latch.dir),
                                         "fsync": False}, model_id=str(model), model_version="RL-STEP1", **kw)
    return svc, latch, model


@pytest.fixture(params=["file", "mooncake"])
def storage(request, tmp_path):
    if request.param == "file":
        yield "file", {"root": str(tmp_path / "kv"), "fsync": False}
        return
    from scripts.local_mooncake_master import LocalMooncakeMaster

    with LocalMooncakeMaster(log_dir=str(tmp_path)) as master:
        yield "mooncake", {**master.config(), "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20}


def test_the_version_prefix_follows_fastdeploy(tmp_path):
    set_version(tmp_path, "RL-STEP12-20251103-9b1c2d3e-aaaa")
    assert key_prefix_from_version(str(tmp_path)) == "RL-STEP12"
    (tmp_path / "version.yaml").write_text("other: 1\n")
    with pytest.raises(ValueError, match="no 'version:' entry"):
        key_prefix_from_version(str(tmp_path))
    with pytest.raises(ValueError, match="version.yaml"):
        key_prefix_from_version(str(tmp_path / "missing"))


def test_clear_and_restore_never_serve_kv_of_the_old_weights(storage, tmp_path, monkeypatch):
    backend, options = storage
    monkeypatch.setenv("FD_ENABLE_SWAP_SPACE_CLEARING", "1")  # the CTMs inherit it: swap space freed and rebuilt
    model = tmp_path / "model"
    model.mkdir()
    set_version(model, "RL-STEP1-20251103-aaaa")
    svc = start_service(SMALL, storage_backend=backend, storage_options=options, model_id=str(model),
                        model_version="RL-STEP1")
    port = svc.port
    try:
        fill_distinct(svc, seed=1)
        old_keys = chain_hash_ids([f"old-{i}" for i in range(3)])
        assert svc.write_storage(old_keys, [0, 1, 2]).result(timeout=30) == [0, 1, 2]
        assert svc.swap_to_cpu([3], [0]).result(timeout=30)
        assert svc.swap_to_gpu([4], [0], layerwise=True).result(timeout=30)  # the ranks cut per-layer plans now
        cache = TieredPrefixCache(svc, num_device_blocks=8, num_host_blocks=4, write_policy="write_through")
        cached = chain_hash_ids([f"cached-{i}" for i in range(3)])
        lease = cache.acquire(cached)
        cache.commit(lease)
        cache.release(lease)  # on device now, and written through to storage
        assert cache.drain(30)
        in_flight = svc.control("sleep", seconds=1.0, rank=1)  # a task the clear must drain, not drop
        time.sleep(0.3)  # let it start on rank 1

        svc.clear_caches(timeout=30)
        cache.forget_all()
        assert in_flight.result(timeout=5) == [None, None]  # it finished; nothing hangs
        assert svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] == KVCacheStatus.CLEARED
        assert not [n for n in segments_of(port) if ".key_caches_" in n or ".value_caches_" in n]  # KV memory freed
        with pytest.raises(CachesClearedError, match="CLEARED"):
            svc.swap_to_gpu([4], [0]).result(timeout=5)
        with pytest.raises(CachesClearedError):
            svc.read_storage(old_keys, [0, 1, 2]).result(timeout=5)

        set_version(model, "RL-STEP2-20251104-bbbb")
        svc.restore_caches(timeout=60)
        assert svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] == KVCacheStatus.NORMAL
        assert svc.model_version == "RL-STEP2"
        assert svc.read_storage(old_keys, [0, 1, 2]).result(timeout=30) == []  # old weights: a miss
        assert cache.acquire(cached).sources == ["miss"] * 3  # neither device, host nor storage serves them
        cache.drain(30)
        fill_distinct(svc, seed=2)
        new_keys = chain_hash_ids([f"new-{i}" for i in range(3)])
        want = block_bytes(svc, [0, 1, 2])
        assert svc.write_storage(new_keys, [0, 1, 2]).result(timeout=30) == [0, 1, 2]
        for v in views(svc).values():
            v[[5, 6, 7]] = 0
        assert svc.read_storage(new_keys, [5, 6, 7]).result(timeout=30) == [5, 6, 7]
        got = block_bytes(svc, [5, 6, 7])
        assert all(np.array_equal(got[k], want[k]) for k in want)
        assert swap_round_trip_is_exact(svc, 8, 1, 9)  # the rebuilt swap space works
        swapped = block_bytes(svc, [8])
        # Layer-wise copies use plans cut from the rebuilt caches, not those cut before the clear.
        loading = svc.swap_to_gpu([10], [1], layerwise=True)
        loading.wait_for_layer(SMALL.num_layers - 1, timeout=30)
        assert loading.result(timeout=30)
        got = block_bytes(svc, [10])
        assert all(np.array_equal(got[k], swapped[k]) for k in swapped)
    finally:
        svc.shutdown()
    assert segments_of(port) == []


def test_a_rank_killed_while_clearing_fails_the_clear_instead_of_hanging_it(tmp_path):
    svc = start_service(SMALL, storage_backend="file", storage_options={"root": str(tmp_path), "fsync": False})
    port = svc.port
    try:
        hold = svc.control("sleep", seconds=5.0, rank=1)  # rank 1's clear waits for this task
        pid = svc.pids()[1]
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(CacheUpdateError, match=r"rank\(s\) \[1\] died"):
            svc.clear_caches(timeout=20)
        killer.join()
        with pytest.raises(RankDiedError):
            hold.result(timeout=10)
    finally:
        svc.shutdown()
    assert segments_of(port) == []


def rank_log(svc, rank: int) -> str:
    with open(os.path.join(svc.log_dir, f"cache_transfer_manager_rank{rank}.log")) as f:
        return f.read()


def test_the_ranks_reach_cleared_in_lock_step_past_a_stopped_rank():
    """A rank stopped (SIGSTOP) in the middle of a clear: every other rank detaches and waits at the
    CLEARED barrier, whose attempts time out alike on each, naming the stopped rank; none sets
    CLEARED, so the engine's clear times out naming it.  Once it resumes it catches up with the
    barrier the others wait at, and the clear completes; so does the restore after it."""
    svc = start_service(SMALL, tp=3, extra_flags={"rl_barrier_timeout": 0.5})
    port = svc.port
    try:
        hold = svc.control("sleep", seconds=2.0, rank=1)  # rank 1's clear drains this task
        time.sleep(0.3)  # let it start on rank 1
        pid = svc.pids()[1]
        stopper = threading.Timer(0.3, os.kill, (pid, signal.SIGSTOP))  # once the clear began
        stopper.start()
        try:
            with pytest.raises(CacheUpdateError, match=r"ranks not done: \[1\]"):
                svc.clear_caches(timeout=4.0)
            stopper.join()
            assert status_of(svc) == KVCacheStatus.CLEARING  # no rank set CLEARED
            assert list(svc.signals[CACHE_READY_SIGNAL].value) == [0, 1, 0]  # ranks 0 and 2 detached
            for rank in (0, 2):
                timeouts = re.findall(r"barrier rl/cleared/(\d+) timed out after [\d.]+s: rank\(s\) \[1\] not cleared",
                                      rank_log(svc, rank))
                assert len(timeouts) >= 2, rank_log(svc, rank)  # attempt after attempt, alike on each rank
        finally:
            os.kill(pid, signal.SIGCONT)
        svc.clear_caches(timeout=30)
        assert status_of(svc) == KVCacheStatus.CLEARED
        assert hold.result(timeout=10) == [None, None, None]
        for rank in range(3):
            assert re.search(r"every rank is cleared \(barrier rl/cleared/\d+\)", rank_log(svc, rank))
        svc.restore_caches(timeout=60)
        assert status_of(svc) == KVCacheStatus.NORMAL
        fill_distinct(svc, seed=12)
        assert swap_round_trip_is_exact(svc, 3, 0, 4)
    finally:
        svc.shutdown()
    assert segments_of(port) == []


def test_a_clear_keeps_the_caches_a_late_direct_read_may_still_write(tmp_path):
    """A direct read stuck past its deadline may still write its device blocks.  The clear must
    not detach them, and the engine must not free them, until that read has returned; then the
    same clear goes on to the end, and a restore works."""
    svc, latch, model = latched_direct_service(tmp_path)
    port = svc.port
    try:
        fill_distinct(svc, seed=8)
        keys = chain_hash_ids(["late-0", "late-1"])
        assert svc.write_storage(keys, [1, 2]).result(timeout=30) == [1, 2]
        latch.close("batch_get_multi")
        late = svc.read_storage(keys, [5, 6], timeout=0.5)
        assert late.result(timeout=10) == []  # answered at its deadline, the read still stuck
        assert not late.released.done()

        with pytest.raises(CacheUpdateError, match=r"ranks not done: \[0, 1\].*restart_rank"):
            svc.clear_caches(timeout=1.5)
        time.sleep(0.5)  # a rank that gave up waiting would detach now
        assert list(svc.signals[CACHE_READY_SIGNAL].value) == [1, 1]  # still attached on every rank
        assert status_of(svc) == KVCacheStatus.CLEARING
        assert [n for n in segments_of(port) if ".key_caches_" in n]  # the engine freed nothing

        latch.open("batch_get_multi")
        late.released.result(timeout=10)
        svc.clear_caches(timeout=30)  # the same clear goes on to the end
        assert status_of(svc) == KVCacheStatus.CLEARED
        assert not [n for n in segments_of(port) if ".key_caches_" in n or ".value_caches_" in n]
        set_version(model, "RL-STEP2-20251104-bbbb")
        svc.restore_caches(timeout=60)
        assert svc.read_storage(keys, [5, 6]).result(timeout=30) == []  # the old weights' KV: a miss
        fill_distinct(svc, seed=9)
        assert swap_round_trip_is_exact(svc, 3, 0, 4)
    finally:
        svc.shutdown()
    assert segments_of(port) == []


def test_a_draining_rank_never_detaches_while_a_task_holds_blocks(monkeypatch):
    """The clear's state machine on one rank: however long a task holds its blocks (past the
    drain's warning time too), every step refuses tasks and keeps the caches attached; the step
    after the release detaches them and reports the rank cleared."""
    import logging
    from types import SimpleNamespace

    from cache_manager.rank import lifecycle as kv_cache_lifecycle
    from cache_manager.cache_data import CACHE_TRANSFER_INITED_SIGNAL, SWAP_SPACE_READY_SIGNAL
    from cache_manager.queue.client import BarrierAnswer

    monkeypatch.setattr(kv_cache_lifecycle, "DRAIN_TIMEOUT", 0.05)
    monkeypatch.delenv(SWAP_CLEARING_ENV, raising=False)
    held = [1]
    signals = {name: SimpleNamespace(value=np.ones(2, np.int32)) for name in
               (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, SWAP_SPACE_READY_SIGNAL)}
    signals[KV_CACHE_STATUS_SIGNAL] = SimpleNamespace(value=np.array([int(KVCacheStatus.CLEARING)], np.int32))
    detached = []
    resources = SimpleNamespace(close_storage=lambda: None, free_swap=lambda: None,
                                detach=lambda: detached.append(True))
    arrivals = []

    def arrive(name, value, timeout):  # the other rank never comes: every barrier times out
        arrivals.append(name)
        time.sleep(0.02)
        return BarrierAnswer(False, None, [1])

    life = kv_cache_lifecycle.KvCacheLifecycle(
        resources, SimpleNamespace(active=lambda: held[0]), signals, SimpleNamespace(arrive=arrive), rank=0,
        log=logging.getLogger("test.lifecycle"), stop_event=threading.Event(), barrier_timeout=0.02)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        life.step()
        assert life.draining and life.refusal() is not None
        assert signals[CACHE_READY_SIGNAL].value[0] == 1 and signals[CACHE_TRANSFER_INITED_SIGNAL].value[0] == 1
        time.sleep(0.01)
    held[0] = 0
    life.step()
    assert life.detached and not life.draining and life.refusal() is not None and detached == [True]
    assert signals[CACHE_READY_SIGNAL].value[0] == 0 and signals[CACHE_TRANSFER_INITED_SIGNAL].value[0] == 0
    time.sleep(0.2)
    life.close()
    life.join()
    # Detached, it arrived at the CLEARED barriers, attempt after attempt; none passed, so the status stays.
    assert arrivals[:2] == ["rl/cleared/0", "rl/cleared/1"]
    assert status_of_signal(signals) == KVCacheStatus.CLEARING


def test_restarting_the_ranks_of_a_stuck_clear_lets_it_finish(tmp_path):
    """What the timed-out clear tells the engine to do: restart the ranks whose I/O is stuck.
    Their processes end the I/O; the new ones come up in CLEARING and detach; the clear finishes."""
    svc, latch, model = latched_direct_service(tmp_path, stop_grace=0.5)
    port = svc.port
    try:
        fill_distinct(svc, seed=10)
        keys = chain_hash_ids(["stuck-0"])
        assert svc.write_storage(keys, [1]).result(timeout=30) == [1]
        latch.close("batch_get_multi")
        late = svc.read_storage(keys, [5], timeout=0.5)
        assert late.result(timeout=10) == []
        with pytest.raises(CacheUpdateError, match=r"ranks not done: \[0, 1\]"):
            svc.clear_caches(timeout=1.0)
        for rank in range(2):
            svc.restart_rank(rank)  # the latch stays closed: only the process's end stops the read
        late.released.result(timeout=10)
        svc.clear_caches(timeout=30)
        assert status_of(svc) == KVCacheStatus.CLEARED
        latch.open("batch_get_multi")
        set_version(model, "RL-STEP2-20251104-bbbb")
        svc.restore_caches(timeout=60)
        fill_distinct(svc, seed=11)
        assert swap_round_trip_is_exact(svc, 3, 0, 4)
    finally:
        svc.shutdown()
    assert segments_of(port) == []
