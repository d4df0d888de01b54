"""Prefill/decode between two hosts of the bed (tests/two_hosts.py; DESIGN §3.11, §4): the prefill
instance runs on host a (10.77.1.1), the decode instance on host b (10.77.1.2), each an engine
process with TP 2 CTMs started on its host (tests/pd_hosts.py) and advertising its host's address,
linked over the Mooncake Transfer Engine across the veth.  Every check reads what the engines see,
byte for byte (SHA-256 per rank, kind and layer).  Faults are the bed's: a SIGKILLed or SIGSTOPped
instance, a blackholed or downed link, a clock 5 h ahead.  After every test no process of either
instance runs, a host whose instance quit has nothing in its /dev/shm, and the bed leaves nothing.
Needs root (the bed) and the Mooncake wheel."""
from __future__ import annotations

import contextlib
import importlib
import os
import signal
import time

import pytest

from tests import two_hosts as bed_lib
from tests.pd_hosts import ChildError, HostInstance, alive, wait_gone

try:
    importlib.import_module("mooncake.engine")
except ImportError as exc:  # the Transfer Engine is the only cross-host transport
    pytest.skip(f"the Mooncake Transfer Engine (mooncake.engine) is not importable: {exc}", allow_module_level=True)

two_hosts, host_bed_factory = bed_lib.two_hosts, bed_lib.host_bed_factory  # the shared fixtures

SPEC = dict(num_layers=4, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)
OFFER = ["ipc", "mooncake"]  # offer_for("mooncake")
PREFILL, DECODE = "prefill-0", "decode-0"


@contextlib.contextmanager
def pair(bed: bed_lib.Bed, log_dir, *, link: bool = True, prefill_kw: dict | None = None,
         decode_kw: dict | None = None):
    """(prefill on host a, decode on host b), started at once, linked both ways over the Transfer
    Engine unless ``link`` is false.  Afterwards: both quit, none of their processes runs (any the
    test killed included), and a host whose instance quit by itself keeps nothing in /dev/shm."""
    p = HostInstance(bed.a, PREFILL, SPEC, seed=71, log_dir=str(log_dir), **(prefill_kw or {}))
    d = HostInstance(bed.b, DECODE, SPEC, seed=72, log_dir=str(log_dir), **(decode_kw or {}))
    seen: set[int] = set()
    try:
        p.wait_ready()
        d.wait_ready()
        seen.update(p.processes() + d.processes())
        if link:
            assert p.call("link", peer=d.call("descriptor", offer=OFFER), transport="mooncake") == "mooncake"
            assert d.call("link", peer=p.call("descriptor", offer=OFFER), transport="mooncake") == "mooncake"
        yield p, d
        for inst in (p, d):  # a rank restarted meanwhile is one more process to see gone
            if inst.proc.poll() is None:
                with contextlib.suppress(ChildError, TimeoutError, OSError):
                    seen.update(inst.call("pids", answer_within=10))
    finally:
        quit_cleanly = {}
        for inst in (p, d):
            was_running = inst.proc.poll() is None
            inst.close()
            quit_cleanly[inst.host.name] = was_running and inst.proc.returncode == 0
    left = wait_gone(sorted(seen | set(p.processes() + d.processes())), timeout=15)
    assert not left, f"processes of the instances outlived them: {left}"
    for host in (bed.a, bed.b):
        if quit_cleanly[host.name]:
            shm = host.run(["ls", "-A", "/dev/shm"], timeout=10, check=True).stdout.split()
            assert shm == [], f"host {host.name}: left in /dev/shm: {shm}"


def te_addresses(descriptor: dict) -> list[str]:
    return [rank["transports"]["mooncake"]["address"] for rank in descriptor["ranks"]]


def ranks_serve(d: HostInstance) -> None:
    """The decode instance's CTMs are the ones it started, all alive, and a swap out and in is bit-exact."""
    assert d.call("pids") == d.rank_pids and all(alive(pid) for pid in d.rank_pids), "a decode rank died"
    assert d.call("swap", gpu=[30], cpu=[7], back=[31]) is True


def pull(d: HostInstance, name: str, handle: dict, src: list[int], dst: list[int], timeout: float,
         wait: float, **kw) -> dict:
    d.call("pull", name=name, peer=PREFILL, handle=handle, src=src, dst=dst, timeout=timeout, **kw)
    return d.call("outcome", name=name, wait=wait, answer_within=wait + 30)


def assert_failed_naming_prefill(out: dict, *, within: float, address: str | None = None,
                                 errors: tuple[str, ...] = ("TaskFailedError",)) -> None:
    assert "error" in out, f"the pull did not fail: it answered {out!r}"
    assert out["error"] in errors and PREFILL in out["message"], out
    if address is not None:
        assert address in out["message"], f"the failure does not name the peer's address {address}: {out}"
    assert out["seconds"] < within, f"the pull failed only after {out['seconds']:.1f}s: {out}"


# ------------------------------------------------------------------------------------ 1. bit-exact
def test_a_pull_and_a_layerwise_push_across_the_veth_are_bit_exact(two_hosts, tmp_path):
    with pair(two_hosts, tmp_path) as (p, d):
        assert all(a.startswith(f"{two_hosts.a.address}:") for a in te_addresses(p.call("descriptor", offer=OFFER)))
        assert all(a.startswith(f"{two_hosts.b.address}:") for a in te_addresses(d.call("descriptor", offer=OFFER)))
        handle = p.call("expose", req_id="r1")
        src, dst = [1, 2, 3, 9], [10, 11, 12, 20]
        untouched = d.call("digest", ids=[13, 14, 19])
        out = pull(d, "whole", handle, src, dst, timeout=10, wait=20)
        assert out.get("value") == dst, out
        assert d.call("digest", ids=dst) == p.call("digest", ids=src)  # every rank, kind and layer
        assert d.call("digest", ids=[13, 14, 19]) == untouched
        # a layer range: those layers land, the others stay as they were
        before = d.call("digest", ids=[21, 22])
        out = pull(d, "layers", handle, [5, 6], [21, 22], timeout=10, wait=20, layers=[1, 3])
        assert out.get("value") == [21, 22], out
        after, want = d.call("digest", ids=[21, 22]), p.call("digest", ids=[5, 6])
        for key in after:
            assert after[key] == (want[key] if 1 <= int(key.split("/")[2]) < 3 else before[key]), key
        assert p.call("retract", handle=handle) is True

        # a layer-wise push: decode reserves, prefill writes each layer once it is "computed"
        ticket = d.call("receive_push", peer=PREFILL, dst=[24, 25, 26], timeout=30)
        assert "submitted" in p.call("push", peer=DECODE, ticket=ticket, src=[4, 7, 8], layerwise=True, timeout=20)
        for layer in range(1, SPEC["num_layers"] + 1):
            assert p.call("computed", peer=DECODE, layers=layer) == "ok"
        assert d.call("target_result", peer=PREFILL, timeout=20).get("value") == [24, 25, 26]
        assert p.call("push_outcome", peer=DECODE, wait=20).get("value") == [24, 25, 26]
        assert d.call("digest", ids=[24, 25, 26]) == p.call("digest", ids=[4, 7, 8])
        assert p.call("push_released", peer=DECODE, wait=10) is True
        assert d.call("push_state", peer=PREFILL)["released"] is True


# ------------------------------------------------------------------------------ 2. prefill killed
def test_a_pull_from_a_sigkilled_prefill_host_fails_naming_it_and_decode_serves_on(two_hosts, tmp_path):
    with pair(two_hosts, tmp_path) as (p, d):
        handle = p.call("expose", req_id="r1")
        assert pull(d, "warm", handle, [1, 2], [3, 4], timeout=10, wait=20).get("value") == [3, 4]
        before = d.call("digest", ids=[5, 6])
        os.kill(p.pid, signal.SIGKILL)  # the prefill engine; its CTMs follow it
        p.proc.wait(10)
        assert wait_gone(p.rank_pids, timeout=15) == [], "the prefill CTMs outlived their engine"
        out = pull(d, "dead", handle, [1, 2], [5, 6], timeout=10, wait=20)
        assert_failed_naming_prefill(out, within=5.0)
        assert d.call("digest", ids=[5, 6]) == before  # no destination block reported loaded, none changed
        assert d.call("released", name="dead", wait=10) is True
        ranks_serve(d)
        assert d.call("unlink", peer=PREFILL) is True


# --------------------------------------------------------------------------- 3. blackholed contact
def test_a_blackholed_first_contact_fails_in_its_budget_and_a_pull_works_once_the_link_is_back(two_hosts, tmp_path):
    with pair(two_hosts, tmp_path) as (p, d):
        handle = p.call("expose", req_id="r1", ttl=120)
        want = p.call("digest", ids=[1, 2])
        before = d.call("digest", ids=[5, 6])
        two_hosts.blackhole()  # linked (descriptors only): the first packet between them is the pull's
        t0 = time.monotonic()
        out = pull(d, "holed", handle, [1, 2], [5, 6], timeout=3, wait=25)
        elapsed = time.monotonic() - t0
        ranks_serve(d)  # Mooncake's batch id 0 once killed every decode rank (SIGSEGV) here
        assert d.call("released", name="holed", wait=30, answer_within=60) is True
        assert d.call("digest", ids=[5, 6]) == before
        two_hosts.unblackhole()
        again = pull(d, "back", handle, [1, 2], [5, 6], timeout=10, wait=20)
        assert again.get("value") == [5, 6], f"no pull works once the link is back, without a relink: {again}"
        assert d.call("digest", ids=[5, 6]) == want
        ranks_serve(d)
        # checked last, so the rest is seen too: the pull failed in its budget, and said which peer
        # (a rank still in Mooncake's handshake answers late: the engine's timeout may say it, if it names the peer)
        assert elapsed < 8.0
        assert_failed_naming_prefill(out, within=5.0, errors=("TaskFailedError", "TaskTimeoutError"))


# ---------------------------------------------------------------------------- 4. link down mid-pull
def test_a_link_taken_down_mid_pull_fails_naming_the_peer_and_holds_the_blocks_until_none_can_land(two_hosts,
                                                                                                   tmp_path):
    with pair(two_hosts, tmp_path) as (p, d):
        handle = p.call("expose", req_id="r1", ttl=120)
        assert pull(d, "warm", handle, [0], [0], timeout=10, wait=20).get("value") == [0]  # connections made
        ids = list(range(SPEC["num_blocks"]))  # 64 KiB of both ranks' caches from a to b
        two_hosts.throttle(16_000)  # 2 KB/s past the bucket's 16 KiB: the pull runs for many seconds
        d.call("pull", name="cut", peer=PREFILL, handle=handle, src=ids, dst=ids, timeout=3)
        time.sleep(1.0)
        two_hosts.link_down()
        out = d.call("outcome", name="cut", wait=20, answer_within=40)
        # the link is down, the batch still running: bytes may land once it is back
        assert d.call("released", name="cut", wait=1.0) is False, "released while the batch could still write"
        two_hosts.link_up()
        two_hosts.unthrottle()
        assert d.call("released", name="cut", wait=30, answer_within=60) is True, "never released"
        ranks_serve(d)
        after = pull(d, "after", handle, [1, 2], [3, 4], timeout=10, wait=20)
        assert after.get("value") == [3, 4], after
        assert d.call("digest", ids=[3, 4]) == p.call("digest", ids=[1, 2])
        # checked last, so the rest is seen too: a pull whose batch outlived its deadline FAILED,
        # naming the peer and its address (not a successful empty list)
        assert_failed_naming_prefill(out, within=6.0, address=two_hosts.a.address)


# ----------------------------------------------------------------------------- 5. loopback pod_ip
def test_two_hosts_left_at_the_loopback_pod_ip_are_refused_naming_it_and_no_rank_dies(two_hosts, tmp_path):
    loopback = dict(pod_ip="127.0.0.1")
    with pair(two_hosts, tmp_path, link=False, prefill_kw=loopback, decode_kw=loopback) as (p, d):
        theirs = p.call("descriptor", offer=OFFER)
        assert all(a.startswith("127.0.0.1:") for a in te_addresses(theirs))
        for transport in ("mooncake", "auto"):
            with pytest.raises(ChildError, match=r"loopback Transfer Engine address 127\.0\.0\.1:\d+"):
                d.call("link", peer=theirs, transport=transport, offer=OFFER)
        with pytest.raises(ChildError, match=r"127\.0\.0\.1:\d+"):
            p.call("link", peer=d.call("descriptor", offer=OFFER), transport="mooncake")
        assert d.call("linked") == {} and p.call("linked") == {}
        assert p.call("pids") == p.rank_pids and all(alive(pid) for pid in p.processes())
        ranks_serve(d)


# ---------------------------------------------------------------------------- 6. clock 5 h ahead
def test_a_decode_host_whose_clock_is_5h_ahead_pulls_and_times_out_in_the_tasks_budget(host_bed_factory,
                                                                                      tmp_path):
    bed = host_bed_factory(2, clock_offsets={"b": 5 * 3600})
    with pair(bed, tmp_path) as (p, d):
        handle = p.call("expose", req_id="r1", ttl=120)
        out = pull(d, "ok", handle, [1, 2, 3], [8, 9, 10], timeout=10, wait=20)
        assert out.get("value") == [8, 9, 10], out
        assert d.call("digest", ids=[8, 9, 10]) == p.call("digest", ids=[1, 2, 3])
        want, before = p.call("digest", ids=[4, 5]), d.call("digest", ids=[11, 12])
        p.signal_ranks(signal.SIGSTOP)  # their Transfer Engines stop answering
        t0 = time.monotonic()
        out = pull(d, "stopped", handle, [4, 5], [11, 12], timeout=2, wait=20)
        elapsed = time.monotonic() - t0
        assert out.get("error") in ("TaskTimeoutError", "TaskFailedError"), out
        assert out["error"] == "TaskTimeoutError" or PREFILL in out["message"], out
        assert out["seconds"] < 5.0 and elapsed < 7.0, (out, elapsed)  # its 2 s, not 5 h
        p.signal_ranks(signal.SIGCONT)
        assert d.call("released", name="stopped", wait=30, answer_within=60) is True
        assert d.call("digest", ids=[11, 12]) == before
        out = pull(d, "again", handle, [4, 5], [11, 12], timeout=10, wait=20)
        assert out.get("value") == [11, 12], out
        assert d.call("digest", ids=[11, 12]) == want
        ranks_serve(d)


# ---------------------------------------------------------------- 8. a stopped prefill, many pulls
def test_pulls_timing_out_on_a_stopped_prefill_leave_the_decode_ranks_able_to_pull_once_it_continues(two_hosts,
                                                                                                    tmp_path):
    """Each pull whose board-word read outlives its deadline retires that read's scratch words
    (2 of a rank's 64) for good, even once the read has ended: after 32 such pulls a decode rank
    could pull from no peer again until it was restarted."""
    with pair(two_hosts, tmp_path) as (p, d):
        handle = p.call("expose", req_id="r1", ttl=120)
        want = p.call("digest", ids=[1, 2])
        assert pull(d, "warm", handle, [1], [0], timeout=10, wait=20).get("value") == [0]  # handshakes done
        p.signal_ranks(signal.SIGSTOP)
        for i in range(33):  # each into blocks of its own: none waits for another
            out = pull(d, f"stopped{i}", handle, [1], [i % SPEC["num_blocks"]], timeout=0.3, wait=10)
            assert "error" in out and out["seconds"] < 3.0, (i, out)
        p.signal_ranks(signal.SIGCONT)  # the late word reads end now
        for i in range(33):
            assert d.call("released", name=f"stopped{i}", wait=10) is True, i
        out = pull(d, "continued", handle, [1, 2], [3, 4], timeout=5, wait=15)
        assert out.get("value") == [3, 4], f"the decode ranks cannot pull any more: {out}"
        assert d.call("digest", ids=[3, 4]) == want
        ranks_serve(d)


# ------------------------------------------------------------- 9. a pull that could not start
def test_a_pull_that_cannot_start_before_its_deadline_fails_naming_the_peer(two_hosts, tmp_path):
    """A pull queued behind an earlier one on the same destination blocks, whose deadline passes
    before it starts, is answered by the rank's scheduler with its drop value: for a pull that was
    a successful empty list, so the engine saw ``[]`` and no failure."""
    with pair(two_hosts, tmp_path) as (p, d):
        handle = p.call("expose", req_id="r1", ttl=120)
        assert pull(d, "warm", handle, [1], [0], timeout=10, wait=20).get("value") == [0]  # handshakes done
        p.signal_ranks(signal.SIGSTOP)
        d.call("pull", name="first", peer=PREFILL, handle=handle, src=[1, 2], dst=[5, 6], timeout=2)
        second = pull(d, "second", handle, [1, 2], [5, 6], timeout=0.5, wait=10)
        first = d.call("outcome", name="first", wait=10, answer_within=30)
        p.signal_ranks(signal.SIGCONT)
        assert "error" in first and first["seconds"] < 4.0, first
        assert d.call("released", name="second", wait=10) is True
        assert_failed_naming_prefill(second, within=3.0)


# ------------------------------------------------------ 10. one unresponsive prefill, another healthy
def test_a_prefill_instance_that_never_answers_its_first_contact_does_not_hold_up_pulls_from_another(two_hosts,
                                                                                                  tmp_path):
    """Mooncake makes its P2P handshake inside the first ``batch_transfer_async_read`` to a peer, on
    the rank's one P/D pull thread, and waits for a peer that accepted the connection but does not
    answer (a stopped process) up to ~60 s: every pull of that rank, from any instance, waited."""
    with pair(two_hosts, tmp_path) as (p, d):
        healthy = HostInstance(two_hosts.a, "prefill-1", SPEC, seed=73, log_dir=str(tmp_path))
        try:
            healthy.wait_ready()
            assert healthy.call("link", peer=d.call("descriptor", offer=OFFER), transport="mooncake") == "mooncake"
            assert d.call("link", peer=healthy.call("descriptor", offer=OFFER), transport="mooncake") == "mooncake"
            good = healthy.call("expose", req_id="q1", ttl=120)
            warm = d.call("pull", name="warm", peer="prefill-1", handle=good, src=[1], dst=[20], timeout=10)
            assert warm == "submitted" and d.call("outcome", name="warm", wait=20).get("value") == [20]
            handle = p.call("expose", req_id="r1", ttl=120)
            p.signal_ranks(signal.SIGSTOP)  # before any packet between prefill-0 and decode-0
            d.call("pull", name="stuck", peer=PREFILL, handle=handle, src=[1], dst=[5], timeout=2)
            time.sleep(0.2)
            d.call("pull", name="other", peer="prefill-1", handle=good, src=[2, 3], dst=[21, 22], timeout=2)
            other = d.call("outcome", name="other", wait=10, answer_within=30)
            stuck = d.call("outcome", name="stuck", wait=10, answer_within=30)
            p.signal_ranks(signal.SIGCONT)
            assert d.call("released", name="stuck", wait=30, answer_within=60) is True
            assert "error" in stuck and stuck["seconds"] < 4.0, stuck
            assert other.get("value") == [21, 22], f"a pull from the healthy instance waited for the stopped one: " \
                                                   f"{other}"
            assert d.call("digest", ids=[21, 22]) == healthy.call("digest", ids=[2, 3])
        finally:
            healthy.close()
        assert wait_gone(healthy.processes(), timeout=15) == []
