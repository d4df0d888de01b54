"""Several engine instances over one Mooncake pool (issue 13), for real: a real mooncake_master on
loopback, each instance its own CTM processes whose Mooncake clients mount their own segments.

* a block one instance wrote is read bit-exact by another (they share one namespace);
* an instance's engine process is SIGKILLed: its CTMs and their clients go with it; until the master
  drops them, and after, the other instance's reads of its blocks are misses or the right bytes,
  never wrong ones; the survivor writes and reads on; nothing of the dead instance is left;
* the replay over two instances reaches the trace's ceiling with round-robin routing and an
  unbounded store, and session routing keeps a conversation on one instance; with a kill it counts
  the lost blocks and leaves nothing behind.

The file runs alone (``pytest tests/transfer_factory/mooncake/test_multi_instance.py``) in about a minute on
two cores.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from engine_hooks import CacheSpec  # noqa: E402
from tests.service_helpers import fill_distinct, process_gone, start_service, views  # noqa: E402
from tests.scripts.test_replay import REPLAY, REPO, independent_ceiling, private_env, run_replay, trace_slice  # noqa: E402
from transfer_factory.keys import chain_hash_ids  # noqa: E402
from scripts.local_mooncake_master import LocalMooncakeMaster  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))

import replay_instances  # noqa: E402
from replay_instance_kill import PoolInspector, shm_leftovers  # noqa: E402
from replay_workload import Content, Request  # noqa: E402

# Whole 8-byte words per block (Content writes uint64s): 16 tokens x 64 bf16 = 2 KiB per layer-block.
SPEC = CacheSpec(num_layers=2, num_blocks=64, kv_heads=1, block_size=16, head_dim=64)
SIZES = {"global_segment_size": 32 << 20, "local_buffer_size": 8 << 20}
CLIENT_TTL_S = 4   # clients ping every second: room for a loaded machine, short for the kill test


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with LocalMooncakeMaster(client_ttl_s=CLIENT_TTL_S, log_dir=str(tmp_path_factory.mktemp("master"))) as m:
        yield m


def options(master) -> dict:
    return {**master.config(), **SIZES, "retry_interval": 0.2}


def test_a_block_one_instance_wrote_is_read_bit_exact_by_another(master):
    a = start_service(SPEC, tp=1, storage_backend="mooncake", storage_options=options(master), model_id="multi/share")
    b = start_service(SPEC, tp=1, storage_backend="mooncake", storage_options=options(master), model_id="multi/share")
    try:
        assert a.namespace() == b.namespace()
        # each instance's CTM mounted its own segment into the pool
        segments = [k for k in master.metrics() if k.startswith("segment_total_capacity_bytes{")]
        assert len(segments) >= 2, segments
        fill_distinct(a, seed=21)
        fill_distinct(b, seed=22)
        va, vb = views(a), views(b)
        keys = chain_hash_ids([f"share-{i}" for i in range(6)])
        assert a.write_storage(keys, [0, 1, 2, 3, 4, 5]).result(timeout=60) == [0, 1, 2, 3, 4, 5]
        dst = [40, 41, 42, 43, 44, 45]
        assert b.read_storage(keys, dst).result(timeout=60) == dst
        for k in va:
            assert np.array_equal(vb[k][dst], va[k][:6]), f"rank/kind/layer {k}"
        # and the other way round
        back = chain_hash_ids([f"back-{i}" for i in range(3)])
        assert b.write_storage(back, [7, 8, 9]).result(timeout=60) == [7, 8, 9]
        assert a.read_storage(back, [20, 21, 22]).result(timeout=60) == [20, 21, 22]
        for k in va:
            assert np.array_equal(va[k][[20, 21, 22]], vb[k][[7, 8, 9]])
    finally:
        a.shutdown()
        b.shutdown()


def _read_and_check(svc, content: Content, hashes: list[str], blocks: list[int]) -> int:
    """Poison ``blocks``, read ``hashes`` into them: every block loaded must hold exactly its bytes."""
    for v in views(svc).values():
        v[blocks] = 0xA5
    loaded = svc.read_storage(hashes, blocks, timeout=10).result(timeout=40)
    assert loaded == blocks[:len(loaded)]
    ok = content.verify(hashes[:len(loaded)], loaded)
    assert ok.all(), f"blocks {[b for b, good in zip(loaded, ok) if not good]} loaded wrong bytes"
    return len(loaded)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_killed_instance_leaves_misses_never_wrong_bytes_and_nothing_behind(master, tmp_path, replicas):
    """With one replica an object lives in one segment: A's death takes what landed in its own.  With
    two, Mooncake puts them on distinct segments, here one in each instance's: nothing is lost."""
    opts = {**options(master), "replica_num": replicas}
    cfg = replay_instances.engine_config(SPEC, 1, opts, f"multi/kill{replicas}", device_blocks=SPEC.num_blocks,
                                         task_timeout=10.0, log_dir=str(tmp_path / "a"))
    a = replay_instances.EngineInstance(0, cfg)
    b = None
    inspector = None
    try:
        b = start_service(SPEC, tp=1, storage_backend="mooncake", storage_options=opts, model_id=f"multi/kill{replicas}",
                          log_dir=str(tmp_path / "b"))
        a.wait_ready()
        content = Content(b)
        hashes = chain_hash_ids([f"kill-{os.getpid()}-{i}" for i in range(24)])
        served = a.serve(1, hashes, timeout=60)  # A computes the prefix and writes it through
        assert served.sources == ["miss"] * 24 and a.stats["storage_write_blocks"] == 24
        assert _read_and_check(b, content, hashes, list(range(24))) == 24, "B should read all of A's blocks"

        inspector = PoolInspector(opts, str(b.namespace()), tp=1)
        segments = len(master.segments())
        pids, info = a.info["ctm_pids"], a.info
        a.kill()
        deadline = time.monotonic() + 15
        while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(process_gone(p) for p in pids), "A's CTMs outlived their engine"
        # until the master drops A's client: its objects still "exist" but cannot be read
        t0 = time.monotonic()
        window = _read_and_check(b, content, hashes, list(range(24, 48)))
        assert time.monotonic() - t0 < 30, "a read of a dead segment's objects outlived its task"
        assert master.wait_for_segments(segments - 1, CLIENT_TTL_S + 20), "the master kept A's segment"
        held = inspector.held(hashes)
        present = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        after = _read_and_check(b, content, hashes, list(range(24, 48)))
        assert after == present, (window, present, after)  # the leading run of blocks the pool still holds
        if replicas == 1:
            # P(all 48 objects landed in B's segment) = 2**-48: some blocks went with A's segment
            assert len(held) < len(hashes), "nothing was lost: were A's objects all placed in B's segment?"
        else:
            assert len(held) == after == len(hashes), "a block with a replica in each segment was lost"

        # B serves on: new blocks, and the lost ones recomputed, written and read back bit-exact
        fresh = chain_hash_ids([f"fresh-{os.getpid()}-{i}" for i in range(8)])
        content.write(fresh, list(range(48, 56)))
        assert b.write_storage(fresh, list(range(48, 56))).result(timeout=60) == list(range(48, 56))
        assert _read_and_check(b, content, fresh, list(range(56, 64))) == 8
        content.write(hashes, list(range(24)))
        assert b.write_storage(hashes, list(range(24))).result(timeout=60) == list(range(24))
        assert _read_and_check(b, content, hashes, list(range(24, 48))) == 24

        # nothing of A is left: its engine, its CTMs (above), its /dev/shm segments
        assert process_gone(a.proc.pid)
        deadline = time.monotonic() + 10
        while shm_leftovers(info) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shm_leftovers(info) == []
    finally:
        if inspector is not None:
            inspector.close()
        a.stop(timeout=10)
        if b is not None:
            b.shutdown()


def test_routing_round_robin_and_sessions():
    reqs = [Request(i, 0.0, 512, 1, (i % 5, 100 + i)) for i in range(40)]
    rr = replay_instances.Router(3, "round-robin")
    assert [rr.pick(r) for r in reqs[:6]] == [0, 1, 2, 0, 1, 2]
    rr.drop(1)
    assert [rr.pick(r) for r in reqs[:4]] == [0, 2, 0, 2]
    s = replay_instances.Router(3, "session")
    first = {r.hash_ids[0]: s.pick(r) for r in reqs}
    assert all(s.pick(r) == first[r.hash_ids[0]] for r in reqs), "a conversation moved"
    victim = first[0]
    s.drop(victim)
    moved = {r.hash_ids[0]: s.pick(r) for r in reqs}
    assert all(moved[k] == v for k, v in first.items() if v != victim), "a survivor's conversation moved"
    assert victim not in moved.values()


def _no_master_left(proc) -> None:
    port = proc.stdout.split("started a local mooncake_master at 127.0.0.1:")[1].split()[0]
    ps = os.popen("ps -eo args").read()
    assert f"--rpc_port={port}" not in ps, "the replay left its master running"
    assert "replay_instances.py --child" not in ps, "the replay left an instance running"


def test_two_instance_replay_reaches_the_ceiling_round_robin(tmp_path):
    env = {k: v for k, v in private_env(tmp_path).items() if not k.startswith("MOONCAKE_")}
    path = trace_slice(tmp_path, 200)
    result, proc = run_replay(tmp_path, "--trace", path, "--storage", "mooncake", "--instances", "2",
                              "--route", "round-robin", "--tp", "1", "--unbounded", "--host-blocks", "0",
                              "--mooncake-segment-size", "128mb", "--mooncake-local-buffer-size", "16mb", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits, total = independent_ceiling(path)
    assert (result["hit_blocks"], result["blocks"]) == (hits, total), "round-robin fell short of the ceiling"
    assert result["corrupt_blocks"] == 0 and result["instances"] == 2 and result["route"] == "round-robin"
    # an instance finds on device only what it computed itself: the rest came from the other's writes
    assert result["cross_instance_hits"] == result["storage_read_blocks"] > 0
    assert result["cross_instance_hit_ratio"] == pytest.approx(result["cross_instance_hits"] / total, abs=1e-6)
    assert [p["requests"] for p in result["per_instance"]] == [100, 100]
    assert result["lost_blocks"] == 0 and result["killed_instance"] is None
    assert "cross-instance hits" in proc.stdout
    _no_master_left(proc)


def test_session_routing_with_a_killed_instance(tmp_path):
    env = {k: v for k, v in private_env(tmp_path).items() if not k.startswith("MOONCAKE_")}
    path = trace_slice(tmp_path, 240)
    result, proc = run_replay(tmp_path, "--trace", path, "--storage", "mooncake", "--instances", "2",
                              "--route", "session", "--tp", "1", "--unbounded", "--host-blocks", "0",
                              "--mooncake-segment-size", "128mb", "--mooncake-client-ttl", str(CLIENT_TTL_S),
                              "--kill-instance-at", "120", "--kill-instance", "1", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits, total = independent_ceiling(path)
    assert result["blocks"] == total and result["hit_blocks"] <= hits and result["corrupt_blocks"] == 0
    # a conversation stays on its instance: before the kill nothing crosses (every shared prefix
    # shares its first hash id); its conversations then go to the survivor
    assert result["killed_instance"] == 1 and result["kill_at_request"] == 120
    assert result["hit_ratio_before_kill"] == pytest.approx(result["ceiling_before_kill"])
    assert 0 <= result["lost_blocks"] <= result["stored_blocks_at_kill"] and result["stored_blocks_at_kill"] > 0
    assert result["killed_leftovers"] == {"processes": [], "segments": []}
    survivor, dead = result["per_instance"][0], result["per_instance"][1]
    assert survivor["alive_at_end"] and not dead["alive_at_end"]
    assert survivor["requests"] + dead["requests"] == 240 and dead["requests"] < 120
    assert result["cross_instance_hits"] == survivor["cross_instance_hits"] and dead["cross_instance_hits"] == 0
    assert "killed instance" in proc.stdout and "hit ratio after kill" in proc.stdout
    _no_master_left(proc)


def test_multi_instance_flags_are_checked(tmp_path):
    for args, message in ((["--instances", "2", "--storage", "file"], "needs --storage mooncake"),
                          (["--instances", "1", "--kill-instance-at", "3"], "needs --instances 2"),
                          (["--instances", "2", "--storage", "mooncake", "--kill-instance", "2",
                            "--kill-instance-at", "3"], "--kill-instance 2 must be in 0..1"),
                          (["--instances", "2", "--storage", "mooncake", "--max-requests", "5",
                            "--kill-instance-at", "9"], "the replay has 5 requests")):
        result, proc = run_replay(tmp_path, *args)
        assert proc.returncode == 2 and result is None, proc.stderr[-2000:]
        assert message in proc.stderr, proc.stderr[-2000:]


def _children(pids: set[int]) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) in pids:
                        out.add(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_a_killed_replay_leaves_no_instance_ctm_master_or_segment(tmp_path):
    """The replay is SIGKILLed mid-run: its instances (which watch it), their CTMs (which watch them),
    its master (which dies with it) and every /dev/shm segment of theirs are gone within seconds."""
    import select
    import subprocess

    env = {k: v for k, v in private_env(tmp_path).items() if not k.startswith("MOONCAKE_")}
    path = trace_slice(tmp_path, 1500)
    proc = subprocess.Popen([*REPLAY, "--trace", path, "--storage", "mooncake", "--instances", "2", "--tp", "1",
                             "--mooncake-segment-size", "128mb"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=REPO, env=env)
    try:
        lines, deadline = [], time.monotonic() + 120
        while not any("engine instances up" in line for line in lines) and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                assert line, f"the replay ended early: {lines}"
                lines.append(line)
        up = next(line for line in lines if "engine instances up" in line)
        instances = {int(p) for p in up.split("(pids ")[1].split(")")[0].split(", ")}
        time.sleep(2.0)  # mid-replay: the instances serve, the pool holds objects
        ctms = _children(instances)
        master = [p for p in _children({proc.pid}) if p not in instances]
        assert len(ctms) == 2 and len(master) == 1, (ctms, master)
        ports = {n.split(".")[1] for n in os.listdir("/dev/shm")
                 if any(f".dev{p}-" in n for p in instances)}
        assert len(ports) == 2, ports
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    everything = instances | ctms | set(master)
    deadline = time.monotonic() + 20
    while not all(process_gone(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in everything if not process_gone(p)] == []
    def left() -> list[str]:
        return [n for n in os.listdir("/dev/shm") if any(f".{port}." in n or n.endswith(f".{port}") for port in ports)]

    deadline = time.monotonic() + 5
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == []
