"""TieredPrefixCache write policies over real CTMs: write-back (from the host tier, through a bounce
block, or straight from the device), selective write-through after N hits, refused settings, and
(TP=2, one rank SIGSTOPped, or a latched store) the blocks a write in flight keeps."""
import time

import pytest

from engine_hooks.core.errors import TaskTimeoutError
from engine_hooks.prefix_cache import WRITE_POLICIES, CapacityError, TieredPrefixCache
from tests.prefix_cache_helpers import (LATE_TIMEOUT, SPEC, _AnsweredNotReleased, assert_accounted,
                                        block_bytes_all_ranks, file_service, run, spy, stopped)
from tests.service_helpers import start_service
from transfer_factory.keys import chain_hash_ids

PLUGIN_ENV = {"CTM_STORAGE_PLUGINS": "latched=tests.latched_store:LatchedStore"}


@pytest.fixture
def svc(tmp_path):
    yield from file_service(tmp_path, tp=1)


@pytest.fixture
def svc2(tmp_path):
    yield from file_service(tmp_path, tp=2)


def spy_writes(monkeypatch, svc) -> list:
    """Record (keys, gpu block ids, future) of every storage write the cache submits."""
    calls = []
    real = svc.write_storage

    def wrapper(keys, gpu_block_ids, *args, **kw):
        future = real(keys, gpu_block_ids, *args, **kw)
        calls.append((list(keys), list(gpu_block_ids), future))
        return future

    monkeypatch.setattr(svc, "write_storage", wrapper)
    return calls


def test_a_bad_write_policy_or_threshold_is_refused_by_name():
    svc = _AnsweredNotReleased()
    assert WRITE_POLICIES == ("write_through", "write_back", "write_through_selective", "none")
    with pytest.raises(ValueError, match="write_policy 'write_around' must be one of"):
        TieredPrefixCache(svc, 4, 0, write_policy="write_around")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"write_threshold {bad!r} must be a positive integer"):
            TieredPrefixCache(svc, 4, 0, write_policy="write_through_selective", write_threshold=bad)
    svc.num_cpu_blocks = 8
    with pytest.raises(ValueError, match="bounce_blocks 4 must be in 1..3"):
        TieredPrefixCache(svc, 4, 8, write_policy="write_back", bounce_blocks=4)
    with pytest.raises(ValueError, match="bounce_blocks 1 must be in 1..0"):
        TieredPrefixCache(svc, 1, 8, write_policy="write_back")  # no block left to cache


def test_write_back_writes_a_block_only_when_it_leaves_the_host_tier(svc, monkeypatch):
    """Host tier of 2 slots: nothing is written while blocks sit on device or host; a block the
    host LRU gives up is swapped into the bounce block and written from there, bit-exact."""
    writes = spy_writes(monkeypatch, svc)
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=2, write_policy="write_back")
    assert assert_accounted(cache)["bounce"] == 1, "one block of 4 kept apart: 3 cache"
    a, b = chain_hash_ids(["wa0", "wa1"]), chain_hash_ids(["wb0"])
    c, d = chain_hash_ids(["wc0", "wc1"]), chain_hash_ids(["wd0", "wd1"])
    _, content_a = run(cache, svc, a, 61)
    _, content_b = run(cache, svc, b, 62)
    run(cache, svc, c, 63)  # a goes to host
    assert cache.drain() and all(cache.host_slot_of(h) is not None for h in a)
    assert writes == [] and cache.stats.storage_write_blocks == 0, "nothing left the cache, nothing is written"
    run(cache, svc, d, 64)  # b and c's first block go to host: the host LRU gives a up
    assert cache.drain()
    assert [keys for keys, _, _ in writes] == [[a[0]], [a[1]]], "a, and only a, is written, each block once"
    assert all(blocks == [3] for _, blocks, _ in writes), "written from the bounce block"
    assert cache.stats.storage_write_blocks == 2 and all(cache.host_slot_of(h) is None for h in a)
    per_block = block_bytes_all_ranks(svc)
    assert cache.stats.bytes_to_storage == 2 * per_block
    assert cache.stats.bytes_h2d == cache.stats.swap_in_blocks * per_block == 2 * per_block  # the bounces
    assert not cache.pinned(3) and assert_accounted(cache)["bounce"] == 1
    lease, _ = run(cache, svc, a, 0, expect=content_a)  # read back from storage
    assert lease.sources == ["storage", "storage"]
    assert cache.drain()
    assert b[0] in {k for keys, _, _ in writes for k in keys}, "b left the host for a: written now"
    lease, _ = run(cache, svc, b, 0, expect=content_b)
    assert lease.sources == ["storage"]
    assert cache.drain()
    written = [k for keys, _, _ in writes for k in keys]
    assert len(written) == len(set(written)) == cache.stats.storage_write_blocks, "a block written twice"
    assert_accounted(cache)


def test_write_back_without_a_host_tier_writes_a_dropped_block_before_reusing_it(svc, monkeypatch):
    writes = spy_writes(monkeypatch, svc)
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=0, write_policy="write_back")
    assert cache.block_counts()["bounce"] == 0, "no host tier, no bounce blocks"
    a = chain_hash_ids(["wn0", "wn1"])
    _, content = run(cache, svc, a, 65)
    run(cache, svc, chain_hash_ids(["wx0", "wx1"]), 66)
    assert cache.drain() and writes == []
    old = cache.device_block_of(a[0])
    lease, _ = run(cache, svc, chain_hash_ids(["wy0"]), 67)  # drops a[0]: written, then its block reused
    (keys, blocks, future), = writes
    assert (keys, blocks) == ([a[0]], [old]) and lease.gpu_blocks == [old]
    assert future.done() and future.released.done(), "the block was reused before its write was released"
    lease, _ = run(cache, svc, a, 0, expect=content)  # a[1] is dropped (written) to make room for a
    assert lease.sources == ["storage", "storage"]
    assert [k for keys, _, _ in writes for k in keys] == [a[0], a[1], chain_hash_ids(["wx0"])[0]]
    assert cache.drain() and cache.stats.storage_write_blocks == 3
    assert cache.stats.bytes_to_storage == 3 * block_bytes_all_ranks(svc)
    assert_accounted(cache)


def test_write_through_selective_writes_a_block_once_after_n_hits(svc, monkeypatch):
    writes = spy_writes(monkeypatch, svc)
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=0, write_policy="write_through_selective",
                              write_threshold=2)
    a = chain_hash_ids(["sel0", "sel1"])
    _, content = run(cache, svc, a, 71)  # computed: no hit yet
    run(cache, svc, a, 0, expect=content)  # one hit each
    assert cache.drain() and writes == []
    run(cache, svc, a[:1], 0, expect=content)  # sel0's second hit: written; sel1 has one
    assert cache.drain()
    assert [keys for keys, _, _ in writes] == [[a[0]]] and cache.stats.storage_write_blocks == 1
    run(cache, svc, a, 0, expect=content)  # sel1's second hit; sel0 is stored already
    for _ in range(2):
        run(cache, svc, a, 0, expect=content)  # more hits: nothing more to write
    assert cache.drain()
    assert [keys for keys, _, _ in writes] == [[a[0]], [a[1]]], "written once each, after two hits"
    assert cache.stats.storage_write_blocks == 2
    assert cache.stats.bytes_to_storage == 2 * block_bytes_all_ranks(svc)
    run(cache, svc, chain_hash_ids(["sx0", "sx1", "sx2", "sx3"]), 72)  # no host tier: a leaves the cache
    assert cache.drain() and len(writes) == 2, "blocks without a hit were written"
    lease, _ = run(cache, svc, a, 0, expect=content)
    assert lease.sources == ["storage", "storage"]
    assert cache.drain() and len(writes) == 2
    assert_accounted(cache)


def test_a_write_back_in_flight_keeps_its_blocks_until_every_rank_released_it(svc2, monkeypatch):
    """Rank 1 stopped: the write-back of a dropped block cannot finish, then times out; the block
    stays pinned (the allocation that evicted it gives up) until rank 1 has answered."""
    writes = spy(monkeypatch, svc2, "write_storage")
    cache = TieredPrefixCache(svc2, num_device_blocks=4, num_host_blocks=0, write_policy="write_back",
                              task_timeout=LATE_TIMEOUT, release_wait=0.2)
    a = chain_hash_ids(["bf0", "bf1"])
    run(cache, svc2, a, 81)
    run(cache, svc2, chain_hash_ids(["bg0", "bg1"]), 82)
    assert cache.drain() and writes == []
    victim = cache.device_block_of(a[0])
    with stopped(svc2, 1):
        with pytest.raises(CapacityError, match=r"write-backs of 1 evicted blocks not released after 0.2s "
                                                r"\(1 pinned, 1 of them by storage writes"):
            cache.acquire(chain_hash_ids(["by0"]))
        (blocks, future), = writes
        assert blocks == [victim] and not future.done()
        assert cache.device_block_of(a[0]) is None and cache.pinned(victim)
        counts = assert_accounted(cache)
        assert (counts["writing"], counts["cached"]) == (1, 3)
        with pytest.raises(TaskTimeoutError):
            future.result(LATE_TIMEOUT + 15)
        assert not future.released.done()
        cache.reap()
        assert cache.pinned(victim), "a timed-out write-back keeps its block until released"
    future.released.result(10)
    cache.reap()
    assert not cache.pinned(victim) and assert_accounted(cache)["free"] == 1
    assert cache.stats.storage_write_blocks == 0, "nothing was stored on every rank"
    assert cache.stats.bytes_to_storage in (0, block_bytes_all_ranks(svc2) // 2), "only rank 0 can have stored"
    lease, _ = run(cache, svc2, chain_hash_ids(["by0"]), 83)
    assert lease.gpu_blocks == [victim], "the released block is back in use"


def test_a_write_back_from_host_keeps_its_bounce_block_until_released(tmp_path, monkeypatch):
    """Every store write hangs (a latched FileStore): the bounce block of a host write-back stays
    pinned until the write is released; the next host eviction finds none free and drops its
    block unwritten rather than reuse it.  The late write stores nothing: its commit lease was
    revoked when the task answered (DESIGN §3.8, issue 24 item 10)."""
    latch = tmp_path / "latch"
    latch.mkdir()
    svc = start_service(SPEC, tp=2, num_cpu_blocks=8, storage_backend="latched", extra_env=PLUGIN_ENV,
                        storage_options={"root": str(tmp_path / "store"), "latch_dir": str(latch), "fsync": False})
    try:
        writes = spy(monkeypatch, svc, "write_storage")
        cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=1, write_policy="write_back",
                                  task_timeout=LATE_TIMEOUT, release_wait=0.2)
        a, b, c, d, e, f = (chain_hash_ids([f"bb{x}"]) for x in "abcdef")
        _, content = run(cache, svc, a, 91)
        for i, h in enumerate((b, c, d)):  # d evicts a to host
            run(cache, svc, h, 92 + i)
        assert cache.host_slot_of(a[0]) is not None and writes == []
        (latch / "batch_set").touch()  # store writes now hang after their snapshot
        run(cache, svc, e, 95)  # evicts b to host: the host gives a up, through the bounce block
        (blocks, future), = writes
        assert blocks == [3] and cache.pinned(3) and not future.done()
        assert cache.host_slot_of(a[0]) is None and cache.host_slot_of(b[0]) is not None
        dropped = cache.stats.dropped_blocks
        run(cache, svc, f, 96)  # evicts c to host: the host gives b up, and no bounce block is free
        assert len(writes) == 1 and cache.pinned(3), "the bounce block was reused while its write was in flight"
        assert cache.host_slot_of(b[0]) is None and cache.stats.dropped_blocks > dropped
        future.released.result(LATE_TIMEOUT + 15)  # the staged path answers by its timeout and lets go
        cache.reap()
        assert not cache.pinned(3) and assert_accounted(cache)["bounce"] == 1
        assert cache.stats.storage_write_blocks == 0
        (latch / "batch_set").unlink()  # the late write goes on and is refused at its commit
        deadline = time.monotonic() + 10
        while not all((latch / f"batch_set.done.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the late write never returned"
            time.sleep(0.01)
        lease, _ = run(cache, svc, a, 0, expect=content)
        assert lease.sources == ["miss"], "an object was stored after its task answered"
        assert cache.drain()
        assert_accounted(cache)
    finally:
        svc.shutdown()
