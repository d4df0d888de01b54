"""Leases on exposed handles (DESIGN §3.11): a handle expires after its time-to-live unless the decode
side renews it, so a lost decode never pins prefill blocks; expiry is a retraction, so a read that
spans it counts nothing.  The cases are vLLM's lease bugs: renewals under load (#53095), mixed TTLs
reaped out of order (#58222), and an expiry during a read (#47021 read garbage from expired blocks).
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from engine_hooks.pd.leases import LeaseReaper
from tests.pd_helpers import blocks_any, fill_any, link_both, pair_fixtures
from transfer_factory.peer.handles import BOARD_WORDS, ExposureBoard, holds

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)

pair, npu_pair = pair_fixtures(SPEC, num_cpu_blocks=8)


@pytest.fixture
def board():
    words = np.zeros(BOARD_WORDS, dtype=np.int64)
    expired: list = []
    b = ExposureBoard(words, "prefill-x")
    reaper = LeaseReaper(b, expired.append, "test")
    try:
        yield b, reaper, expired
    finally:
        reaper.stop()


def test_mixed_ttls_expire_in_lease_order_whatever_the_order_exposed(board):
    b, reaper, expired = board
    long = b.expose("long", ttl=0.9)
    short = b.expose("short", ttl=0.2)
    forever = b.expose("forever", ttl=None)
    reaper.wake()
    time.sleep(0.5)
    assert expired == [short]
    assert not holds(b.words[short.slot], short) and holds(b.words[long.slot], long)
    time.sleep(0.8)
    assert expired == [short, long]
    assert holds(b.words[forever.slot], forever) and b.retract(forever)


def test_renewed_handles_never_expire_under_load_and_unrenewed_ones_all_do(board):
    b, reaper, expired = board
    kept = [b.expose(f"kept-{i}", ttl=0.3) for i in range(200)]
    dropped = [b.expose(f"dropped-{i}", ttl=0.3) for i in range(200)]
    reaper.wake()
    stop = threading.Event()
    failures: list = []

    def renew_all():
        while not stop.is_set():
            for handle in kept:
                if not b.renew(handle):
                    failures.append(handle.req_id)

    renewers = [threading.Thread(target=renew_all) for _ in range(2)]
    for t in renewers:
        t.start()
    time.sleep(1.2)
    stop.set()
    for t in renewers:
        t.join(10)
    assert not failures, f"renewed handles expired: {failures[:5]}"
    assert sorted(h.req_id for h in expired) == sorted(h.req_id for h in dropped)
    assert all(holds(b.words[h.slot], h) for h in kept)
    assert all(not holds(b.words[h.slot], h) for h in dropped)
    assert not b.renew(dropped[0]), "an expired handle was renewed"


def test_a_lost_decode_does_not_pin_prefill_blocks_and_a_renewing_one_pulls(pair):
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, 61)
    link_both(p, d, "ipc")
    lost = p.expose("req-lost", ttl=0.3)
    kept = p.expose("req-kept", ttl=0.3)
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        assert p.renew(kept.to_wire())  # the router relays the decode's renewals as plain data
        time.sleep(0.1)
    assert lost not in p.board.live() and kept in p.board.live()
    with pytest.raises(TaskFailedError, match="no longer exposed"):
        d.pull_blocks("prefill-0", lost, [1], [1]).result(timeout=20)
    want = blocks_any(p_svc, [2, 3])
    assert d.pull_blocks("prefill-0", kept, [2, 3], [4, 5]).result(timeout=20) == [4, 5]
    got = blocks_any(d_svc, [4, 5])
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert p.retract(kept)


def test_a_lease_that_expires_while_the_decode_reads_counts_nothing(pair):
    """Rank 1 of the decode is stopped while the pull runs: rank 0 reads at once, the lease ends,
    then rank 1 reads.  The pull spans the expiry, so it fails instead of handing over blocks."""
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, 62)
    link_both(p, d, "ipc")
    handle = p.expose("req-read", ttl=0.5)
    rank1 = d_svc.pids()[1]
    os.kill(rank1, signal.SIGSTOP)
    try:
        future = d.pull_blocks("prefill-0", handle, [6, 7], [8, 9], timeout=20)
        time.sleep(1.0)  # the lease ends while rank 1 has not read yet
        assert handle not in p.board.live()
    finally:
        os.kill(rank1, signal.SIGCONT)
    with pytest.raises(TaskFailedError, match="no longer exposed|retracted"):
        future.result(timeout=20)
