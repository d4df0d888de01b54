"""Which transport a link takes when both instances share a kernel (one boot id) but not ``/dev/shm``:
two containers on one node.  ``auto`` picked ``ipc`` from the boot id alone and the link failed with
``No such file or directory``, with no fallback although both sides offered the Transfer Engine.

On one host, the peer's segments are made unreachable by naming segments that do not exist in its
descriptor (what a rank in another container sees)."""
import copy

import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from engine_hooks.pd import offer_for
from tests.pd_helpers import blocks_any, fill_any, pair_fixtures

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)

pair, _npu_pair = pair_fixtures(SPEC, num_cpu_blocks=4)


def elsewhere(descriptor: dict) -> dict:
    """``descriptor`` as a rank in another container reads it: the same boot id, segments it cannot open."""
    other = copy.deepcopy(descriptor)
    for rank in other["ranks"]:
        for region in rank["transports"]["ipc"]["regions"]:
            region[2] = "ctm.elsewhere." + region[2]
    return other


def test_a_peer_on_this_kernel_whose_shared_memory_is_not_here_is_linked_over_the_next_transport(pair):
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, seed=61)
    fill_any(d_svc, seed=62)
    theirs = elsewhere(p.descriptor(offer_for("mooncake")))
    with pytest.raises(Exception, match="ctm.elsewhere.*No such file"):
        d.link(theirs, transport="ipc")  # forced: refused naming the segment, no fallback
    # both offer ipc and the Transfer Engine, as a deployment across containers would
    assert d.link(theirs, transport="auto", offer=offer_for("mooncake")) == "mooncake"
    src, dst = [1, 2, 3], [5, 6, 7]
    want = blocks_any(p_svc, src)
    handle = p.expose("req-c")
    assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=30) == dst
    got = blocks_any(d_svc, dst)
    for key in want:
        assert np.array_equal(got[key], want[key]), f"{key} differs after the pull"
    assert p.retract(handle)
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", handle, src, dst).result(timeout=30)
    assert d.unlink("prefill-0")
