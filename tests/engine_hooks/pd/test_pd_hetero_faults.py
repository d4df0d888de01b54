"""A prefill rank killed mid-transfer between instances of different TP sizes (DESIGN §3.11, §4):
the prefill instance (TP 2) is a child process whose rank 1 is killed for real; the decode
instance (TP 1, so it reads from both prefill ranks) is this test's service."""
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from engine_hooks.pd.push import PushFailed
from tests.pd_helpers import child_instance, link_child, local_instance
from tests.service_helpers import fill_distinct, process_gone, views

PREFILL = dict(num_layers=3, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)
DECODE = CacheSpec(**dict(PREFILL, kv_heads=4))


@pytest.fixture
def decode():
    with local_instance(DECODE, "decode-0", tp=1, num_cpu_blocks=8) as (svc, side):
        fill_distinct(svc, seed=81)
        yield svc, side


@pytest.fixture
def prefill():
    with child_instance("prefill-0", PREFILL, seed=82, tp=2) as peer:
        yield peer


def decode_blocks(svc, ids) -> dict:
    return {(kind, layer): v[ids].copy() for (_, kind, layer), v in views(svc).items()}


def prefill_blocks(prefill, ids) -> dict:
    """(kind, layer) -> the prefill ranks' heads of ``ids`` side by side, as the decode rank holds them."""
    ranks: dict = {}
    for name, hexed in prefill.call("bytes", ids=ids).items():
        rank, kind, layer = name.split("/")
        ranks.setdefault((kind, int(layer)), {})[int(rank)] = np.frombuffer(bytes.fromhex(hexed), np.uint8).reshape(
            len(ids), PREFILL["kv_heads"], -1)
    return {key: np.concatenate([r[i] for i in sorted(r)], axis=1).reshape(len(ids), -1) for key, r in ranks.items()}


def test_a_transfer_engine_pull_whose_prefill_rank_is_killed_mid_transfer_fails_in_time_naming_it(decode, prefill):
    svc, side = decode
    assert link_child(side, prefill, "mooncake") == "mooncake"
    handle = prefill.call("expose", req_id="r1")
    assert side.pull_blocks("prefill-0", handle, [1, 2], [3, 4]).result(timeout=20) == [3, 4]  # both routes work
    victim = prefill.rank_pids[1]
    os.kill(victim, signal.SIGSTOP)  # its Transfer Engine stops answering: the pull is under way ...
    t0 = time.monotonic()
    future = side.pull_blocks("prefill-0", handle, [8, 9, 10], [5, 6, 7], timeout=8)
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)  # ... and the rank dies in the middle of it
    with pytest.raises(TaskFailedError, match="prefill-0 rank 1"):
        future.result(timeout=15)
    assert time.monotonic() - t0 < 12.0
    deadline = time.monotonic() + 20
    while not future.released.done():  # the dead rank's batch has ended: the blocks come back
        assert time.monotonic() < deadline, "the destination blocks were never released"
        time.sleep(0.05)
    # The prefill engine restarts its rank; once relinked (the new rank has a new Transfer Engine), a
    # pull of the same blocks lands whole.  Until the rank is back, linking or pulling fails.
    deadline = time.monotonic() + 30
    while True:
        try:
            assert link_child(side, prefill, "mooncake") == "mooncake"
            assert side.pull_blocks("prefill-0", handle, [8, 9, 10], [5, 6, 7]).result(timeout=20) == [5, 6, 7]
            break
        except Exception as exc:
            assert time.monotonic() < deadline, f"the decode side never recovered: {exc}"
            time.sleep(0.2)
    got, want = decode_blocks(svc, [5, 6, 7]), prefill_blocks(prefill, [8, 9, 10])
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_same_host_pull_reads_the_prefill_engines_memory_even_with_a_rank_killed(decode, prefill):
    svc, side = decode
    assert link_child(side, prefill, "ipc") == "ipc"
    handle = prefill.call("expose", req_id="r2")
    os.kill(prefill.rank_pids[1], signal.SIGKILL)  # the CTM: the caches are its engine's, still alive
    assert side.pull_blocks("prefill-0", handle, [11, 12], [1, 2]).result(timeout=20) == [1, 2]
    got, want = decode_blocks(svc, [1, 2]), prefill_blocks(prefill, [11, 12])
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_push_whose_prefill_rank_is_killed_fails_the_decode_wait_in_time_naming_it(decode, prefill):
    svc, side = decode
    assert link_child(side, prefill, "ipc") == "ipc"
    target = side.receive_push("prefill-0", [20, 21, 22], timeout=20)
    assert target.writers == [0, 1]
    prefill.call("push", peer="decode-0", ticket=target.ticket, src=[1, 2, 3])
    prefill.call("computed", peer="decode-0", layers=1)
    target.wait_for_layer(0, timeout=10)  # both prefill ranks wrote their heads of layer 0
    os.kill(prefill.rank_pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not process_gone(prefill.rank_pids[1]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    prefill.call("computed", peer="decode-0", layers=3)
    t0 = time.monotonic()
    with pytest.raises(PushFailed, match=r"rank 1 is gone"):
        target.wait_for_layer(2, timeout=3)
    assert time.monotonic() - t0 < 5.0
    # Rank 0 finishes; rank 1's process has ended, so it writes no more: the target is released (its
    # blocks and its board slot come back) instead of held for good.
    assert target.wait_released(10) and target.close()
    settled = decode_blocks(svc, [20, 21, 22])
    time.sleep(0.5)
    after = decode_blocks(svc, [20, 21, 22])
    assert all(np.array_equal(settled[k], after[k]) for k in settled), "a block was written after the release"
