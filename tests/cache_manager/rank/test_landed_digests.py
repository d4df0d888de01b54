"""Digests taken as a Transfer Engine pull's runs land (``cache_manager.rank.peer.landed``): runs that
end in any order, in any batches, give the digests of every block of every row, as one pass after
the transfer would; a group not every block of which landed is left to that pass."""
import logging

import numpy as np

from cache_manager.rank.peer.channel import GroupSide
from cache_manager.rank.peer.landed import LandedDigests
from ops.layout import Side
from transfer_factory.peer.digests import digests_at
from transfer_factory.peer.te import coalesce, block_addresses

LOG = logging.getLogger("test")


def test_runs_landing_in_any_order_give_every_blocks_digest():
    rng = np.random.default_rng(0)
    rows, blocks, nbytes = 3, 10, 512
    cache = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    side = Side("dst", np.array([cache[r].ctypes.data for r in range(rows)], dtype=np.int64),
                np.full(rows, blocks, dtype=np.int64), nbytes)
    ids = [4, 5, 6, 1, 9, 2]  # runs of consecutive ids coalesce: [4, 5, 6], [1], [9], [2]
    groups = [GroupSide("k", side, range(rows), 0), GroupSide("w", side, range(1, 3), 2)]  # w: a window's last 4
    runs = []
    for index, g in enumerate(groups):
        addrs = block_addresses(side.bases, nbytes, ids[g.first:], g.rows)
        start = 0
        for length in coalesce(addrs, addrs, nbytes)[2]:
            runs.append((index, start, length // nbytes))
            start += length // nbytes
    landed = LandedDigests(groups, ids, runs, [nbytes, nbytes], LOG)
    order = rng.permutation(len(runs)).tolist()
    for part in (order[:3], order[3:5], order[5:]):
        landed.landed([(0, r) for r in part])
    got = landed.result()
    for g in groups:
        want = digests_at(side.bases[g.rows.start:g.rows.stop], side.capacities[g.rows.start:g.rows.stop], nbytes,
                          ids[g.first:], 0, nbytes)
        assert np.array_equal(got[g.kind], want), g.kind


def test_a_group_whose_runs_did_not_all_land_is_left_out():
    cache = np.zeros((1, 4, 64), dtype=np.uint8)
    side = Side("dst", np.array([cache[0].ctypes.data], dtype=np.int64), np.array([4], dtype=np.int64), 64)
    landed = LandedDigests([GroupSide("k", side, range(1), 0)], [0, 2], [(0, 0, 1), (0, 1, 1)], [64], LOG)
    landed.landed([(0, 0)])
    assert landed.result() == {}
