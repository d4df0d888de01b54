"""Prefill/decode pulls between two real engine instances on this host (DESIGN §3.11): each a
service with its own CTMs at TP=2, linked over the same-host path or the Mooncake Transfer Engine
over TCP, or (``--platform npu`` over the pyACL and LLM-DataDist stand-ins) over LLM-DataDist; every
pulled block bit-exact on every rank, kind and layer."""
import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from tests.pd_helpers import blocks_any, fill_any, link_both, pair_fixtures, pair_for
from tests.service_helpers import block_bytes, fill_distinct

SPEC = CacheSpec(num_layers=4, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)

pair, npu_pair = pair_fixtures(SPEC, num_cpu_blocks=8)


@pytest.mark.parametrize("transport", ["ipc", "mooncake", "datadist"])
def test_a_pull_copies_every_block_bit_exact_on_every_rank(request, transport):
    p_svc, d_svc, p, d = pair_for(request, transport)
    fill_any(p_svc, seed=41)
    fill_any(d_svc, seed=42)
    # NPU ranks: chosen by capability
    link_both(p, d, transport, chosen="auto" if transport == "datadist" else None)
    src, dst = [3, 4, 5, 9], [10, 2, 3, 7]
    want = blocks_any(p_svc, src)
    before = blocks_any(d_svc, range(d_svc.spec.num_blocks))
    handle = p.expose("req-1")
    assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=20) == dst
    got = blocks_any(d_svc, dst)
    for key in want:
        assert np.array_equal(got[key], want[key]), f"{key} differs after the pull"
    after = blocks_any(d_svc, range(d_svc.spec.num_blocks))
    untouched = [b for b in range(d_svc.spec.num_blocks) if b not in dst]
    for key in before:
        assert np.array_equal(after[key][untouched], before[key][untouched]), f"{key}: a block outside dst changed"
    assert p.retract(handle)


@pytest.mark.parametrize("transport", ["ipc", "mooncake", "datadist"])
def test_a_retracted_handle_is_refused_and_nothing_counts(request, transport):
    p_svc, d_svc, p, d = pair_for(request, transport)
    d.link(p.descriptor(["ipc", "datadist", "mooncake"]), transport=transport)
    handle = p.expose("req-2")
    assert p.retract(handle)
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", handle, [1], [1]).result(timeout=20)


def test_a_pull_from_an_unlinked_peer_or_with_bad_ids_is_refused(pair):
    p_svc, d_svc, p, d = pair
    handle = p.expose("req-3")
    try:
        with pytest.raises(ValueError, match="not linked"):
            d.pull_blocks("nobody", handle, [1], [1])
        with pytest.raises(ValueError, match="ids"):
            d.pull_blocks("prefill-0", handle, [1, 2], [1])
        d.link(p.descriptor(), transport="ipc")
        with pytest.raises(TaskFailedError, match="outside|out of range|capacity"):
            d.pull_blocks("prefill-0", handle, [10**6], [1]).result(timeout=20)
    finally:
        p.retract(handle)


def test_a_layout_that_differs_is_refused_at_link_naming_the_field(pair):
    p_svc, d_svc, p, d = pair
    peer = p.descriptor()
    for r in peer["ranks"]:
        r["layout"]["head_dim"] += 1
    with pytest.raises(Exception, match="head_dim"):
        d.link(peer)


@pytest.mark.parametrize("transport", ["ipc", "datadist"])
def test_a_pull_into_host_swap_space_then_swapped_in_is_bit_exact(request, transport):
    p_svc, d_svc, p, d = pair_for(request, transport)
    fill_any(p_svc, seed=43)
    d.link(p.descriptor(), transport=transport)
    src, slots, dst = [1, 2, 6], [5, 6, 7], [20, 21, 22]
    want = blocks_any(p_svc, src)
    handle = p.expose("req-host")
    try:
        assert d.pull_blocks("prefill-0", handle, src, slots, placement="host").result(timeout=20) == slots
    finally:
        p.retract(handle)
    d_svc.swap_to_gpu(dst, slots).result(timeout=20)
    got = blocks_any(d_svc, dst)
    for key in want:
        assert np.array_equal(got[key], want[key]), f"{key} differs after pull to host and swap-in"


@pytest.mark.parametrize("transport", ["ipc", "datadist"])
def test_a_layer_range_pull_touches_only_those_layers(request, transport):
    p_svc, d_svc, p, d = pair_for(request, transport)
    fill_any(p_svc, seed=44)
    fill_any(d_svc, seed=45)
    d.link(p.descriptor(), transport=transport)
    src, dst = [8, 9], [11, 12]
    want, before = blocks_any(p_svc, src), blocks_any(d_svc, dst)
    handle = p.expose("req-layers")
    try:
        d.pull_blocks("prefill-0", handle, src, dst, layers=(1, 3)).result(timeout=20)
    finally:
        p.retract(handle)
    got = blocks_any(d_svc, dst)
    for (rank, kind, layer), value in got.items():
        expect = want if 1 <= layer < 3 else before
        assert np.array_equal(value, expect[(rank, kind, layer)]), f"rank {rank} {kind} layer {layer}"


def test_unlinking_under_a_stream_of_pulls_fails_them_cleanly_and_never_crashes_a_rank(pair):
    p_svc, d_svc, p, d = pair
    fill_distinct(p_svc, seed=46)
    pids = d_svc.pids()
    src, dst = list(range(16)), list(range(16, 32))
    want = block_bytes(p_svc, src)
    handle = p.expose("req-unlink")
    outcomes = {"ok": 0, "refused": 0}
    try:
        for _ in range(15):
            d.link(p.descriptor(), transport="ipc")
            futures = [d.pull_blocks("prefill-0", handle, src, dst) for _ in range(4)]
            d.unlink("prefill-0")  # while those run or wait
            for future in futures:
                try:
                    assert future.result(timeout=20) == dst
                    outcomes["ok"] += 1
                    got = block_bytes(d_svc, dst)
                    assert all(np.array_equal(got[k], want[k]) for k in want)
                except TaskFailedError as exc:
                    assert "not linked" in str(exc)
                    outcomes["refused"] += 1
    finally:
        p.retract(handle)
    assert d_svc.pids() == pids, "a decode rank died (or was restarted) under unlink"
    assert sum(outcomes.values()) == 60


def test_a_decode_instance_maps_its_prefill_peers_caches_read_only(pair):
    """Launched as FastDeploy's decode role, a rank maps what it pulls from without write access: a
    bug in it cannot scribble on the prefill engine's KV.  (Every CTM used to run as ``mixed``.)"""
    from tests.pd_helpers import local_instance

    p_svc, _, p, _ = pair
    fill_distinct(p_svc, seed=47)
    with local_instance(SPEC, "decode-ro", num_cpu_blocks=8, splitwise_role="decode") as (d_svc, d):
        d.link(p.descriptor(), transport="ipc")
        handle = p.expose("req-ro")
        try:
            assert d.pull_blocks("prefill-0", handle, [1], [2]).result(timeout=20) == [2]
        finally:
            p.retract(handle)
        cache_names = {p_svc.platform.exported_region(t)[0] for layers in p_svc.caches.tensors[0].values()
                       for t in layers}
        for pid in d_svc.pids().values():
            with open(f"/proc/{pid}/maps") as f:
                mapped = [line.split() for line in f if any(name in line for name in cache_names)]
            assert mapped, f"decode rank pid {pid} maps none of the prefill's caches"
            assert all(cols[1].startswith("r-") for cols in mapped), f"writable peer mappings: {mapped[:2]}"
        with pytest.raises(ValueError, match="splitwise_role"):
            type(d_svc)(SPEC, splitwise_role="router")
