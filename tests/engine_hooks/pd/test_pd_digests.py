"""Digests on P/D bytes (DESIGN §3.11 "Digests", issue 36 item 3): two real engine instances at
TP=2 with ``PrefillDecode(..., digests=True)``; the prefill ranks digest the exposed blocks, the
decode ranks check what they pulled before they count a block, over the same-host path and the
Transfer Engine."""
import contextlib
import dataclasses

import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from engine_hooks.core.metrics import CacheMetrics
from engine_hooks.pd import PrefillDecode
from tests.pd_helpers import link_both
from tests.service_helpers import block_bytes, fill_distinct, start_service, views

SPEC = CacheSpec(num_layers=3, num_blocks=24, kv_heads=2, block_size=4, head_dim=8)


@contextlib.contextmanager
def side(instance: str, digests: bool, tp: int = 2):
    svc = start_service(dataclasses.replace(SPEC, kv_heads=SPEC.kv_heads * 2 // tp), tp=tp, num_cpu_blocks=8)
    try:
        pd = PrefillDecode(svc, instance, digests=digests)
        try:
            yield svc, pd
        finally:
            pd.close()
    finally:
        svc.shutdown()


@pytest.fixture(scope="module")
def pair():
    with side("prefill-0", True) as (p_svc, p), side("decode-0", True) as (d_svc, d):
        metrics = CacheMetrics()
        metrics.attach(d_svc.tracker)
        yield p_svc, d_svc, p, d, metrics


def assert_same(got: dict, want: dict) -> None:
    for key in want:
        assert np.array_equal(got[key], want[key]), f"{key} differs"


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_pull_with_digests_on_is_bit_exact_and_counted(pair, transport):
    p_svc, d_svc, p, d, _ = pair
    fill_distinct(p_svc, seed=1)
    link_both(p, d, transport)
    src, dst = [3, 4, 5, 9], [10, 2, 3, 7]
    handle = p.expose(f"req-ok-{transport}", blocks=src)
    assert handle.digests is not None
    future = d.pull_blocks("prefill-0", handle, src, dst)
    assert future.result(timeout=20) == dst
    assert_same(block_bytes(d_svc, dst), block_bytes(p_svc, src))
    assert all(r.digest_mismatches == 0 for r in future.rank_results.values())
    # a layer range, a subset of the exposed blocks and a pull into host swap slots are checked too
    assert d.pull_blocks("prefill-0", handle, [9, 4], [1, 0], layers=(1, 3)).result(timeout=20) == [1, 0]
    assert d.pull_blocks("prefill-0", handle, [5], [6], placement="host").result(timeout=20) == [6]
    assert p.retract(handle)


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_source_block_corrupted_after_exposure_fails_that_block_and_loads_the_others(pair, transport):
    p_svc, d_svc, p, d, metrics = pair
    fill_distinct(p_svc, seed=2)
    fill_distinct(d_svc, seed=3)
    link_both(p, d, transport)
    src, dst = [1, 2, 6, 8], [11, 12, 13, 14]
    handle = p.expose(f"req-bad-{transport}", blocks=src)
    before = metrics.snapshot().get("pd_digest_mismatches_total", 0)
    dst_before = block_bytes(d_svc, dst)
    want = block_bytes(p_svc, src)
    views(p_svc)[(1, "value_caches", 2)][6, 5] ^= 0xFF  # rank 1's V of layer 2 of block 6, after the digests
    with pytest.raises(TaskFailedError) as failed:
        d.pull_blocks("prefill-0", handle, src, dst).result(timeout=20)
    err = failed.value
    assert "prefill-0 rank 1" in str(err) and "block 6 -> 13" in str(err), str(err)
    assert err.loaded == [11, 12, 14]  # never block 13
    assert err.digest_mismatches == 1
    metrics.flush()
    assert metrics.snapshot()["pd_digest_mismatches_total"] == before + 1
    got = block_bytes(d_svc, [11, 12, 14])
    for (rank, kind, layer), value in got.items():
        assert np.array_equal(value, want[(rank, kind, layer)][[0, 1, 3]])
    # rank 0's copy of block 13 was whole, rank 1's holds the corrupted bytes: neither is reported
    assert not np.array_equal(block_bytes(d_svc, [13])[(1, "value_caches", 2)], dst_before[(1, "value_caches", 2)][[2]])
    assert p.retract(handle)


def test_a_block_reused_after_its_digests_is_never_counted(pair):
    """The prefill reuses a block under the same live handle (a bug the generations issue names):
    every byte of it changed, every tensor mismatches, the block fails on every rank."""
    p_svc, d_svc, p, d, _ = pair
    fill_distinct(p_svc, seed=4)
    link_both(p, d, "ipc")
    handle = p.expose("req-reused", blocks=[0, 1])
    for view in views(p_svc).values():
        view[1] = 0
    with pytest.raises(TaskFailedError, match="block 1 -> 5") as failed:
        d.pull_blocks("prefill-0", handle, [0, 1], [4, 5]).result(timeout=20)
    assert failed.value.loaded == [4] and failed.value.digest_mismatches == 2  # one block on each of 2 ranks
    assert p.retract(handle)


def test_a_decode_that_checks_refuses_a_prefill_that_publishes_none():
    with side("prefill-plain", False) as (p_svc, p), side("decode-1", True) as (d_svc, d):
        link_both(p, d, "ipc")
        handle = p.expose("req-plain")
        assert handle.digests is None
        with pytest.raises(ValueError, match="publishes no digests"):
            d.pull_blocks("prefill-plain", handle, [1], [1])
        assert p.retract(handle)


def test_expose_with_digests_on_needs_the_blocks_and_a_plain_decode_still_pulls(pair):
    p_svc, d_svc, p, d, _ = pair
    with pytest.raises(ValueError, match="blocks="):
        p.expose("req-no-blocks")
    with side("decode-plain", False) as (dp_svc, dp):
        fill_distinct(p_svc, seed=5)
        link_both(p, dp, "ipc")
        handle = p.expose("req-for-plain", blocks=[2])
        assert dp.pull_blocks("prefill-0", handle, [2], [3]).result(timeout=20) == [3]
        assert_same(block_bytes(dp_svc, [3]), block_bytes(p_svc, [2]))
        assert p.retract(handle)
        p.unlink("decode-plain")
    link_both(p, d, "ipc")
    handle = p.expose("req-stripped", blocks=[2])
    stripped = {k: v for k, v in handle.to_wire().items() if k != "digests"}  # a router that lost them
    with pytest.raises(ValueError, match="published no digests for request 'req-stripped'"):
        d.pull_blocks("prefill-0", stripped, [2], [3])
    assert p.retract(handle)


def test_digests_between_tp_sizes_are_refused_naming_both(pair):
    p_svc, _, p, _, _ = pair
    with side("decode-tp1", True, tp=1) as (d_svc, d):
        link_both(p, d, "ipc")
        handle = p.expose("req-tp", blocks=[1])
        with pytest.raises(ValueError, match="runs TP 2, this one TP 1"):
            d.pull_blocks("prefill-0", handle, [1], [1])
        assert p.retract(handle)
        p.unlink("decode-tp1")
