"""Read-storage and write-storage tasks through real CTM processes at TP=2, file backend, on the opt-in
direct path and on the staged path read in pieces of one block (the file backend's default reads
in 4 MiB pieces; one block per piece makes every read here several pieces); the default path of
every backend is also in test_backend_conformance.py."""
import threading
import time

import numpy as np
import pytest

from cache_manager.storage.io_threads import ScatterLease
from engine_hooks import CacheSpec, StartupError, TaskFailedError
from tests.service_helpers import fill_distinct, start_service, views
from transfer_factory.file.store import FileStore
from transfer_factory.keys import chain_hashes, storage_key

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8, cache_dtype="block_wise_fp8",
                 num_extra_layers=1, extra_block_ratio=1.5)


def keys_for(n: int, seed: int = 0) -> list[str]:
    tokens = np.random.default_rng(seed).integers(0, 50000, n * SPEC.block_size).tolist()
    return chain_hashes(tokens, SPEC.block_size)


@pytest.fixture(scope="module", params=["direct", "pieces"])
def svc(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"kv-{request.param}")
    options = {"root": str(root), "fsync": False}
    if request.param == "pieces":
        options["read_piece_bytes"] = 1  # a piece is at least one block
    service = start_service(SPEC, storage_backend="file",
                            storage_transfer="direct" if request.param == "direct" else "auto",
                            storage_options=options, model_id="test/model-a")
    service.path = request.param
    service.file_root = root
    yield service
    service.shutdown()


def test_round_trip_is_bit_exact_with_scales_and_extra_layers(svc):
    fill_distinct(svc, seed=1)
    v = views(svc)
    assert {kind for (_, kind, _) in v} == {"key_caches", "value_caches", "key_cache_scales", "value_cache_scales"}
    assert max(layer for (_, _, layer) in v) == SPEC.num_layers  # the extra speculative layer
    keys = keys_for(5, seed=1)
    src, dst = [1, 2, 3, 4, 5], [8, 9, 10, 11, 12]
    want = {k: view[src].copy() for k, view in v.items()}
    assert svc.write_storage(keys, src).result(timeout=30) == src
    for view in v.values():
        view[dst] = 0
    assert svc.read_storage(keys, dst).result(timeout=30) == dst
    for k, view in v.items():
        assert np.array_equal(view[dst], want[k]), f"rank/kind/layer {k}"


def test_write_skips_the_prefix_already_stored(svc):
    fill_distinct(svc, seed=2)
    v = views(svc)
    keys = keys_for(4, seed=2)
    first = {k: view[[0, 1]].copy() for k, view in v.items()}
    assert svc.write_storage(keys[:2], [0, 1]).result(timeout=30) == [0, 1]
    for view in v.values():  # new bytes in blocks 0 and 1: a second write must not store them
        view[[0, 1]] ^= 0xFF
    later = {k: view[[2, 3]].copy() for k, view in v.items()}
    assert svc.write_storage(keys, [0, 1, 2, 3]).result(timeout=30) == [0, 1, 2, 3]
    assert svc.read_storage(keys, [12, 13, 14, 15]).result(timeout=30) == [12, 13, 14, 15]
    for k, view in v.items():
        assert np.array_equal(view[[12, 13]], first[k])
        assert np.array_equal(view[[14, 15]], later[k])


def test_start_index_and_a_missing_block_limit_the_read(svc):
    fill_distinct(svc, seed=3)
    keys = keys_for(6, seed=3)
    assert svc.write_storage(keys[:4], [0, 1, 2, 3]).result(timeout=30) == [0, 1, 2, 3]
    assert svc.read_storage(keys, [5, 6, 7, 8], start_read_block_idx=2).result(timeout=30) == [5, 6]
    assert svc.read_storage(keys_for(3, seed=99), [5, 6, 7]).result(timeout=30) == []


def test_partial_and_damaged_objects_cut_the_read_at_the_minimum_over_ranks(svc):
    fill_distinct(svc, seed=4)
    v = views(svc)
    keys = keys_for(4, seed=4)
    assert svc.write_storage(keys[:2], [0, 1]).result(timeout=30) == [0, 1]
    assert svc.write_storage(keys, [0, 1, 2, 3]).result(timeout=30) == [0, 1, 2, 3]
    ns = str(svc.namespace())
    with FileStore(ns, 1, {"root": str(svc.file_root), "fsync": False}) as probe:
        where = probe.object_location(storage_key(ns, keys[2], 1, "v"))
    assert where is not None, "rank 1 wrote no V for block 2"
    with open(where.path, "r+b") as f:  # damage one of rank 1's objects of block 2: its record's last byte
        f.seek(where.offset + where.length - 1)
        last = f.read(1)
        f.seek(where.offset + where.length - 1)
        f.write(bytes([last[0] ^ 1]))
    got = svc.read_storage(keys, [8, 9, 10, 11]).result(timeout=30)
    # DESIGN 3.7: a block whose payload fails its check is a miss, so the read stops before block 2
    assert got == [8, 9], got
    want = {k: view[[0, 1]].copy() for k, view in v.items()}
    for k, view in v.items():
        assert np.array_equal(view[[8, 9]], want[k])


def test_a_staged_read_cut_by_a_missing_object_leaves_the_later_blocks_untouched(svc):
    if svc.path == "direct":
        pytest.skip("a direct read writes the device blocks before it knows they are whole")
    fill_distinct(svc, seed=5)
    v = views(svc)
    keys = keys_for(4, seed=5)
    assert svc.write_storage(keys, [0, 1, 2, 3]).result(timeout=30) == [0, 1, 2, 3]
    ns = str(svc.namespace())
    with FileStore(ns, 0, {"root": str(svc.file_root), "fsync": False}) as store:
        assert store.delete([storage_key(ns, keys[2], 0, "k")]) == [0]
    before = {k: view[[12, 13]].copy() for k, view in v.items()}
    want = {k: view[[0, 1]].copy() for k, view in v.items()}
    assert svc.read_storage(keys, [10, 11, 12, 13]).result(timeout=30) == [10, 11]
    for k, view in v.items():
        assert np.array_equal(view[[10, 11]], want[k]), f"rank/kind/layer {k}"
        if k[0] == 0:  # the rank that misses block 2 reads and scatters nothing from there on
            assert np.array_equal(view[[12, 13]], before[k]), f"rank/kind/layer {k}"


def test_a_tenants_blocks_are_read_by_that_tenant_alone(svc):
    """Storage keys carry the tenant's salt: another salt, or none, finds nothing; the same salt
    reads bit-exact; and an unsalted write is read by an unsalted request as before salts existed."""
    fill_distinct(svc, seed=7)
    v = views(svc)
    keys = keys_for(3, seed=7)
    want = {k: view[[1, 2, 3]].copy() for k, view in v.items()}
    assert svc.write_storage(keys, [1, 2, 3], cache_salt="tenant-a").result(timeout=30) == [1, 2, 3]
    assert svc.read_storage(keys, [8, 9, 10], cache_salt="tenant-b").result(timeout=30) == []
    assert svc.read_storage(keys, [8, 9, 10]).result(timeout=30) == []
    assert svc.read_storage(keys, [8, 9, 10], cache_salt="tenant-a").result(timeout=30) == [8, 9, 10]
    for k, view in v.items():
        assert np.array_equal(view[[8, 9, 10]], want[k]), f"rank/kind/layer {k}"
    plain = keys_for(2, seed=8)
    assert svc.write_storage(plain, [4, 5]).result(timeout=30) == [4, 5]
    assert svc.read_storage(plain, [11, 12], cache_salt="tenant-a").result(timeout=30) == []
    assert svc.read_storage(plain, [11, 12]).result(timeout=30) == [11, 12]


def test_bad_storage_task_input_fails_clearly(svc):
    with pytest.raises(TaskFailedError, match="2 keys but 1 gpu_block_ids"):
        svc.write_storage(keys_for(2), [0]).result(timeout=30)
    with pytest.raises(TaskFailedError, match="device block id 99"):
        svc.read_storage(keys_for(1), [99]).result(timeout=30)
    with pytest.raises(ValueError, match="keys must be a list"):
        svc.read_storage("abc", [1])


def test_bad_backend_config_fails_at_start_with_a_clear_message(tmp_path):
    with pytest.raises(StartupError, match="capacity_bytes"):
        start_service(SPEC, tp=1, storage_backend="file", storage_options={"root": str(tmp_path),
                                                                           "capacity_bytes": "lots"})
    env = {"PYTHONPATH": ""}  # the vendor SDKs' stand-ins are not on the path: the CTM names the missing module
    with pytest.raises(StartupError, match="'ems' needs the Huawei EMS SDK: module 'ems' cannot be imported"):
        start_service(SPEC, tp=1, storage_backend="ems", extra_env=env)
    with pytest.raises(StartupError, match="'attention_store' needs the AttentionStore SDK: module "
                                           "'attentionstore_sdk.sdk' cannot be imported"):
        start_service(SPEC, tp=1, storage_backend="attention_store", extra_env=env)
    with pytest.raises(ValueError, match="storage_backend 'redis'"):
        start_service(SPEC, tp=1, storage_backend="redis")


def test_a_revoked_scatter_lease_waits_for_the_write_in_progress_and_allows_no_more():
    """What keeps a pieced read's late piece out of the device blocks: the task revokes the lease
    before it answers, and revoking waits for a scatter already under way."""
    lease = ScatterLease(time.monotonic() + 30)
    started, finish, log = threading.Event(), threading.Event(), []

    def slow_scatter():
        started.set()
        finish.wait(5)
        log.append("scattered")

    writer = threading.Thread(target=lambda: lease.run(slow_scatter))
    writer.start()
    assert started.wait(5)
    revoker = threading.Thread(target=lambda: (lease.revoke(), log.append("revoked")))
    revoker.start()
    time.sleep(0.2)
    assert log == [], "revoke returned while a scatter was still writing"
    finish.set()
    revoker.join(5)
    writer.join(5)
    assert log == ["scattered", "revoked"]
    assert lease.run(lambda: log.append("late")) is False and log == ["scattered", "revoked"]
    assert ScatterLease(time.monotonic() - 1).run(lambda: log.append("expired")) is False
    assert log == ["scattered", "revoked"]
