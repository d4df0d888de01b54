"""Tenant salts across instances (DESIGN §4.2): a request exposed or reserved under one tenant's
``cache_salt`` never serves another tenant's request.  A pull naming another salt counts no block
(the prefill's board holds a word only the same salt names); a push of another tenant's request
matches no reservation and writes no byte (every prefill rank checks it before its first byte).
The same salt, and no salt at all, behave as before salts existed.  Same-host path and Transfer
Engine.  Before salts reached P/D, the pull with the other tenant's salt loaded both blocks."""
import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from tests.pd_helpers import blocks_any, fill_any, link_both, pair_fixtures
from transfer_factory.peer.handles import board_id

SPEC = CacheSpec(num_layers=3, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)

pair, npu_pair = pair_fixtures(SPEC, num_cpu_blocks=8)


@pytest.fixture(params=["ipc", "mooncake"])
def linked(request, pair):
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, 61)
    fill_any(d_svc, 62)
    link_both(p, d, request.param)
    return pair


def same(got: dict, want: dict) -> bool:
    return all(np.array_equal(got[key], want[key]) for key in want)


def test_a_pull_counts_blocks_only_for_the_tenant_that_exposed_them(linked):
    p_svc, d_svc, p, d = linked
    want = blocks_any(p_svc, [3, 4])
    handle = p.expose("req-salted", cache_salt="tenant-a")
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", handle, [3, 4], [10, 11], cache_salt="tenant-b").result(timeout=20)
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", handle, [3, 4], [10, 11]).result(timeout=20)  # no salt is another tenant too
    assert d.pull_blocks("prefill-0", handle, [3, 4], [12, 13], cache_salt="tenant-a").result(timeout=20) == [12, 13]
    assert same(blocks_any(d_svc, [12, 13]), want)
    assert p.retract(handle)


def test_an_unsalted_exposure_is_pulled_as_before_and_not_by_a_salted_request(linked):
    p_svc, d_svc, p, d = linked
    want = blocks_any(p_svc, [5])
    handle = p.expose("req-plain")
    assert board_id(handle.handle_id, None) == handle.handle_id and board_id(handle.handle_id, "") == handle.handle_id
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", handle, [5], [14], cache_salt="tenant-a").result(timeout=20)
    assert d.pull_blocks("prefill-0", handle.to_wire(), [5], [15]).result(timeout=20) == [15]
    assert same(blocks_any(d_svc, [15]), want)
    assert p.retract(handle)


def test_a_push_of_another_tenants_request_writes_nothing(linked):
    p_svc, d_svc, p, d = linked
    target = d.receive_push("prefill-0", [20, 21], timeout=20, cache_salt="tenant-a")
    before = blocks_any(d_svc, [20, 21])
    for other in ("tenant-b", None):
        with pytest.raises(TaskFailedError, match="another tenant"):
            p.push_blocks("decode-0", target.ticket, [1, 2], layerwise=False, timeout=20,
                          cache_salt=other).result(timeout=20)
        assert same(blocks_any(d_svc, [20, 21]), before), f"a push salted {other!r} wrote the reservation"
    want = blocks_any(p_svc, [1, 2])
    p.push_blocks("decode-0", target.ticket, [1, 2], layerwise=False, timeout=20,
                  cache_salt="tenant-a").result(timeout=20)
    assert target.result(timeout=20) == [20, 21] and target.close()
    assert same(blocks_any(d_svc, [20, 21]), want)


def test_a_bad_salt_is_refused_naming_it(pair):
    p_svc, d_svc, p, d = pair
    with pytest.raises(ValueError, match="cache_salt"):
        p.expose("req-bad", cache_salt=b"bytes")
    with pytest.raises(ValueError, match="cache_salt"):
        p.expose("req-long", cache_salt="x" * 300)
    assert p.board.live() == [] or all(h.req_id not in ("req-bad", "req-long") for h in p.board.live())
