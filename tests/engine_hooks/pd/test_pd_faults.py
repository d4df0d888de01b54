"""Prefill/decode under faults caused for real (DESIGN §3.11, §4): the prefill instance is a child
process killed or stopped mid-transfer; the decode instance is this test's service."""
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError, TaskTimeoutError
from tests.pd_helpers import child_instance, link_child, local_digests, local_instance
from ops.procs import listening_ports, listening_sockets
from transfer_factory.peer.te import socket_text
from tests.service_helpers import fill_distinct, process_gone

SPEC = dict(num_layers=4, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)


@pytest.fixture
def decode():
    with local_instance(CacheSpec(**SPEC), "decode-0", num_cpu_blocks=8) as instance:
        yield instance


@pytest.fixture
def prefill():
    with child_instance("prefill-0", SPEC, seed=51) as peer:
        yield peer


def kill_engine(peer) -> None:
    """SIGKILL a child instance's engine and wait until its CTMs followed it."""
    os.kill(peer.pid, signal.SIGKILL)
    peer.proc.wait(10)
    deadline = time.monotonic() + 15
    while not all(process_gone(pid) for pid in peer.rank_pids):
        assert time.monotonic() < deadline, f"{peer.instance}'s CTMs outlived their engine"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_pull_from_a_killed_prefill_instance_fails_naming_it_and_decode_serves_on(decode, prefill, transport):
    svc, d = decode
    fill_distinct(svc, seed=52)
    assert link_child(d, prefill, transport) == transport
    ports = {pid: listening_ports(pid) for pid in list(svc.pids().values()) + prefill.rank_pids}
    if transport == "ipc":  # the same-host path opens no port, on either side
        assert ports == {pid: set() for pid in ports}, ports
    else:  # every rank's Transfer Engine listens (RPC and data port), where it logged, truly
        assert all(len(p) >= 2 for p in ports.values()), ports
        for rank, proc in svc.procs.items():
            # The log file is the rank's of every instance sharing the log dir (the prefill child's
            # too): this process's line is the one naming sockets it listens on.
            lines = [l for l in open(proc.log_path) if "Transfer Engine open: peers reach it at" in l]
            listening = {socket_text(address, port) for address, port in listening_sockets(proc.pid)}
            named = [l.split("it listens on ", 1)[1].split(", with no authentication")[0].split(", ") for l in lines]
            assert any(len(n) >= 2 and set(n) <= listening for n in named), (rank, lines, listening)
            # (Mooncake may open one more listener after it started, at first contact: checked below
            # to face loopback only, like the rest)
        # the ranks' Transfer Engines (pod_ip 127.0.0.1) listen on loopback only, not every interface
        wide = {pid: s for pid in svc.pids().values() for s in listening_sockets(pid)
                if not s[0].replace("::ffff:", "").startswith("127.")}
        assert wide == {}, wide
    handle = prefill.call("expose", req_id="r1")
    assert d.pull_blocks("prefill-0", handle, [1, 2], [3, 4]).result(timeout=20) == [3, 4]
    before = local_digests(svc, [5, 6])
    kill_engine(prefill)  # the prefill engine; its CTMs follow it
    # Linked before the kill: the decode ranks still map (ipc) or address (Transfer Engine) its memory.
    with pytest.raises(TaskFailedError, match="prefill-0"):
        d.pull_blocks("prefill-0", handle, [1, 2], [5, 6], timeout=10).result(timeout=20)
    assert local_digests(svc, [5, 6]) == before  # no destination block reported loaded, none changed
    assert svc.swap_to_cpu([1], [1]).result(timeout=20)  # decode serves on
    assert svc.swap_to_gpu([7], [1]).result(timeout=20)
    assert np.array_equal(*(list(local_digests(svc, [1]).values()), list(local_digests(svc, [7]).values())))
    assert d.unlink("prefill-0")


def test_relinking_a_dead_prefill_instance_from_its_saved_descriptor_is_refused_not_fatal(decode, prefill):
    """Mooncake 0.3.13 answers a run to a peer it cannot reach with batch id 0 (not an error code);
    polling it dereferenced a null batch and killed every decode CTM (SIGSEGV) within 50 ms.  Now
    the link reaches the peer first (its generation word) and is refused naming it."""
    from engine_hooks.pd import offer_for

    svc, d = decode
    saved = prefill.call("descriptor", offer=offer_for("mooncake"))
    assert link_child(d, prefill, "mooncake") == "mooncake"
    handle = prefill.call("expose", req_id="r1")
    kill_engine(prefill)
    assert d.unlink("prefill-0")
    pids = dict(svc.pids())
    # the descriptor an engine kept: the link reaches the peer first, and is refused naming it
    with pytest.raises(Exception, match="prefill-0 rank .* cannot be reached to link"):
        d.link(saved, transport="mooncake")
    assert d.linked() == {}
    with pytest.raises(ValueError, match="not linked"):
        d.pull_blocks("prefill-0", handle, [1, 2], [5, 6], timeout=10)
    assert svc.pids() == pids and not any(process_gone(pid) for pid in pids.values()), "a decode rank died"
    assert svc.swap_to_cpu([1], [1]).result(timeout=20)  # decode serves on


def test_a_transfer_engine_pull_from_a_stopped_prefill_fails_in_time_and_is_released_only_after(decode, prefill):
    svc, d = decode
    fill_distinct(svc, seed=53)
    link_child(d, prefill, "mooncake")
    handle = prefill.call("expose", req_id="r2")
    before = local_digests(svc, [8, 9, 10])
    for pid in prefill.rank_pids:
        os.kill(pid, signal.SIGSTOP)  # their Transfer Engines stop answering
    t0 = time.monotonic()
    future = d.pull_blocks("prefill-0", handle, [1, 2, 3], [8, 9, 10], timeout=2.0)
    with pytest.raises((TaskTimeoutError, TaskFailedError), match="prefill-0"):  # whichever comes first
        future.result(timeout=10)
    assert time.monotonic() - t0 < 5.0
    time.sleep(0.5)
    # Released at once only if no block byte was asked for (the handle's word was read first, and it
    # never came): then none may land after the peer continues.  Otherwise held until none can.
    released_early = future.released.done()
    for pid in prefill.rank_pids:
        os.kill(pid, signal.SIGCONT)
    future.released.result(timeout=40)
    if released_early:
        time.sleep(1.0)
        assert local_digests(svc, [8, 9, 10]) == before, "bytes landed in blocks released to the engine"
    want = prefill.call("digest", ids=[1, 2, 3])
    assert prefill.call("retract", handle=handle)
    # served on: a fresh handle pulls bit-exact
    handle = prefill.call("expose", req_id="r3")
    assert d.pull_blocks("prefill-0", handle, [1, 2, 3], [8, 9, 10]).result(timeout=20) == [8, 9, 10]
    assert local_digests(svc, [8, 9, 10]) == want


@pytest.fixture
def prefill_here():
    with local_instance(CacheSpec(**SPEC), "prefill-0", num_cpu_blocks=8) as instance:
        yield instance


@pytest.fixture
def decode_child():
    with child_instance("decode-0", SPEC, seed=54) as peer:
        yield peer


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_decode_instance_killed_mid_push_leaves_the_prefill_side_released_and_serving(prefill_here, decode_child,
                                                                                        transport):
    svc, p = prefill_here
    fill_distinct(svc, seed=55)
    assert link_child(p, decode_child, transport) == transport
    ticket = decode_child.call("receive_push", peer="prefill-0", dst=[5, 6, 7])
    future = p.push_blocks("decode-0", ticket, [1, 2, 3], layerwise=True, timeout=10)
    future.layer_computed(1)
    time.sleep(0.3)  # layer 0 is on its way or there
    os.kill(decode_child.pid, signal.SIGKILL)
    decode_child.proc.wait(10)
    deadline = time.monotonic() + 15
    while not all(process_gone(pid) for pid in decode_child.rank_pids):
        assert time.monotonic() < deadline, "the decode instance's CTMs outlived their engine"
        time.sleep(0.1)
    future.layer_computed(SPEC["num_layers"])
    try:  # over ipc the writes land in memory nobody uses any more; over TCP the peer is gone
        future.result(timeout=20)
    except (TaskFailedError, TaskTimeoutError) as exc:
        assert transport == "mooncake" and "decode-0" in str(exc), exc
    future.released.result(timeout=20)  # the prefill side's source blocks are free again
    assert svc.unreleased_tasks() == {}
    before = local_digests(svc, [1, 2, 3])
    assert svc.swap_to_cpu([1, 2, 3], [1, 2, 3]).result(timeout=20)  # and it serves on
    assert svc.swap_to_gpu([9, 10, 11], [1, 2, 3]).result(timeout=20)
    assert list(local_digests(svc, [9, 10, 11]).values()) == list(before.values())


def test_a_push_to_a_stopped_decode_instance_fails_in_time_and_is_released_after_it_continues(prefill_here,
                                                                                               decode_child):
    svc, p = prefill_here
    fill_distinct(svc, seed=56)
    link_child(p, decode_child, "mooncake")
    ticket = decode_child.call("receive_push", peer="prefill-0", dst=[5, 6, 7], timeout=60)
    for pid in decode_child.rank_pids:
        os.kill(pid, signal.SIGSTOP)  # their Transfer Engines stop taking writes
    t0 = time.monotonic()
    future = p.push_blocks("decode-0", ticket, [1, 2, 3], layerwise=False, timeout=2.0)
    with pytest.raises(TaskTimeoutError):
        future.result(timeout=10)
    assert time.monotonic() - t0 < 5.0
    time.sleep(0.5)
    assert not future.released.done()  # a write may still land: the source stays held
    for pid in decode_child.rank_pids:
        os.kill(pid, signal.SIGCONT)
    future.released.result(timeout=40)
    deadline = time.monotonic() + 20
    while not decode_child.call("push_state", peer="prefill-0")["released"]:
        assert time.monotonic() < deadline, "the decode side never learnt that no write can land"
        time.sleep(0.2)


def test_a_decode_rank_killed_and_restarted_gets_its_links_back(decode, prefill):
    """A restarted rank held no P/D links while ``linked()`` still listed them: every pull failed
    ``not linked`` on it until the engine linked again by hand."""
    svc, d = decode
    assert link_child(d, prefill, "ipc") == "ipc"
    old = svc.pids()[1]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while svc.pids().get(1) in (None, old) or svc.tracker.is_down(1):
        assert time.monotonic() < deadline, "rank 1 was not restarted"
        time.sleep(0.05)
    handle = prefill.call("expose", req_id="after-restart")
    want = prefill.call("digest", ids=[1, 2])
    deadline = time.monotonic() + 20
    while True:  # the re-link runs beside the restart: a pull may race it once
        try:
            assert d.pull_blocks("prefill-0", handle, [1, 2], [3, 4]).result(timeout=20) == [3, 4]
            break
        except TaskFailedError as exc:
            assert "not linked" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.1)
    assert local_digests(svc, [3, 4]) == want
    assert d.linked() == {"prefill-0": "ipc"}
