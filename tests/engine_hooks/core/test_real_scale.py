"""One real-scale configuration (issue 35 item 6): what an Ascend node runs, DeepSeek-V3 at TP 8 on
one host, at its full layer count (61 layers + 1 MTP layer, MLA latent 512 + rope 64, 128-token
pages) with a few blocks, real CTM processes: 8 per instance, two instances (prefill and decode)
in this engine process.  Both instances start once for the whole module.

What the engine sees, bytes bit-exact wherever bytes move: a whole-cache swap out and in on all 62
layers of both groups on all 8 ranks; a P/D pull and a layer-wise push between the instances over
``ipc`` and ``mooncake``; a task deadline firing against a SIGSTOPped rank, naming it; a SIGKILLed
rank failing its task naming it, restarted, then swapping and pulling bit-exact again; and the
engine's descriptors staying far below select()'s 1,024 (the count that stopped deadlines firing).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.cache_presets import preset
from engine_hooks import RankDiedError, TaskFailedError, TaskTimeoutError
from tests.pd_helpers import link_both, local_instance
from tests.rank_stream_helpers import restarted, swap_is_bit_exact
from tests.service_helpers import (block_bytes, fill_distinct, process_gone, segments_of, views,
                                   write_random_blocks)

logger = logging.getLogger(__name__)

TP = 8
BLOCKS = 8
CPU_BLOCKS = 8
LAYERS = 62  # 61 layers + 1 MTP layer
GROUPS = ("latent_caches", "rope_caches")
SWAP_TIMEOUT = 3.0
SLACK = 2.5  # past the swap's own timeout: the supervisor's wake-up on a loaded 2-core machine
RESTART_WITHIN_S = 60.0  # a CTM's start (paddle's import) beside 15 others on 2 cores
FD_CEILING = 256  # "far below" FD_SETSIZE (1024); two linked TP-8 instances hold about a hundred


def layout():
    return preset("deepseek-v3", num_blocks=BLOCKS, tp=TP)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def pair():
    """(prefill service, decode service, prefill side, decode side), each TP 8 at full scale."""
    t0 = time.monotonic()
    with local_instance(layout(), "prefill-0", tp=TP, num_cpu_blocks=CPU_BLOCKS) as (p_svc, p), \
            local_instance(layout(), "decode-0", tp=TP, num_cpu_blocks=CPU_BLOCKS) as (d_svc, d):
        logger.warning("two TP-8 instances started in %.1fs", time.monotonic() - t0)
        fill_distinct(p_svc, seed=61)
        fill_distinct(d_svc, seed=62)
        yield p_svc, d_svc, p, d
        ports, pids = [p_svc.port, d_svc.port], list(p_svc.pids().values()) + list(d_svc.pids().values())
    assert [segments_of(port) for port in ports] == [[], []]
    assert all(process_gone(pid) for pid in pids)


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    for key in got:
        assert np.array_equal(got[key], want[key]), f"{key} differs"


def fresh(p_svc, d_svc, src: list[int], dst: list[int], seed: int) -> dict:
    """New random bytes in the prefill's blocks ``src`` and other ones in the decode's ``dst``, so a
    transfer that moves nothing cannot pass; returns the prefill's."""
    want = write_random_blocks(p_svc, src, seed)
    before = write_random_blocks(d_svc, dst, seed + 1)
    assert not np.array_equal(before[(0, GROUPS[0], 0)], want[(0, GROUPS[0], 0)])
    return want


def test_the_instance_is_the_real_deepseek_v3_shape_at_tp_8(pair):
    p_svc, d_svc, _, _ = pair
    for svc in (p_svc, d_svc):
        assert svc.layout.total_layers == LAYERS and [g.name for g in svc.layout.groups] == list(GROUPS)
        assert set(views(svc)) == {(r, g, i) for r in range(TP) for g in GROUPS for i in range(LAYERS)}
        assert len(set(svc.pids().values())) == TP
        v = views(svc)
        assert v[(0, "latent_caches", 0)].shape == (BLOCKS, 128 * 512 * 2)
        assert v[(0, "rope_caches", 61)].shape == (BLOCKS, 128 * 64 * 2)


def test_a_whole_cache_swap_out_and_in_is_bit_exact_on_all_62_layers_of_both_groups_on_all_8_ranks(pair):
    svc = pair[0]
    gpu = list(range(BLOCKS))
    slots = [(3 * i + 5) % CPU_BLOCKS for i in gpu]  # every slot, in another order
    want = block_bytes(svc, gpu)
    assert not np.array_equal(want[(0, "latent_caches", 0)], want[(1, "latent_caches", 0)]), "ranks must differ"
    assert svc.swap_to_cpu(gpu, slots).result(timeout=60)
    for view in views(svc).values():
        view[:] = 0
    back = gpu[::-1]  # every block from the slot of another
    assert svc.swap_to_gpu(back, slots).result(timeout=60)
    same(block_bytes(svc, back), want)


@contextlib.contextmanager
def linked(p, d, transport: str):
    """The two sides linked both ways over ``transport`` for the block; unlinked after it."""
    link_both(p, d, transport)
    try:
        yield
    except BaseException:
        for side, peer in ((p, "decode-0"), (d, "prefill-0")):
            with contextlib.suppress(Exception):  # the test's own failure is the one to see
                side.unlink(peer)
        raise
    assert p.unlink("decode-0") and d.unlink("prefill-0")


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_pull_and_a_layerwise_push_between_two_instances_are_bit_exact(pair, transport):
    p_svc, d_svc, p, d = pair
    with linked(p, d, transport):
        handle = p.expose(f"req-{transport}")
        src, dst = [3, 4, 5], [6, 0, 2]
        want = fresh(p_svc, d_svc, src, dst, seed=70)
        assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=60) == dst
        same(block_bytes(d_svc, dst), want)
        p.retract(handle)

        src, dst = [7, 1], [1, 7]
        want = fresh(p_svc, d_svc, src, dst, seed=72)
        target = d.receive_push("prefill-0", dst, timeout=60)
        future = p.push_blocks("decode-0", target.ticket, src, layerwise=True, timeout=60)
        for layer in range(LAYERS):
            future.layer_computed(layer + 1)
            target.wait_for_layer(layer, timeout=30)
        assert target.result(timeout=30) == dst and future.result(timeout=30) == dst
        same(block_bytes(d_svc, dst), want)
        assert target.close()


def test_a_stopped_rank_fails_a_swap_by_its_deadline_naming_it_and_serves_on_after(pair):
    svc = pair[0]
    assert svc.swap_to_cpu([4], [5]).result(timeout=60)
    stopped = svc.pids()[5]
    os.kill(stopped, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        future = svc.swap_to_gpu([6], [5], timeout=SWAP_TIMEOUT)
        with pytest.raises(TaskTimeoutError, match=r"no answer from ranks \[5\]") as err:
            future.result(timeout=SWAP_TIMEOUT + 30)
        elapsed = time.monotonic() - t0
        assert err.value.missing_ranks == [5]
        assert elapsed < SWAP_TIMEOUT + SLACK, f"the deadline fired {elapsed:.1f}s after submission"
    finally:
        os.kill(stopped, signal.SIGCONT)
    future.released.result(timeout=30)  # the continued rank lets go of the task's blocks
    assert svc.pids()[5] == stopped and not svc.tracker.is_down(5)
    assert swap_is_bit_exact(svc, block=2, slot=1, into=3)
    assert svc.supervisor_errors == 0


def test_a_killed_rank_fails_its_task_naming_it_is_restarted_and_swaps_and_pulls_bit_exact_again(pair):
    p_svc, svc, p, d = pair
    with linked(p, d, "ipc"):
        held = svc.control("sleep", seconds=30, rank=6, timeout=60)  # in flight on rank 6
        victim = svc.pids()[6]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RankDiedError, match=r"rank 6 .*died.*signal 9") as info:
            held.result(timeout=10)
        assert info.value.rank == 6
        assert time.monotonic() - t0 < 5.0, "the held task did not fail at once"
        held.released.result(timeout=10)
        assert restarted(svc, 6, victim, RESTART_WITHIN_S), "rank 6 was not restarted"
        logger.warning("rank 6 restarted %.1fs after SIGKILL", time.monotonic() - t0)
        assert process_gone(victim)
        assert swap_is_bit_exact(svc, block=5, slot=3, into=1)

        handle = p.expose("after-restart")
        want = fresh(p_svc, svc, [2, 3], [4, 6], seed=74)
        deadline = time.monotonic() + 30
        while True:  # the restarted rank's re-link runs beside the restart: a pull may race it once
            try:
                assert d.pull_blocks("prefill-0", handle, [2, 3], [4, 6]).result(timeout=60) == [4, 6]
                break
            except TaskFailedError as exc:
                assert "not linked" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.1)
        same(block_bytes(svc, [4, 6]), want)
        p.retract(handle)


def test_the_engine_holds_far_fewer_descriptors_than_select_allows(pair):
    p, d = pair[2], pair[3]
    with linked(p, d, "mooncake"):  # both instances up and linked: the most this module holds at once
        count = open_descriptors()
        logger.warning("engine descriptors with two linked TP-8 instances: %d", count)
        assert count < FD_CEILING, f"the engine holds {count} descriptors"
