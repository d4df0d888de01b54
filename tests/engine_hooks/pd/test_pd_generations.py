"""Generations across prefill/decode links (DESIGN §3.8, §3.11): a link made to one generation of an
engine's caches moves no byte that counts once that memory is replaced, on either side and on every
transport.  Each test replaces the memory for real (an RL ``clear_caches`` + ``restore_caches``,
which re-creates every cache segment, or a new prefill/decode side on the same service), then
checks what the engine sees, byte for byte.

Before generations: after the prefill's clear+restore a pull over the old link answered its blocks
with the old (freed) segments' bytes; after the decode's, a push reported landed while the decode's
new caches kept stale bytes; a second ``PrefillDecode`` made every Transfer Engine pull fail.
"""
import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import CachesClearedError, TaskFailedError
from engine_hooks.pd import PrefillDecode
from engine_hooks.pd.push import PushFailed
from tests.pd_helpers import blocks_any, fill_any, link_both, pair_fixtures, pair_for

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)

pair, npu_pair = pair_fixtures(SPEC, num_cpu_blocks=8)

TRANSPORTS = ["ipc", "mooncake", "datadist"]


def replace_caches(svc, seed: int, how: str = "rl") -> None:
    """Every cache segment freed and created anew, then filled: an RL weight update (``rl``) or
    FastDeploy's sleep and wakeup (``sleep``), the two faces of one cache lifecycle."""
    if how == "rl":
        svc.clear_caches(timeout=30)
        svc.restore_caches(timeout=60)
    else:
        svc.sleep(timeout=30)
        svc.wakeup(timeout=60)
    fill_any(svc, seed)


def assert_blocks(svc, ids, want, what: str) -> None:
    got = blocks_any(svc, ids)
    for key, value in want.items():
        assert np.array_equal(got[key], value), f"{what}: {key} differs"


@pytest.mark.parametrize("how", ["rl", "sleep"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_over_a_link_to_replaced_prefill_caches_is_refused_and_a_new_link_pulls_the_new_bytes(
        request, transport, how):
    p_svc, d_svc, p, d = pair_for(request, transport)
    fill_any(p_svc, 11)
    fill_any(d_svc, 12)
    link_both(p, d, transport, chosen="auto" if transport == "datadist" else None)
    stale = p.expose("req-before")
    replace_caches(p_svc, 13, how)
    before = blocks_any(d_svc, [5, 6])
    handle = p.expose("req-after")
    # (LLM-DataDist: the prefill rank closed its endpoint before its memory went, tearing the link down)
    with pytest.raises(TaskFailedError, match="replaced its caches|closed its prefill/decode side|torn down"):
        d.pull_blocks("prefill-0", handle, [1, 2], [5, 6]).result(timeout=20)
    assert_blocks(d_svc, [5, 6], before, "a refused pull wrote the decode's blocks")  # nothing moved
    # described and linked again: the new memory's bytes, and the old handle is gone
    link_both(p, d, transport, chosen="auto" if transport == "datadist" else None)
    want = blocks_any(p_svc, [1, 2])
    assert d.pull_blocks("prefill-0", handle, [1, 2], [5, 6]).result(timeout=20) == [5, 6]
    assert_blocks(d_svc, [5, 6], want, "pull after relink")
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", stale, [1], [7]).result(timeout=20)
    p.retract(handle)


@pytest.mark.parametrize("how", ["rl", "sleep"])
@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_push_over_a_link_to_replaced_decode_caches_fails_and_a_new_link_lands_in_the_new_caches(
        request, transport, how):
    p_svc, d_svc, p, d = pair_for(request, transport)
    fill_any(p_svc, 21)
    link_both(p, d, transport)
    replace_caches(d_svc, 22, how)
    before = blocks_any(d_svc, [3, 4])
    target = d.receive_push("prefill-0", [3, 4], timeout=20)
    future = p.push_blocks("decode-0", target.ticket, [8, 9], layerwise=False, timeout=20)
    with pytest.raises(PushFailed):
        target.result(timeout=20)
    with pytest.raises(TaskFailedError, match="replaced its caches|closed its prefill/decode side"):
        future.result(timeout=20)
    assert target.wait_released(5) and target.close()
    assert_blocks(d_svc, [3, 4], before, "a refused push")
    link_both(p, d, transport)
    want = blocks_any(p_svc, [8, 9])
    target = d.receive_push("prefill-0", [3, 4], timeout=20)
    p.push_blocks("decode-0", target.ticket, [8, 9], layerwise=False, timeout=20).result(timeout=20)
    assert target.result(timeout=20) == [3, 4]
    assert_blocks(d_svc, [3, 4], want, "push after relink")
    assert target.close()


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_pull_during_the_prefill_clear_counts_nothing(request, transport):
    """The prefill's clear begins while the decode's link is live: from the first moment of the
    clear no pull counts (the generation word goes first, before any rank lets go)."""
    p_svc, d_svc, p, d = pair_for(request, transport)
    link_both(p, d, transport)
    handle = p.expose("req-clear")
    p_svc.clear_caches(timeout=30)
    try:
        with pytest.raises(TaskFailedError, match="closed its prefill/decode side or is replacing|no longer exposed"):
            d.pull_blocks("prefill-0", handle, [1], [1]).result(timeout=20)
        with pytest.raises(RuntimeError, match="being replaced"):
            p.descriptor()
    finally:
        p_svc.restore_caches(timeout=60)
    link_both(p, d, transport)


def test_an_asleep_service_refuses_tasks_until_its_wakeup_and_its_links_until_relinked(pair):
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, 25)
    link_both(p, d, "ipc")
    handle = p.expose("req-asleep")
    p_svc.sleep(timeout=30)
    try:
        with pytest.raises(CachesClearedError, match="wakeup"):
            p_svc.swap_to_cpu([1], [1]).result(timeout=20)
        with pytest.raises(TaskFailedError, match="closed its prefill/decode side or is replacing|no longer exposed"):
            d.pull_blocks("prefill-0", handle, [1], [1]).result(timeout=20)
    finally:
        p_svc.wakeup(timeout=60)
    fill_any(p_svc, 26)
    want = blocks_any(p_svc, [3])
    p_svc.swap_to_cpu([3], [2]).result(timeout=20)  # serving again, on the new caches
    p_svc.swap_to_gpu([4], [2]).result(timeout=20)
    assert_blocks(p_svc, [4], want, "a swap after the wakeup")
    link_both(p, d, "ipc")


def test_a_second_prefill_decode_side_on_a_service_serves_transfer_engine_pulls(pair):
    """(Last in this module: it closes the pair's prefill side.)  A new P/D session gets a new exposure board; the ranks' Transfer Engine registers it (and
    drops the old one) instead of serving the first board it saw."""
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, 31)
    link_both(p, d, "mooncake")
    first = p.expose("req-first")
    assert d.pull_blocks("prefill-0", first, [1], [9]).result(timeout=20) == [9]
    p.close()
    with pytest.raises(TaskFailedError, match="closed its prefill/decode side|no answer|failed|refused"):
        d.pull_blocks("prefill-0", first, [1], [9]).result(timeout=20)
    second = PrefillDecode(p_svc, "prefill-1")
    try:
        d.link(second.descriptor(["ipc", "mooncake"]), transport="mooncake")
        want = blocks_any(p_svc, [2, 3])
        handle = second.expose("req-second")
        assert d.pull_blocks("prefill-1", handle, [2, 3], [10, 11]).result(timeout=20) == [10, 11]
        assert_blocks(d_svc, [10, 11], want, "pull through the second side")
    finally:
        second.close()
