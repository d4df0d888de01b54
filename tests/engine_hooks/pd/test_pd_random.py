"""1,000 random pulls and pushes between two real instances at TP=2 over the same-host path, each
checked bit-exact on every rank, kind and layer against the prefill instance's blocks, and the
blocks outside each destination left untouched (DESIGN §3.11)."""
import numpy as np

from cache_manager.cache_spec import CacheSpec
from tests.pd_helpers import instance_pair
from tests.service_helpers import fill_distinct, views

SPEC = CacheSpec(num_layers=3, num_blocks=48, kv_heads=2, block_size=4, head_dim=8)
OPS = 1000


def test_a_thousand_random_pulls_and_pushes_are_bit_exact():
    with instance_pair(SPEC, num_cpu_blocks=8) as (p_svc, d_svc, p, d):
        fill_distinct(p_svc, seed=71)
        fill_distinct(d_svc, seed=72)
        p.link(d.descriptor(), transport="ipc")
        d.link(p.descriptor(), transport="ipc")
        pv, dv = views(p_svc), views(d_svc)
        rng = np.random.default_rng(73)
        counts = {"pull": 0, "push": 0}
        for i in range(OPS):
            n = int(rng.integers(1, 12))
            src = rng.choice(SPEC.num_blocks, n, replace=False).tolist()
            dst = rng.choice(SPEC.num_blocks, n, replace=False).tolist()
            if i % 50 == 0:  # the prefill side's KV changes now and then (new requests)
                for v in pv.values():
                    v[src] = rng.integers(0, 256, v[src].shape, dtype=np.uint8)
            want = {k: v[src].copy() for k, v in pv.items()}
            others = [b for b in range(SPEC.num_blocks) if b not in dst]
            before = {k: v[others].copy() for k, v in dv.items()}
            if rng.random() < 0.5:
                handle = p.expose(f"r{i}")
                assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=20) == dst
                assert p.retract(handle)
                counts["pull"] += 1
            else:
                target = d.receive_push("prefill-0", dst, timeout=20)
                assert p.push_blocks("decode-0", target.ticket, src, layerwise=False).result(timeout=20) == dst
                assert target.result(timeout=5) == dst and target.close()
                counts["push"] += 1
            for k in want:
                assert np.array_equal(dv[k][dst], want[k]), f"op {i}: {k} differs"
                assert np.array_equal(dv[k][others], before[k]), f"op {i}: {k} changed outside the destination"
        assert min(counts.values()) > 400, counts
