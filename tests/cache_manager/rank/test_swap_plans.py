"""SwapPlans: the kinds' swap plans merged by block shape, and rebuilt whenever the plans change."""
from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from cache_manager.rank.swap_plans import SwapPlans
from ops.layout import CopyPlan, Side
from tests.helpers import host_blocks_match, kv_swap_rig


def plan(base: int, block_bytes: int = 64, layers: int = 2) -> CopyPlan:
    bases = np.arange(layers, dtype=np.int64) * 10_000 + base
    caps = np.full(layers, 8, dtype=np.int64)
    return CopyPlan(Side("device", bases, caps, block_bytes), Side("host", bases + 5_000, caps, block_bytes),
                    block_bytes, None)


def test_kinds_of_one_block_shape_share_a_plan_and_other_shapes_keep_their_own():
    k, v, scale = plan(1 << 20), plan(2 << 20), plan(3 << 20, block_bytes=16)
    plans = SwapPlans()
    whole = plans.whole([k, v, scale])
    assert len(whole) == 2
    assert whole[0].device.bases.tolist() == k.device.bases.tolist() + v.device.bases.tolist()
    assert whole[0].host.bases.tolist() == k.host.bases.tolist() + v.host.bases.tolist()
    assert whole[1] is scale
    layers = plans.per_layer([k, v, scale])
    assert [[p.device.bases.tolist() for p in layer] for layer in layers] == [
        [[k.device.bases[0], v.device.bases[0]], [scale.device.bases[0]]],
        [[k.device.bases[1], v.device.bases[1]], [scale.device.bases[1]]]]
    assert plans.whole([k, v, scale]) is whole  # built once per set of plans


def test_plans_rebuilt_after_a_restore_are_never_served_from_the_old_ones():
    """An RL restore re-attaches the caches and builds new plans; the old plan objects are freed,
    and a new one may get the address of an old one.  The merged plans must follow the new plans:
    the cache keeps the plans it was built from alive, so no new plan can be mistaken for them."""
    plans = SwapPlans()
    for i in range(30):
        kinds = [plan((4 * i + 1) << 20), plan((4 * i + 2) << 20)]
        expected = [int(b) for p in kinds for b in p.device.bases]
        assert plans.whole(kinds)[0].device.bases.tolist() == expected
        assert [layer[0].device.bases.tolist() for layer in plans.per_layer(kinds)] == \
            [[expected[0], expected[2]], [expected[1], expected[3]]]
        alive = [weakref.ref(p) for p in kinds]
        del kinds
        gc.collect()
        assert all(ref() is not None for ref in alive), "the cache let go of the plans it was built from"


def test_a_whole_task_copy_through_merged_plans_is_bit_exact():
    with kv_swap_rig(f"sp{os.getpid()}", seed=1) as (platform, kinds):
        merged = SwapPlans().whole([plan for _, _, plan in kinds])
        assert len(merged) == 1
        for p in merged:
            platform.run_plan(p, [5, 2, 7], [0, 3, 1], 0)
        assert host_blocks_match(platform, kinds, [0, 3, 1], [5, 2, 7])
        with pytest.raises(ValueError, match="out of range"):
            platform.run_plan(merged[0], [8], [0], 0)
