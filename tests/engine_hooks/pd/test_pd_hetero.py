"""Prefill and decode instances of different TP sizes (DESIGN §3.11, "Heterogeneous TP"): each
decode rank reads the kv heads it owns from the prefill ranks that hold them, and a push writes
each prefill rank's heads into the decode ranks that own them.  Checked bit for bit on the model's
*global* heads: rank r's heads of a block are heads [r * h, (r + 1) * h) of the model's."""
import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from tests.pd_helpers import link_both, local_instance
from tests.service_helpers import fill_distinct, views

HEADS = 4  # kv heads of the model, split over the ranks


def spec(tp: int, mla: bool = False, dtype: str = "bfloat16") -> CacheSpec:
    heads = 1 if mla else HEADS // tp
    return CacheSpec(num_layers=3, num_blocks=24, kv_heads=heads, block_size=4, head_dim=8, mla=mla, cache_dtype=dtype)


def global_blocks(svc, ids: list[int], mla: bool = False) -> dict:
    """(kind, layer) -> [len(ids), model heads, head bytes]: every rank's heads side by side (MLA:
    one array per rank, the latent being replicated)."""
    by_rank: dict = {}
    for (rank, kind, layer), view in views(svc).items():
        blocks = view[ids].reshape(len(ids), svc.spec.kv_heads, -1)
        by_rank.setdefault((kind, layer), {})[rank] = blocks
    if mla:
        return {key: [ranks[r] for r in sorted(ranks)] for key, ranks in by_rank.items()}
    return {key: np.concatenate([ranks[r] for r in sorted(ranks)], axis=1) for key, ranks in by_rank.items()}


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in got:
        assert np.array_equal(got[key], want[key]), f"{key} differs"


def unlink_both(p, d) -> None:
    assert p.unlink("decode-0") and d.unlink("prefill-0")


@pytest.fixture
def instances(request):
    p_tp, d_tp, dtype = request.param
    with local_instance(spec(p_tp, dtype=dtype), "prefill-0", tp=p_tp, num_cpu_blocks=8) as (p_svc, p), \
            local_instance(spec(d_tp, dtype=dtype), "decode-0", tp=d_tp, num_cpu_blocks=8) as (d_svc, d):
        fill_distinct(p_svc, seed=71)
        fill_distinct(d_svc, seed=72)
        yield p_svc, d_svc, p, d


@pytest.mark.parametrize("instances", [(1, 2, "bfloat16"), (2, 1, "bfloat16"), (2, 4, "block_wise_fp8"),
                                       (4, 2, "bfloat16")], indirect=True, ids=["1:2", "2:1", "2:4-fp8", "4:2"])
def test_pull_and_push_between_tp_sizes_are_bit_exact_on_both_transports(instances):
    p_svc, d_svc, p, d = instances
    for transport in ("ipc", "mooncake"):
        link_both(p, d, transport)
        src, dst = [3, 4, 5, 11], [20, 2, 3, 9]
        handle = p.expose(f"req-{transport}")
        assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=30) == dst, transport
        same(global_blocks(d_svc, dst), global_blocks(p_svc, src))
        host = d.pull_blocks("prefill-0", handle, [7, 8], [1, 6], placement="host").result(timeout=30)
        assert host == [1, 6]
        assert d_svc.swap_to_gpu([14, 15], [1, 6]).result(timeout=30)
        same(global_blocks(d_svc, [14, 15]), global_blocks(p_svc, [7, 8]))
        p.retract(handle)

        src, dst = [12, 13, 1], [4, 21, 22]
        target = d.receive_push("prefill-0", dst, timeout=30)
        future = p.push_blocks("decode-0", target.ticket, src, layerwise=True, timeout=30)
        for layer in range(3):
            future.layer_computed(layer + 1)
            target.wait_for_layer(layer, timeout=20)
        assert target.result(timeout=20) == dst and future.result(timeout=20) == dst
        same(global_blocks(d_svc, dst), global_blocks(p_svc, src))
        assert target.released and target.close()
        unlink_both(p, d)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_mla_latents_come_whole_from_one_prefill_rank(p_tp, d_tp):
    with local_instance(spec(p_tp, mla=True), "prefill-0", tp=p_tp, num_cpu_blocks=8) as (p_svc, p), \
            local_instance(spec(d_tp, mla=True), "decode-0", tp=d_tp, num_cpu_blocks=8) as (d_svc, d):
        fill_distinct(p_svc, seed=73)
        fill_distinct(d_svc, seed=74)
        link_both(p, d, "ipc")
        handle = p.expose("req-mla")
        assert d.pull_blocks("prefill-0", handle, [2, 3], [5, 6]).result(timeout=30) == [5, 6]
        source = global_blocks(p_svc, [2, 3], mla=True)
        for key, ranks in global_blocks(d_svc, [5, 6], mla=True).items():
            for rank, got in enumerate(ranks):
                assert np.array_equal(got, source[key][rank % p_tp]), (key, rank)
        target = d.receive_push("prefill-0", [9, 10], timeout=30)
        future = p.push_blocks("decode-0", target.ticket, [7, 8], layerwise=False, timeout=30)
        assert target.result(timeout=20) == [9, 10] and future.result(timeout=20) == [9, 10]
        assert target.writers == list(range(min(p_tp, d_tp)))  # every decode rank is written once
        source = global_blocks(p_svc, [7, 8], mla=True)
        for key, ranks in global_blocks(d_svc, [9, 10], mla=True).items():
            for rank, got in enumerate(ranks):
                assert np.array_equal(got, source[key][rank % p_tp]), (key, rank)
        assert target.close()


def test_instances_whose_heads_differ_in_all_are_refused_naming_the_field():
    with local_instance(spec(2), "prefill-0", tp=2, num_cpu_blocks=0) as (p_svc, p), \
            local_instance(CacheSpec(num_layers=3, num_blocks=24, kv_heads=1, block_size=4, head_dim=8),
                           "decode-0", tp=2, num_cpu_blocks=0) as (d_svc, d):
        with pytest.raises(Exception, match="kv_heads x tp"):
            d.link(p.descriptor())
        assert d.linked() == {}
