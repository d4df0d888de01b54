"""TieredPrefixCache over real CTMs: LRU order, pinning, write-through, recompute on failure, and
(TP=2, one rank SIGSTOPped) the quarantine of what a timed-out task may still touch."""
import contextlib
import os
import signal
import time
from concurrent.futures import Future

import numpy as np
import pytest

from engine_hooks import CacheSpec
from engine_hooks.errors import TaskTimeoutError
from engine_hooks.prefix_cache import WRITE_POLICIES, CapacityError, TieredPrefixCache
from tests.service_helpers import start_service, views
from transfer_factory.keys import chain_hash_ids

SPEC = CacheSpec(num_layers=2, num_blocks=4, kv_heads=1, block_size=4, head_dim=8)
LATE_TIMEOUT = 1.0  # task timeout of the stalled-rank tests: short, the rank is stopped anyway
PLUGIN_ENV = {"CTM_STORAGE_PLUGINS": "latched=tests.latched_store:LatchedStore"}


@pytest.fixture
def svc(tmp_path):
    service = start_service(SPEC, tp=1, num_cpu_blocks=8, storage_backend="file",
                            storage_options={"root": str(tmp_path), "fsync": False})
    yield service
    service.shutdown()


@pytest.fixture
def svc2(tmp_path):
    service = start_service(SPEC, tp=2, num_cpu_blocks=8, storage_backend="file",
                            storage_options={"root": str(tmp_path), "fsync": False})
    yield service
    service.shutdown()


@contextlib.contextmanager
def stopped(svc, rank: int):
    """Rank ``rank``'s CTM SIGSTOPped (alive, answering nothing) for the block; SIGCONT after."""
    pid = svc.pids()[rank]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def spy(monkeypatch, svc, method: str) -> list:
    """Record (gpu block ids, future) of every ``svc.<method>`` call the cache makes."""
    calls = []
    real = getattr(svc, method)

    def wrapper(*args, **kw):
        future = real(*args, **kw)
        gpu = kw.get("gpu_block_ids", args[1] if method in ("read_storage", "write_storage") else args[0])
        calls.append((list(gpu), future))
        return future

    monkeypatch.setattr(svc, method, wrapper)
    return calls


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


def block_bytes_all_ranks(svc) -> int:
    """Bytes of one block over every rank, kind and layer: what one block's move reports in total."""
    return sum(view.shape[1] for view in views(svc).values())


def assert_accounted(cache) -> dict:
    counts = cache.block_counts()
    assert (counts["free"] + counts["cached"] + counts["pinned"] + counts["quarantined"] + counts["bounce"]
            == cache.num_device_blocks), counts
    assert counts["host_free"] + counts["host_cached"] + counts["host_quarantined"] == cache.num_host_blocks, counts
    return counts


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


class _AnsweredNotReleased:
    """A service whose storage reads answer in time with 0 blocks while a direct backend call of
    theirs still runs (``released`` pending): the case real ranks report with ``released=False``."""

    def __init__(self):
        self.spec = SPEC
        self.num_cpu_blocks = 0
        self.reads = []

    def read_storage(self, keys, gpu_block_ids, start_read_block_idx=0, timeout=None):
        future = Future()
        future.released = Future()
        future.set_result([])
        self.reads.append((list(gpu_block_ids), future))
        return future


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


# ---------------------------------------------------------------------------- write policies
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
    block unwritten rather than reuse it.  The late write stores the right bytes."""
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
        (latch / "batch_set").unlink()  # the late write goes on, from its snapshot: a's bytes
        deadline = time.monotonic() + 10
        while not all((latch / f"batch_set.done.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the late write never returned"
            time.sleep(0.01)
        lease, _ = run(cache, svc, a, 0, expect=content)
        assert lease.sources == ["storage"]
        assert cache.drain()
        assert_accounted(cache)
    finally:
        svc.shutdown()
