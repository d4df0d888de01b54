"""A Transfer Engine pull of thousands of separate runs: every run has landed when the pull
answers (the binding reports only a batch's first task, so a batch of many runs looked done while
most were in flight), and no more runs are queued than the TCP transport accepts (it failed the
rest, and the failure released blocks still being written)."""
import numpy as np

from cache_manager.cache_spec import CacheSpec
from tests.pd_helpers import instance_pair
from tests.service_helpers import fill_distinct, views

SPEC = CacheSpec(num_layers=4, num_blocks=2048, kv_heads=2, block_size=4, head_dim=8)


def test_a_pull_of_thousands_of_runs_has_landed_when_it_answers():
    with instance_pair(SPEC, tp=1) as (p_svc, d_svc, p, d):
        fill_distinct(p_svc, seed=81)
        fill_distinct(d_svc, seed=82)
        d.link(p.descriptor(["ipc", "mooncake"]), transport="mooncake")
        src, dst = list(range(0, 2048, 2)), list(range(1, 2048, 2))  # no two blocks adjacent: 8192 runs
        handle = p.expose("many-runs")
        assert d.pull_blocks("prefill-0", handle, src, dst, timeout=60).result(timeout=70) == dst
        got = {k: v[dst].copy() for k, v in views(d_svc).items()}  # at once, as an engine would use them
        for k, v in views(p_svc).items():
            assert np.array_equal(got[k], v[src]), f"{k}: a run had not landed when the pull answered"
        p.retract(handle)
