"""TieredPrefixCache over real CTMs (TP=1): LRU order, pinning, write-through, recompute on failure."""
import os
import signal

import numpy as np
import pytest

from engine_hooks import CacheSpec
from engine_hooks.prefix_cache import CapacityError, TieredPrefixCache
from tests.service_helpers import start_service, views
from transfer_factory.keys import chain_hash_ids

SPEC = CacheSpec(num_layers=2, num_blocks=4, kv_heads=1, block_size=4, head_dim=8)


@pytest.fixture
def svc(tmp_path):
    service = start_service(SPEC, tp=1, num_cpu_blocks=8, storage_backend="file",
                            storage_options={"root": str(tmp_path), "fsync": False})
    yield service
    service.shutdown()


def fill(svc, lease, salt: int) -> dict:
    """'Compute' the lease's blocks: distinct bytes per block; returns hash -> bytes of every view."""
    out = {}
    for i, (h, b) in enumerate(zip(lease.hashes, lease.gpu_blocks)):
        for key, view in views(svc).items():
            view[b] = (salt * 31 + i * 7 + hash(key) % 97) % 251
        out[h] = {key: view[b].copy() for key, view in views(svc).items()}
    return out


def run(cache, svc, hashes, salt, expect=None):
    lease = cache.acquire(hashes)
    if expect is not None:
        for i, s in enumerate(lease.sources):
            if s != "miss":
                for key, view in views(svc).items():
                    assert np.array_equal(view[lease.gpu_blocks[i]], expect[hashes[i]][key]), (i, s)
    content = fill(svc, lease, salt) if all(s == "miss" for s in lease.sources) else None
    cache.commit(lease)
    cache.release(lease)
    return lease, content


def test_lru_evicts_the_least_recent_block_to_host(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=8, write_policy="none")
    a, b, c = (chain_hash_ids([f"{name}{i}" for i in range(2)]) for name in "abc")
    run(cache, svc, a, 1)
    run(cache, svc, b, 2)
    lease, _ = run(cache, svc, a, 3)  # a is used again: b is now the oldest
    assert lease.sources == ["device", "device"]
    run(cache, svc, c, 4)
    assert all(cache.device_block_of(h) is not None for h in a + c)
    assert all(cache.device_block_of(h) is None and cache.host_slot_of(h) is not None for h in b)
    lease, _ = run(cache, svc, b, 5)
    assert lease.sources == ["host", "host"]
    assert cache.stats.swap_out_blocks >= 2 and cache.stats.swap_in_blocks == 2


def test_swapped_blocks_come_back_bit_exact(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=8, write_policy="none")
    a = chain_hash_ids(["x", "y", "z"])
    _, content = run(cache, svc, a, 7)
    run(cache, svc, chain_hash_ids(["p", "q", "r", "s"]), 8)  # pushes all of a out to host
    assert all(cache.host_slot_of(h) is not None for h in a)
    lease, _ = run(cache, svc, a, 9, expect=content)
    assert lease.sources == ["host"] * 3


def test_pinned_blocks_are_never_evicted(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=8, write_policy="none")
    a = chain_hash_ids(["a0", "a1", "a2", "a3"])
    lease = cache.acquire(a)  # all four blocks pinned by an unfinished request
    with pytest.raises(CapacityError, match="only 0 of 4 are unpinned"):
        cache.acquire(chain_hash_ids(["b0"]))
    assert all(cache.pinned(b) for b in lease.gpu_blocks)
    cache.commit(lease)
    cache.release(lease)
    assert not any(cache.pinned(b) for b in lease.gpu_blocks)
    cache.acquire(chain_hash_ids(["b0"]))  # now one of them can go


def test_write_through_pins_until_done_and_skips_what_is_stored(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=0, write_policy="write_through")
    a = chain_hash_ids(["w0", "w1"])
    lease, content = run(cache, svc, a, 11)
    assert all(cache.pinned(b) for b in lease.gpu_blocks), "a write in flight must keep its blocks"
    cache.drain()
    assert not any(cache.pinned(b) for b in lease.gpu_blocks)
    assert cache.stats.storage_write_blocks == 2
    run(cache, svc, a, 12)  # device hits; nothing new to write
    cache.drain()
    assert cache.stats.storage_write_blocks == 2
    # no host tier: two new requests push a out of the device; it comes back from storage
    run(cache, svc, chain_hash_ids(["o0", "o1"]), 13)
    run(cache, svc, chain_hash_ids(["p0", "p1"]), 14)
    cache.drain()
    lease, _ = run(cache, svc, a, 15, expect=content)
    assert lease.sources == ["storage", "storage"]


def test_a_failed_load_falls_back_to_recompute(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=8, write_policy="none", task_timeout=5)
    a = chain_hash_ids(["f0", "f1"])
    run(cache, svc, a, 21)
    run(cache, svc, chain_hash_ids(["g0", "g1"]), 22)
    run(cache, svc, chain_hash_ids(["h0", "h1"]), 23)  # a is on host now
    assert all(cache.host_slot_of(h) is not None for h in a)
    os.kill(svc.pids()[0], signal.SIGKILL)
    deadline = 50
    while svc.procs[0].alive() and deadline:
        deadline -= 1
        import time

        time.sleep(0.1)
    lease = cache.acquire(a)
    assert lease.sources == ["miss", "miss"], "a failed swap-in must become a recompute, never stale bytes"
    assert cache.stats.failed_loads == 2
    cache.commit(lease)
    cache.release(lease)
    svc.restart_rank(0)
    assert len(cache._dev_free) + len(cache._dev_lru) == 4, "blocks leaked after a failed load"
