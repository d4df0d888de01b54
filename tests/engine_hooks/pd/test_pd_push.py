"""Layer-wise push between two real engine instances on this host (DESIGN §3.11, LLM-DataDist's
``push_cache``): the prefill ranks write each layer as the engine says it is computed, and the
decode engine's ``wait_for_layer(i)`` returns once layer i landed on every rank, bit-exact; over the
same-host path, the Transfer Engine, or LLM-DataDist (``--platform npu`` over the stand-ins)."""
import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.layerwise import LayerWaitTimeout
from tests.pd_helpers import blocks_any, fill_any, link_both, pair_fixtures, pair_for

SPEC = CacheSpec(num_layers=4, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)

pair, npu_pair = pair_fixtures(SPEC, num_cpu_blocks=8)


@pytest.mark.parametrize("transport", ["ipc", "mooncake", "datadist"])
def test_a_layerwise_push_lands_layer_by_layer_bit_exact(request, transport):
    p_svc, d_svc, p, d = pair_for(request, transport)
    fill_any(p_svc, seed=61)
    fill_any(d_svc, seed=62)
    link_both(p, d, transport)
    src, dst = [2, 3, 4, 9], [12, 13, 14, 1]
    want, before = blocks_any(p_svc, src), blocks_any(d_svc, dst)
    target = d.receive_push("prefill-0", dst, timeout=20)
    future = p.push_blocks("decode-0", target.ticket, src, layerwise=True, timeout=20)
    for layer in range(SPEC.num_layers):
        with pytest.raises(LayerWaitTimeout):
            target.wait_for_layer(layer, timeout=0.2)  # not computed yet: nothing may be reported
        got = blocks_any(d_svc, dst)
        for (rank, kind, l), value in got.items():
            if l >= layer:
                assert np.array_equal(value, before[(rank, kind, l)]), f"layer {l} written before it was computed"
        future.layer_computed(layer + 1)
        target.wait_for_layer(layer, timeout=10)
        got = blocks_any(d_svc, dst)
        for (rank, kind, l), value in got.items():
            if l <= layer:
                assert np.array_equal(value, want[(rank, kind, l)]), f"rank {rank} {kind} layer {l} after {layer}"
    assert target.result(timeout=10) == dst
    assert future.result(timeout=10) == dst
    assert target.released and target.close()


@pytest.mark.parametrize("transport", ["ipc", "datadist"])
def test_a_push_whose_prefill_rank_fails_fails_the_decode_wait_and_releases(request, transport):
    p_svc, d_svc, p, d = pair_for(request, transport)
    link_both(p, d, transport)
    target = d.receive_push("prefill-0", [1, 2], timeout=20)
    future = p.push_blocks("decode-0", target.ticket, [1, 10**6], layerwise=False, timeout=20)
    with pytest.raises(Exception, match="gave up|outside|out of range"):
        target.wait_for_layer(0, timeout=10)
    with pytest.raises(Exception):
        future.result(timeout=10)
    assert target.wait_released(5) and target.close()


def test_a_push_into_an_unlinked_instance_or_with_a_foreign_ticket_is_refused(pair):
    p_svc, d_svc, p, d = pair
    link_both(p, d, "ipc")
    target = d.receive_push("prefill-0", [1], timeout=5)
    with pytest.raises(ValueError, match="not linked"):
        p.push_blocks("elsewhere", target.ticket, [1])
    with pytest.raises(ValueError, match="ticket"):
        p.push_blocks("decode-0", {**target.ticket, "instance_id": "other"}, [1])
    with pytest.raises(ValueError, match="reserved"):
        p.push_blocks("decode-0", target.ticket, [1, 2])
    with pytest.raises(ValueError, match="not linked"):
        d.receive_push("elsewhere", [1])


def test_a_ticket_never_pushed_can_be_cancelled_and_one_pushed_cannot(pair):
    p_svc, d_svc, p, d = pair
    link_both(p, d, "ipc")
    unused = d.receive_push("prefill-0", [3], timeout=5)
    assert unused.cancel()
    target = d.receive_push("prefill-0", [4], timeout=20)
    p.push_blocks("decode-0", target.ticket, [4], layerwise=False).result(timeout=20)
    assert not target.cancel()  # a rank wrote: only released says when the slot may go
    assert target.released and target.close()
