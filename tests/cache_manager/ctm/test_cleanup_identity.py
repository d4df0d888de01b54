"""Clean-up by identity (DESIGN §4): a CTM removes only the files it attached, while its names still
hold them, and what the processes that created them left once those are provably gone; an instance
killed whole is swept at the next start.  Each fault is caused for real (SIGSTOP, SIGKILL of real
processes) and /dev/shm is compared by name and identity afterwards."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from cache_manager.cache_data import CACHE_TRANSFER_INITED_SIGNAL, CacheStatus
from cache_manager.queue import wire
from engine_hooks.core.launcher import REPO_ROOT, free_port
from ops.shm import SHM_DIR, SharedMemorySegment, segment_identity, sweep_orphans
from ops.shm_ledger import CREATOR_PREFIX, Creator
from tests.service_helpers import process_gone, segments_of, start_service


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.05)


def identities(port: int) -> dict[str, tuple[int, int] | None]:
    return {name: segment_identity(name) for name in segments_of(port)}


def creator_records(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{CREATOR_PREFIX}{pid}-")]


def run_engine(tmp_path, script: str, *args: str, new_session: bool = False) -> tuple[subprocess.Popen, dict]:
    """``script`` as an engine process; it and the JSON line it printed."""
    err = open(tmp_path / "engine.err", "ab")
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT, "CTM_LOG_DIR": str(tmp_path)}, cwd=REPO_ROOT,
                            start_new_session=new_session)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        proc.wait(10)
        raise AssertionError((tmp_path / "engine.err").read_text()[-3000:])
    return proc, json.loads(line)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def keep_secret_env():
    """An engine in this process (FastDeploy's queue façade) sets the queue secret's environment."""
    before = {k: os.environ.get(k) for k in (wire.SECRET_ENV, wire.SECRET_FILE_ENV)}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# A FastDeploy-style engine: names with the bare port (no token), so an engine restarted on the same
# port reuses every name of the first.
FD_ENGINE = textwrap.dedent("""
    import json, sys, time
    from tests.fastdeploy_engine import FastDeployEngine
    engine = FastDeployEngine(tp=2, fastdeploy_signals=True, port=int(sys.argv[1])).start()
    print(json.dumps({"ctms": [engine.procs[r].pid for r in range(2)]}), flush=True)
    time.sleep(120)  # until the test kills it
""")


def test_a_stale_ctm_woken_after_its_engine_restarted_on_its_port_leaves_the_new_engine_alone(tmp_path,
                                                                                               keep_secret_env):
    from tests.fastdeploy_engine import FastDeployEngine

    port = free_port()
    first, info = run_engine(tmp_path, FD_ENGINE, str(port))
    stale, other = info["ctms"]
    second = None
    try:
        assert len(segments_of(port)) > 16
        os.kill(stale, signal.SIGSTOP)  # rank 0 cannot notice its engine's death until it runs again
        first.kill()
        first.wait(10)
        wait_for(lambda: process_gone(other), 10, "rank 1 following its engine")
        wait_for(lambda: segments_of(port) == [], 5, "the dead engine's names removed by rank 1")

        second = FastDeployEngine(tp=2, fastdeploy_signals=True, port=port).start()  # same port, same names
        before = identities(port)
        assert len(before) > 16 and all(before.values())
        os.kill(stale, signal.SIGCONT)
        wait_for(lambda: process_gone(stale), 10, "the stale rank to notice its engine is gone")
        after = identities(port)
        assert sorted(set(before) - set(after)) == [], "the stale CTM removed the new engine's names"
        assert after == before, "a name of the new engine now holds another file"

        # the new engine restarts a rank: it attaches the caches that must still be there
        second.procs[0].popen.kill()
        second.procs[0].popen.wait(10)
        second.signals[CACHE_TRANSFER_INITED_SIGNAL].value[0] = 0
        second.launch(0)
        second.wait_ready([0, 1], 30)
        second.fill(seed=3)
        want = {k: v[2].copy() for k, v in second.views().items()}
        second.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out", [1], [2], [0]))
        second.signals_for(1)
        for view in second.views().values():
            view[5] = 0
        second.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in", [1], [5], [0]))
        second.signals_for(1)
        assert all(np.array_equal(v[5], want[k]) for k, v in second.views().items()), "the restarted rank's swap"
        assert identities(port) == before
    finally:
        kill_all([stale, other])
        if first.poll() is None:
            first.kill()
            first.wait(10)
        leftovers = second.close() if second is not None else segments_of(port)
        for name in segments_of(port):  # only after a failure: leave nothing behind
            os.unlink(os.path.join(SHM_DIR, name))
    assert leftovers == []


# An engine of ours (CacheTransferService: names with its port and a random token), in a session of
# its own with its CTMs, so that one killpg kills the whole instance at once.
SERVICE_ENGINE = textwrap.dedent("""
    import json, os, time
    from tests.service_helpers import start_service
    svc = start_service()
    print(json.dumps({"port": svc.port, "prefix": svc.platform.segment_prefix, "pid": os.getpid(),
                      "ctms": list(svc.pids().values())}), flush=True)
    time.sleep(120)  # until the test kills it
""")


def test_an_instance_killed_whole_is_swept_at_the_next_start_and_a_paused_one_is_not(tmp_path):
    dead, dead_info = run_engine(tmp_path, SERVICE_ENGINE, new_session=True)
    paused, paused_info = run_engine(tmp_path, SERVICE_ENGINE)
    svc = None
    try:
        os.killpg(dead.pid, signal.SIGKILL)  # engine and CTMs at once: nobody is left to clean up
        dead.wait(10)
        wait_for(lambda: all(process_gone(p) for p in dead_info["ctms"]), 10, "the killed CTMs gone")
        left = [n for n in os.listdir(SHM_DIR) if n.startswith(dead_info["prefix"])]
        assert len(left) > 16, f"the killed instance left only {left}: the fault did not happen"
        assert creator_records(dead_info["pid"])

        paused.send_signal(signal.SIGSTOP)  # alive, only not running: its names are its own
        kept = identities(paused_info["port"])
        assert len(kept) > 16

        svc = start_service(tp=1, log_dir=str(tmp_path / "new"))
        assert [n for n in os.listdir(SHM_DIR) if n.startswith(dead_info["prefix"])] == [], \
            "the new start left the killed instance's names"
        assert segments_of(dead_info["port"]) == [] and creator_records(dead_info["pid"]) == []
        assert identities(paused_info["port"]) == kept, "the sweep touched a paused (live) engine's names"
        assert svc.swap_to_cpu([1], [0]).result(timeout=20) is not None
    finally:
        if svc is not None:
            svc.shutdown()
        paused.send_signal(signal.SIGCONT)
        for proc in (dead, paused):  # the paused engine's CTMs follow it and clean up after it
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        deadline = time.monotonic() + 10
        while not all(process_gone(p) for p in paused_info["ctms"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        kill_all(dead_info["ctms"] + paused_info["ctms"])
        for port in (dead_info["port"], paused_info["port"]):  # only after a failure: leave nothing behind
            for name in segments_of(port):
                os.unlink(os.path.join(SHM_DIR, name))
        sweep_orphans()


def _record(name: str, creator: Creator, entries: list[tuple[str, tuple[int, int]]]) -> str:
    path = os.path.join(SHM_DIR, name)
    with open(path, "x") as f:
        f.write(creator.header() + "".join(f"{i[0]} {i[1]} {n}\n" for n, i in entries))
    os.chmod(path, 0o600)
    return path


def _made_elsewhere(name: str) -> tuple[str, tuple[int, int]]:
    """A file in /dev/shm as another process would leave it (not in this process's creator record)."""
    path = os.path.join(SHM_DIR, name)
    with open(path, "xb") as f:
        f.write(b"x" * 64)
    return name, segment_identity(name)


def test_the_sweep_goes_by_creator_and_identity(tmp_path):
    """Hand-made creator records: a process that runs keeps its names, a reused pid (another start time) or a
    gone one does not; a name replaced since, a symlink, or a process of another pid namespace stay."""
    me = Creator.this_process()
    tag = f"ctm.t{os.getpid()}sweep."
    live_name, reused_name, replaced, linked, other_ns = (tag + s for s in ("live", "reused", "replaced", "link",
                                                                            "otherns"))
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    paths = []
    try:
        live = _made_elsewhere(live_name)
        reused = _made_elsewhere(reused_name)
        old = _made_elsewhere(replaced)
        os.unlink(os.path.join(SHM_DIR, replaced))
        new = _made_elsewhere(replaced)
        assert old != new
        os.symlink(target, os.path.join(SHM_DIR, linked))
        ns = _made_elsewhere(other_ns)
        fake = 4_000_000 + os.getpid() % 100_000  # ids a real record of this host never carries
        paths = [_record(f"{CREATOR_PREFIX}{fake}-1", Creator(me.pid, me.start, me.pidns, me.boot), [live]),
                 _record(f"{CREATOR_PREFIX}{fake}-2", Creator(me.pid, me.start + 1, me.pidns, me.boot),
                         [reused, (replaced, old[1]), (linked, segment_identity(linked))]),
                 _record(f"{CREATOR_PREFIX}{fake}-3", Creator(fake, 1, me.pidns + 1, me.boot), [ns])]
        removed = sweep_orphans()
        assert reused_name in removed and live_name not in removed and replaced not in removed
        remaining = set(os.listdir(SHM_DIR))
        assert {live_name, replaced, linked, other_ns} <= remaining and reused_name not in remaining
        assert segment_identity(replaced) == new[1] and target.read_bytes() == b"keep"
        assert [os.path.exists(p) for p in paths] == [True, False, True], "only the dead creator's record goes"
    finally:
        for name in (live_name, reused_name, replaced, linked, other_ns):
            if os.path.lexists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_a_process_lists_what_it_creates_and_its_record_goes_with_the_last_name():
    name = f"ctm.t{os.getpid()}ledger.a"
    record = os.path.join(SHM_DIR, Creator.this_process().record_name)
    had_record = os.path.exists(record)  # segments this process created earlier and still holds
    seg = SharedMemorySegment(name, 4096, create=True)
    try:
        text = open(record).read()
        assert text.startswith("ctm-creator/1 ") and f"{seg.identity[0]} {seg.identity[1]} {name}\n" in text
        assert os.stat(record).st_mode & 0o777 == 0o600
    finally:
        seg.close()
        seg.unlink()
    assert os.path.exists(record) == had_record
