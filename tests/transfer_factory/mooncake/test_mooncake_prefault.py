"""MooncakeStore's segment prefaulting against a real mooncake_master; no mocks.

Needs the mooncake-transfer-engine(-non-cuda) wheel; skipped without it.
"""

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from scripts.local_mooncake_master import LocalMooncakeMaster  # noqa: E402
from transfer_factory.mooncake.prefault import new_anonymous_ranges  # noqa: E402
from transfer_factory.mooncake import MooncakeStore  # noqa: E402
from transfer_factory.mooncake.config import parse_size  # noqa: E402
from tests import mooncake_helpers  # noqa: E402
from tests.mooncake_helpers import SMALL, Buffers, keys_for  # noqa: E402

_clean_mooncake_env = mooncake_helpers._clean_mooncake_env  # the shared fixture, under its name here


# ---- segment prefaulting ------------------------------------------------------------------------

def _minflt() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def test_new_anonymous_ranges_are_what_appeared_and_large_enough():
    before = [(0x1000, 0x3000), (0x10000, 0x11000)]
    after = [(0x1000, 0x9000), (0x10000, 0x11000), (0x20000, 0x20800), (0x30000, 0x50000)]
    # grown by merging with a new neighbour: only the new part; a new small one: too small
    assert new_anonymous_ranges(before, after, 0x1000) == [(0x3000, 0x9000), (0x30000, 0x50000)]
    assert new_anonymous_ranges(before, after, 0x10000) == [(0x30000, 0x50000)]
    # a new mapping between two old ones
    assert new_anonymous_ranges([(0, 0x1000), (0x5000, 0x6000)], [(0, 0x6000)], 1) == [(0x1000, 0x5000)]
    assert new_anonymous_ranges(after, after, 1) == []


@pytest.mark.parametrize("mode", ["populate", "hugepage"])
def test_prefaulted_segment_holds_its_objects_bit_exact_and_puts_take_no_page_faults(mode):
    """One client alone on a fresh master, so every object lands in its own segment: after the
    prefault at setup, putting 16 MiB into it takes (almost) no page fault, each object lies in
    the prefaulted memory, and the bytes come back exact; with prefaulting off the same puts
    fault once per 4 KiB page (where the host does not give every mapping huge pages)."""
    size, count = 1 << 20, 16
    with LocalMooncakeMaster(lease_ttl_ms=500) as m:
        results = {}
        for prefault in ("off", mode):
            store = MooncakeStore(namespace="pf", rank=0, options={**m.config(), **SMALL, "segment_prefault": prefault})
            try:
                if prefault == "off":
                    assert store.prefaulted == []
                else:
                    assert sum(b - a for a, b in store.prefaulted) >= parse_size(SMALL["global_segment_size"])
                bufs = Buffers(store, count, size, seed=7)
                keys = keys_for("pf", prefault, count)
                before = _minflt()
                assert store.batch_set(keys, bufs.src_ptrs(), bufs.sizes()) == [0] * count
                results[prefault] = _minflt() - before
                assert store.batch_get(keys, bufs.dst_ptrs(), bufs.sizes()) == [size] * count
                assert np.array_equal(bufs.dst, bufs.src)
                if prefault != "off":
                    desc = store._connection.current.store.batch_get_replica_desc(keys)
                    for key in keys:
                        addr = desc[key][0].get_memory_descriptor().buffer_descriptor.buffer_address
                        assert any(a <= addr and addr + size <= b for a, b in store.prefaulted), key
            finally:
                store.close()
    pages = count * size // 4096
    assert results[mode] < pages // 8, results
    if not _thp_always():
        assert results["off"] >= pages * 0.9, results
