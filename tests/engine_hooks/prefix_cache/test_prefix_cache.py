"""TieredPrefixCache over real CTMs: LRU order, pinning, write-through, recompute on failure, and
(TP=2, one rank SIGSTOPped) the quarantine of what a timed-out task may still touch.  The write
policies are in test_prefix_cache_write_policies.py."""
import os
import signal
import time

import pytest

from engine_hooks.core.errors import RankDiedError, TaskTimeoutError
from engine_hooks.prefix_cache import CapacityError, TieredPrefixCache
from tests.prefix_cache_helpers import (LATE_TIMEOUT, _AnsweredNotReleased, assert_accounted, block_bytes_all_ranks,
                                        file_service, fill, run, spy, stopped)
from transfer_factory.keys import chain_hash_ids


@pytest.fixture
def svc(tmp_path):
    yield from file_service(tmp_path, tp=1)


@pytest.fixture
def svc2(tmp_path):
    yield from file_service(tmp_path, tp=2)


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
    # bytes from the ranks' reports, which know nothing of the cache's block counts
    per_block = block_bytes_all_ranks(svc)
    assert cache.stats.bytes_h2d == 2 * per_block
    assert cache.stats.bytes_d2h == cache.stats.swap_out_blocks * per_block
    assert cache.stats.bytes_to_storage == cache.stats.bytes_from_storage == 0


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


def test_write_through_counts_what_was_stored_and_skips_it_later(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=0, write_policy="write_through")
    a = chain_hash_ids(["w0", "w1"])
    lease, content = run(cache, svc, a, 11)
    assert cache.drain()
    assert not any(cache.pinned(b) for b in lease.gpu_blocks)
    assert cache.stats.storage_write_blocks == 2
    assert cache.stats.bytes_to_storage == 2 * block_bytes_all_ranks(svc)
    run(cache, svc, a, 12)  # device hits; nothing new to write
    assert cache.drain()
    assert cache.stats.storage_write_blocks == 2
    # no host tier: two new requests push a out of the device; it comes back from storage
    run(cache, svc, chain_hash_ids(["o0", "o1"]), 13)
    run(cache, svc, chain_hash_ids(["p0", "p1"]), 14)
    assert cache.drain()
    lease, _ = run(cache, svc, a, 15, expect=content)
    assert lease.sources == ["storage", "storage"]
    assert cache.stats.storage_read_blocks == 2
    assert cache.stats.bytes_from_storage == 2 * block_bytes_all_ranks(svc)


def test_a_write_in_flight_keeps_its_blocks_until_every_rank_released_it(svc2, monkeypatch):
    """Rank 1 stopped: the write-through cannot finish, then times out; its blocks stay pinned
    (never evicted, never handed to another request) until rank 1 has answered."""
    writes = spy(monkeypatch, svc2, "write_storage")
    cache = TieredPrefixCache(svc2, num_device_blocks=4, num_host_blocks=0, task_timeout=LATE_TIMEOUT,
                              release_wait=0.2)
    a = chain_hash_ids(["wf0", "wf1"])
    lease = cache.acquire(a)  # with rank 1 running: its storage read must answer (a miss)
    fill(svc2, lease, 31)
    cache.commit(lease)
    with stopped(svc2, 1):
        cache.release(lease)
        (blocks, future), = writes
        assert blocks == lease.gpu_blocks
        time.sleep(0.3)
        cache.reap()
        assert not future.done(), "rank 1 is stopped: the write cannot have finished"
        assert all(cache.pinned(b) for b in blocks), "a write in flight must keep its blocks"
        # (a request needing only 2 blocks would get the 2 free ones, then stall on a storage read)
        with pytest.raises(CapacityError, match=r"only 2 of 4 are unpinned \(2 pinned, 2 of them by storage writes"):
            cache.acquire(chain_hash_ids(["x0", "x1", "x2"]))
        with pytest.raises(TaskTimeoutError):
            future.result(LATE_TIMEOUT + 15)  # storage tasks: timeout + the service's grace
        assert not future.released.done()
        cache.reap()
        assert all(cache.pinned(b) for b in blocks), "a timed-out write keeps its blocks until released"
        assert cache.block_counts()["writing"] == 2
    future.released.result(10)  # rank 1 answers the stale task (never started): released
    cache.reap()
    assert not any(cache.pinned(b) for b in blocks)
    assert cache.stats.storage_write_blocks == 0, "nothing was stored on every rank"
    per_rank = block_bytes_all_ranks(svc2) // 2
    assert cache.stats.bytes_to_storage in (0, 2 * per_rank), "only rank 0 can have stored anything"
    assert a[0] not in cache.stored_hashes
    assert_accounted(cache)


def test_a_timed_out_swap_in_quarantines_its_blocks_and_slots_until_released(svc2, monkeypatch):
    """Rank 1 stopped during a swap-in: the request computes into fresh blocks; the swap-in's
    blocks and slots go to no one until rank 1 has answered; the bytes stay right."""
    swap_ins = spy(monkeypatch, svc2, "swap_to_gpu")
    cache = TieredPrefixCache(svc2, num_device_blocks=4, num_host_blocks=8, write_policy="none", use_storage=False,
                              task_timeout=LATE_TIMEOUT, release_wait=0.2)
    a = chain_hash_ids(["s0", "s1"])
    _, content = run(cache, svc2, a, 41)
    x = cache.acquire(chain_hash_ids(["x0", "x1", "x2", "x3"]))  # pushes a to host
    cache.release(x)  # uncommitted: its 4 blocks go back to the free list
    slots = {cache.host_slot_of(h) for h in a}
    assert None not in slots and assert_accounted(cache)["free"] == 4
    with stopped(svc2, 1):
        lease = cache.acquire(a)
        (into, future), = swap_ins
        assert isinstance(future.exception(0), TaskTimeoutError) and not future.released.done()
        assert lease.sources == ["miss", "miss"], "a failed swap-in must become a recompute"
        assert set(into).isdisjoint(lease.gpu_blocks), "the late swap-in's blocks were handed to the request"
        assert cache.quarantined() == (set(into), slots)
        assert all(cache.host_slot_of(h) is None for h in a)
        counts = assert_accounted(cache)
        assert (counts["pinned"], counts["quarantined"], counts["host_quarantined"]) == (2, 2, 2)
        with pytest.raises(CapacityError, match=r"only 0 of 4 .* 2 quarantined until late tasks release them"):
            cache.acquire(chain_hash_ids(["y0"]))
        fill(svc2, lease, 41)  # the engine recomputes a: the same bytes as before
        cache.commit(lease)
        cache.release(lease)
        cache.reap()
        assert cache.quarantined() == (set(into), slots), "released before rank 1 answered"
    future.released.result(10)
    cache.reap()
    assert cache.quarantined() == (set(), set())
    counts = assert_accounted(cache)
    assert (counts["free"], counts["cached"], counts["host_quarantined"]) == (2, 2, 0)
    # the recomputed blocks hold the engine's bytes; out to host and back, still bit-exact
    run(cache, svc2, a, 0, expect=content)
    x = cache.acquire(chain_hash_ids(["x0", "x1", "x2", "x3"]))
    assert set(into) <= set(x.gpu_blocks), "released blocks are back in use"
    cache.release(x)
    lease, _ = run(cache, svc2, a, 0, expect=content)
    assert lease.sources == ["host", "host"]
    assert cache.stats.failed_loads == 2 and cache.stats.quarantined_blocks == 2


def test_a_timed_out_storage_read_quarantines_its_blocks_until_released(svc2, monkeypatch):
    reads = spy(monkeypatch, svc2, "read_storage")
    cache = TieredPrefixCache(svc2, num_device_blocks=4, num_host_blocks=0, task_timeout=LATE_TIMEOUT,
                              release_wait=0.2)
    a = chain_hash_ids(["r0", "r1"])
    _, content = run(cache, svc2, a, 51)
    assert cache.drain() and cache.stats.storage_write_blocks == 2
    x = cache.acquire(chain_hash_ids(["xr0", "xr1", "xr2", "xr3"]))  # drops a from the device
    cache.release(x)  # written through, uncommitted
    assert cache.drain() and assert_accounted(cache)["free"] == 4
    reads.clear()
    with stopped(svc2, 1):
        lease = cache.acquire(a)
        (into, future), = reads
        assert isinstance(future.exception(0), TaskTimeoutError) and not future.released.done()
        assert lease.sources == ["miss", "miss"]
        assert set(into).isdisjoint(lease.gpu_blocks), "the late read's blocks were handed to the request"
        assert cache.quarantined() == (set(into), set())
        fill(svc2, lease, 51)
        cache.commit(lease)
        cache.release(lease)  # a is stored already: nothing to write, unpinned at once
        cache.reap()
        assert cache.quarantined() == (set(into), set())
    future.released.result(10)
    assert cache.drain()
    assert cache.quarantined() == (set(), set()) and assert_accounted(cache)["free"] == 2
    run(cache, svc2, chain_hash_ids(["xr0", "xr1", "xr2", "xr3"]), 52)  # drops a again
    assert cache.drain()
    lease, _ = run(cache, svc2, a, 0, expect=content)
    assert lease.sources == ["storage", "storage"]


def test_a_failed_load_falls_back_to_recompute(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=8, write_policy="none", task_timeout=5)
    a = chain_hash_ids(["f0", "f1"])
    run(cache, svc, a, 21)
    run(cache, svc, chain_hash_ids(["g0", "g1"]), 22)
    run(cache, svc, chain_hash_ids(["h0", "h1"]), 23)  # a is on host now
    assert all(cache.host_slot_of(h) is not None for h in a)
    os.kill(svc.pids()[0], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while svc.procs[0].alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    lease = cache.acquire(a)
    assert lease.sources == ["miss", "miss"], "a failed swap-in must become a recompute, never stale bytes"
    assert cache.stats.failed_loads == 2
    cache.commit(lease)
    cache.release(lease)
    svc.restart_rank(0)
    cache.drop_host_tier()  # the new rank's swap space is empty
    cache.reap()
    # a dead rank touches nothing: what the failed swap-in held is back at once
    counts = assert_accounted(cache)
    assert counts["quarantined"] == 0 and counts["free"] + counts["cached"] == 4, "blocks leaked after a failed load"


def test_a_read_answered_but_not_released_keeps_its_blocks_out_of_use():
    svc = _AnsweredNotReleased()
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=0, write_policy="none", release_wait=0.1)
    lease = cache.acquire(chain_hash_ids(["n0", "n1"]))
    (into, future), = svc.reads
    assert lease.sources == ["miss", "miss"]
    assert set(into).isdisjoint(lease.gpu_blocks), "a read whose I/O still runs gave its blocks to be computed into"
    assert cache.quarantined() == (set(into), set())
    future.released.set_result(None)
    cache.reap()
    assert cache.quarantined() == (set(), set()) and cache.block_counts()["free"] == 2


def test_after_a_rank_is_restarted_by_the_service_host_blocks_are_recomputed_not_failed(svc2):
    cache = TieredPrefixCache(svc2, num_device_blocks=4, num_host_blocks=8, write_policy="none")
    a = chain_hash_ids(["r0", "r1", "r2"])
    run(cache, svc2, a, 31)
    run(cache, svc2, chain_hash_ids(["s0", "s1", "s2", "s3"]), 32)  # pushes all of a out to host
    assert all(cache.host_slot_of(h) is not None for h in a)
    replaced = svc2.rank_replacements
    os.kill(svc2.pids()[1], signal.SIGKILL)  # rank 1's swap space goes with it
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "the service did not restart rank 1"
        if svc2.rank_replacements > replaced:
            try:
                svc2.control("ping").result(timeout=10)
                break
            except RankDiedError:  # restarted, not yet serving
                pass
        time.sleep(0.1)
    failed = cache.stats.failed_loads
    lease, _ = run(cache, svc2, a, 33)  # rank 1's host copies are gone: recomputed
    assert lease.sources == ["miss"] * 3
    assert cache.stats.failed_loads == failed  # no swap-in was tried and failed
    assert all(cache.host_slot_of(h) is None for h in a)
