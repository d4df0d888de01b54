"""Push tickets are fenced (DESIGN §3.11): the decode side, not the ticket, decides which of its blocks
a push writes, and a cancelled, closed, re-pushed, altered or swapped ticket writes no byte.  Each test
hands the prefill side the ticket a buggy or hostile router would, then compares the decode's blocks
byte for byte, on the same-host path and over the Transfer Engine.

Before the fence: a ticket pushed again after it landed and was closed overwrote blocks the decode had
reused; a cancel raced a queued push and lost 7 times in 10; a ticket naming blocks 320, 321 for a
reservation of 310, 311 wrote 320, 321 and reported 310, 311 landed with stale bytes.
"""
import time

import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from engine_hooks.pd.push import PushFailed
from tests.pd_helpers import blocks_any, fill_any, link_both, pair_fixtures
from tests.service_helpers import write_random_blocks

SPEC = CacheSpec(num_layers=3, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)

pair, npu_pair = pair_fixtures(SPEC, num_cpu_blocks=8)
TRANSPORTS = ["ipc", "mooncake"]


@pytest.fixture(params=TRANSPORTS)
def linked(request, pair):
    p_svc, d_svc, p, d = pair
    fill_any(p_svc, 51)
    fill_any(d_svc, 52)
    link_both(p, d, request.param)
    return pair


def unchanged(svc, ids, before, what: str) -> None:
    got = blocks_any(svc, ids)
    for key, value in before.items():
        assert np.array_equal(got[key], value), f"{what}: {key} was written"


def test_a_ticket_pushed_again_after_it_landed_and_was_closed_writes_nothing(linked):
    p_svc, d_svc, p, d = linked
    target = d.receive_push("prefill-0", [4, 5], timeout=20)
    ticket = target.ticket
    p.push_blocks("decode-0", ticket, [1, 2], layerwise=False, timeout=20).result(timeout=20)
    assert target.result(timeout=20) == [4, 5] and target.close()
    reused = write_random_blocks(d_svc, [4, 5], seed=53)  # the decode engine reuses the blocks at once
    with pytest.raises(TaskFailedError, match="fenced"):
        p.push_blocks("decode-0", ticket, [6, 7], layerwise=False, timeout=20).result(timeout=20)
    unchanged(d_svc, [4, 5], reused, "a second push of a closed ticket")


def test_a_cancelled_ticket_writes_nothing_even_when_its_push_was_already_queued(linked):
    p_svc, d_svc, p, d = linked
    target = d.receive_push("prefill-0", [8, 9], timeout=20)
    before = blocks_any(d_svc, [8, 9])
    # the push is on the prefill ranks, waiting for its first layer to be computed
    future = p.push_blocks("decode-0", target.ticket, [1, 2], layerwise=True, timeout=20)
    cancelled = target.cancel()
    future.layer_computed(SPEC.num_layers)
    with pytest.raises(TaskFailedError, match="fenced"):
        future.result(timeout=20)
    assert target.wait_released(10) and target.close()
    unchanged(d_svc, [8, 9], before, f"a push of a cancelled ticket (cancel answered {cancelled})")


def test_a_ticket_cancelled_before_its_push_frees_the_slot_at_once_and_writes_nothing(linked):
    p_svc, d_svc, p, d = linked
    target = d.receive_push("prefill-0", [10], timeout=20)
    before = blocks_any(d_svc, [10])
    assert target.cancel()  # no writer had started
    with pytest.raises(TaskFailedError, match="fenced"):
        p.push_blocks("decode-0", target.ticket, [3], layerwise=False, timeout=20).result(timeout=20)
    unchanged(d_svc, [10], before, "a push of a ticket cancelled first")


def test_a_ticket_with_changed_block_ids_writes_neither_the_reserved_nor_the_named_blocks(linked):
    p_svc, d_svc, p, d = linked
    target = d.receive_push("prefill-0", [20, 21], timeout=20)
    forged = {**target.ticket, "dst_block_ids": [22, 23]}
    before = blocks_any(d_svc, [20, 21, 22, 23])
    with pytest.raises(TaskFailedError, match="not the reservation"):
        p.push_blocks("decode-0", forged, [1, 2], layerwise=False, timeout=20).result(timeout=20)
    with pytest.raises(PushFailed, match="gave up"):
        target.result(timeout=20)  # never reported landed
    unchanged(d_svc, [20, 21, 22, 23], before, "a push of a ticket with other block ids")
    assert target.wait_released(10) and target.close()


def test_a_ticket_carrying_another_reservations_slot_writes_nothing(linked):
    p_svc, d_svc, p, d = linked
    first = d.receive_push("prefill-0", [24, 25], timeout=20)
    second = d.receive_push("prefill-0", [26, 27], timeout=20)
    swapped = {**first.ticket, "slot": second.ref.slot, "seq": second.ref.seq}  # first's blocks, second's slot
    before = blocks_any(d_svc, [24, 25, 26, 27])
    with pytest.raises(TaskFailedError, match="not the reservation"):
        p.push_blocks("decode-0", swapped, [1, 2], layerwise=False, timeout=20).result(timeout=20)
    unchanged(d_svc, [24, 25, 26, 27], before, "a push of a swapped ticket")
    for target in (first, second):
        assert target.cancel() or (target.wait_released(10) and target.close())


def test_a_prefill_instance_with_more_ranks_than_push_columns_is_refused_before_reserving():
    from cache_manager.layer_progress import PUSH_WRITERS
    from engine_hooks.pd.push import check_writers

    check_writers("prefill-16", list(range(PUSH_WRITERS)))
    with pytest.raises(ValueError, match=f"at most {PUSH_WRITERS} prefill ranks"):
        check_writers("prefill-32", list(range(2 * PUSH_WRITERS)))


def test_a_descriptor_naming_another_process_as_a_writer_never_releases_a_target_early(pair):
    """Only a writer's own CTM is watched: a descriptor naming some other process (a router's bug)
    whose death would otherwise count as the writer's must not release the reserved blocks."""
    import subprocess
    import sys

    p_svc, d_svc, p, d = pair
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        peer = p.descriptor()
        peer["ranks"] = [{**rank, "pid": decoy.pid} for rank in peer["ranks"]]
        d.link(peer, transport="ipc")
        target = d.receive_push("prefill-0", [30], timeout=20)
        decoy.kill()
        decoy.wait(10)
        time.sleep(0.2)
        assert not target.released, "a target was released by the death of a process that is not its writer"
        assert target.cancel()
    finally:
        decoy.kill()
        decoy.wait(10)
    link_both(p, d, "ipc")
    target = d.receive_push("prefill-0", [30], timeout=20)
    assert target.writers and not target.released  # the real CTMs are watched, alive, not yet written
    assert target.cancel()
