"""Storage tasks through real CTM processes at TP=2 against a real mooncake_master on loopback: the
opt-in direct path and the master's failures; the default path is in test_backend_conformance.py."""
import os
import signal
import time

import numpy as np
import pytest

from engine_hooks import CacheSpec
from tests.service_helpers import fill_distinct, start_service, views
from transfer_factory.keys import chain_hash_ids
from scripts.local_mooncake_master import LocalMooncakeMaster

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8, cache_dtype="block_wise_fp8",
                 num_extra_layers=1, extra_block_ratio=1.5)
OPTIONS = {"global_segment_size": 64 << 20, "local_buffer_size": 16 << 20, "retry_interval": 0.2}


@pytest.fixture(scope="module")
def master():
    with LocalMooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module", params=["direct"])
def svc(request, master):
    service = start_service(SPEC, storage_backend="mooncake", storage_transfer=request.param,
                            storage_options={**master.config(), **OPTIONS}, model_id=f"mc/{request.param}")
    yield service
    service.shutdown()


def test_round_trip_is_bit_exact_with_scales_and_extra_layers(svc):
    fill_distinct(svc, seed=11)
    v = views(svc)
    keys = chain_hash_ids([f"rt-{i}" for i in range(5)])
    src, dst = [0, 2, 4, 6, 8], [9, 10, 11, 12, 13]
    want = {k: view[src].copy() for k, view in v.items()}
    assert svc.write_storage(keys, src).result(timeout=60) == src
    for view in v.values():
        view[dst] = 0
    assert svc.read_storage(keys, dst).result(timeout=60) == dst
    for k, view in v.items():
        assert np.array_equal(view[dst], want[k]), f"rank/kind/layer {k}"


def test_a_key_missing_on_one_rank_limits_the_read_to_the_minimum(svc, master):
    from transfer_factory.keys import storage_key
    from transfer_factory.mooncake.store import MooncakeStore

    fill_distinct(svc, seed=12)
    keys = chain_hash_ids([f"partial-{i}" for i in range(4)])
    assert svc.write_storage(keys, [0, 1, 2, 3]).result(timeout=60) == [0, 1, 2, 3]
    store = MooncakeStore(namespace=str(svc.namespace()), rank=1, options={**master.config(), **OPTIONS})
    try:
        victim = storage_key(svc.namespace(), keys[2], 1, "v")
        deadline = time.monotonic() + 30
        while store.delete([victim]) != [0] and time.monotonic() < deadline:
            time.sleep(0.2)  # a read lease may still be held
        assert store.exists([victim]) == [0]
    finally:
        store.close()
    assert svc.read_storage(keys, [8, 9, 10, 11]).result(timeout=60) == [8, 9]


def test_master_failure_gives_zero_blocks_in_time_swaps_go_on_and_it_recovers(master):
    svc = start_service(SPEC, storage_backend="mooncake", storage_options={**master.config(), **OPTIONS},
                        model_id="mc/failover")
    try:
        fill_distinct(svc, seed=13)
        v = views(svc)
        keys = chain_hash_ids([f"fo-{i}" for i in range(3)])
        assert svc.write_storage(keys, [0, 1, 2]).result(timeout=60) == [0, 1, 2]
        master.kill()
        for attempt in range(3):
            t0 = time.monotonic()
            assert svc.read_storage(keys, [5, 6, 7], timeout=8).result(timeout=30) == []
            assert svc.write_storage(chain_hash_ids([f"down-{attempt}"]), [3], timeout=8).result(timeout=30) == []
            assert time.monotonic() - t0 < 25, "a storage task outlived its timeout"
        want = {k: view[[4]].copy() for k, view in v.items()}
        svc.swap_to_cpu([4], [0]).result(timeout=20)  # swaps still work
        for view in v.values():
            view[[4]] = 0
        svc.swap_to_gpu([4], [0]).result(timeout=20)
        assert all(np.array_equal(view[[4]], want[k]) for k, view in v.items())

        master.restart()
        fresh = chain_hash_ids([f"after-{i}" for i in range(2)])
        deadline = time.monotonic() + 60
        written = []
        while written != [0, 1] and time.monotonic() < deadline:
            written = svc.write_storage(fresh, [0, 1], timeout=8).result(timeout=30)
            time.sleep(0.5)
        assert written == [0, 1], "writes did not recover after the master came back"
        assert svc.read_storage(fresh, [10, 11]).result(timeout=60) == [10, 11]
    finally:
        svc.shutdown()


def test_bad_mooncake_config_fails_at_start_naming_the_key():
    from engine_hooks import StartupError

    with pytest.raises(StartupError, match="protocol"):
        start_service(SPEC, tp=1, storage_backend="mooncake",
                      storage_options={"master_server_addr": "127.0.0.1:1", "protocol": "carrier-pigeon"})


def test_a_hung_master_times_out_the_task_swaps_go_on_and_reads_recover(master):
    # Which call outlives the task (the query or the transfer) depends on timing; what a late
    # call may and may not do is the fault matrix's row in test_mooncake_faults.py.
    svc = start_service(SPEC, storage_backend="mooncake", storage_transfer="direct",
                        storage_options={**master.config(), **OPTIONS}, model_id="mc/hung")
    try:
        fill_distinct(svc, seed=14)
        v = views(svc)
        keys = chain_hash_ids([f"hung-{i}" for i in range(3)])
        want = {k: view[[0, 1, 2]].copy() for k, view in v.items()}
        assert svc.write_storage(keys, [0, 1, 2]).result(timeout=60) == [0, 1, 2]
        os.kill(master.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert svc.read_storage(keys, [5, 6, 7], timeout=2).result(timeout=30) == []
            assert time.monotonic() - t0 < 15, "a hung store held the task past its timeout"
            svc.swap_to_cpu([3], [1]).result(timeout=20)  # swaps go on meanwhile
        finally:
            os.kill(master.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        got = []
        while got != [10, 11, 12] and time.monotonic() < deadline:
            got = svc.read_storage(keys, [10, 11, 12], timeout=10).result(timeout=40)
            time.sleep(0.5)
        assert got == [10, 11, 12], "reads did not recover after the master resumed"
        for k, view in v.items():
            assert np.array_equal(view[[10, 11, 12]], want[k])
    finally:
        svc.shutdown()


# ---------------------------------------------------------------- the mover in this process
def _thread_nice(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_io_threads_run_niced_and_a_staged_round_trip_stays_bit_exact(master):
    """Mooncake's batch calls busy-poll for completion, so a mover over a MooncakeStore runs its
    I/O threads (and only those) at ``io_thread_nice``; 64 blocks go out and back exact."""
    import logging
    import threading

    from cache_manager.cache_tasks import ReadStorageTask, WriteStorageTask
    from cache_manager.storage.staged_mover import StorageMover, resolve_transfer
    from ops.cpu import CpuPlatform
    from transfer_factory.keys import Namespace
    from transfer_factory.mooncake.store import MooncakeStore

    platform = CpuPlatform(instance=f"nice{os.getpid()}-{time.monotonic_ns()}")
    shape, layers = [128, 2, 4, 8], 2
    groups = [(kind, [platform.empty(shape, "bfloat16") for _ in range(layers)])
              for kind in ("k", "v")]  # storage tags
    raw = {(kind, i): platform.raw_view(t) for kind, ts in groups for i, t in enumerate(ts)}
    rng = np.random.default_rng(21)
    for view in raw.values():
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    ns = Namespace("nice/m", "v", 1, "bfloat16", 4, layers)
    store = MooncakeStore(namespace=str(ns), rank=0, options={**master.config(), **OPTIONS})
    mover = None
    try:
        assert store.io_nice == 19
        assert resolve_transfer("auto", store, platform) == "staged"
        before = {t.native_id for t in threading.enumerate()}
        main_nice = _thread_nice(threading.get_native_id())
        mover = StorageMover(platform, store, groups, ns, 0, 64, "auto", logging.getLogger("test.nice"))
        hashes = [f"nice{os.getpid()}x{i:04d}" for i in range(64)]
        src, dst = list(range(64)), list(range(64, 128))
        want = {k: v[src].copy() for k, v in raw.items()}
        assert mover.write(WriteStorageTask("w", hashes, [], src, timeout=30)).value == src
        assert mover.read(ReadStorageTask("r", hashes, [], dst, timeout=30)).value == dst
        assert all(np.array_equal(raw[k][dst], want[k]) for k in raw)
        io = [t for t in threading.enumerate() if t.name.startswith("storage-") and t.native_id not in before]
        assert sorted(t.name for t in io) == ["storage-read-io", "storage-write-io"]
        assert [_thread_nice(t.native_id) for t in io] == [19, 19]
        assert _thread_nice(threading.get_native_id()) == main_nice  # the rest of the process is untouched
    finally:
        if mover is not None:
            mover.close(close_backend=False)
        store.close()
        for _, ts in groups:
            for t in ts:
                platform.free(t)
