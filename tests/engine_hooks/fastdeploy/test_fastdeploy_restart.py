"""A FastDeploy engine that crashed and is restarted on the same ports while the crashed engine's CTMs
still linger: the old CTMs must leave the new engine's segments alone.

FastDeploy names its signals and caches by its ports alone (``prefix_tree_status.<port>``,
``cache_task_broadcast_signal.<port>``, ...), so engine B, restarted on engine A's
``engine_worker_queue_port`` and ``cache_queue_port``, creates every name A had.  A's CTMs, launched
through a shell as FastDeploy launches them, are stopped (SIGSTOP) before A is killed, so they cannot
notice anything until B is up with CTMs of its own; woken (SIGCONT), they see their engine is gone,
remove what it left and exit.  They must remove only what is A's: B's names still hold the files B
created (by identity, from B's own creator record), B's CTMs and queue still serve, bit-exact, and B
leaves nothing in /dev/shm when it closes."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Iterator

import pytest

from engine_hooks.core.launcher import REPO_ROOT, free_port
from ops.shm import SHM_DIR, segment_identity
from ops.shm_ledger import CREATOR_PREFIX

from tests.service_helpers import process_gone, segments_of

COMMON = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from cache_manager.cache_data import CacheStatus
    from cache_manager.cache_tasks import ReadStorageTask, WriteStorageTask
    from ops.shm_ledger import Creator, parse_record
    from tests.fastdeploy_engine import FastDeployEngine
    port, queue_port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    engine = FastDeployEngine(tp=2, unix_socket=True, fastdeploy_signals=True, port=port, cache_queue_port=queue_port,
                              storage_root=root)
    for rank in range(2):
        engine.launch_like_fastdeploy(rank)
    engine.wait_ready([0, 1], 60)

    def created():  # every segment this process created, with the file it created (its creator record)
        with open(os.path.join("/dev/shm", Creator.this_process().record_name)) as f:
            return {name: list(identity) for name, identity in parse_record(f.read())[1]}

    def swap_and_storage(seed, keys):  # a swap out and in, a storage write and read: bit-exact?
        engine.fill(seed)
        want = {k: v[[2, 3]].copy() for k, v in engine.views().items()}
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, f"out-{seed}", [1], [2], [0]))
        engine.signals_for(1)
        engine.queue.put_transfer_task((CacheStatus.GPU2STORAGE, WriteStorageTask(f"w-{seed}", keys, [], [2, 3])))
        engine.signals_for(2)  # one per rank
        for view in engine.views().values():
            view[[5, 10, 11]] = 0
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, f"in-{seed}", [1], [5], [0]))
        engine.signals_for(1)
        engine.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask(f"r-{seed}", keys, [], [10, 11], 0)))
        engine.signals_for(2)  # one per rank
        views = engine.views().items()
        return {"swap": all(np.array_equal(v[5], want[k][0]) for k, v in views),
                "storage": all(np.array_equal(v[[10, 11]], want[k]) for k, v in views)}

    def info(**extra):
        return json.dumps({"pid": os.getpid(), "shells": [s.pid for s in engine.shells],
                           "ctms": [p.pid for p in engine.queue._core._joined_processes().values()],
                           "queue_dir": os.path.dirname(engine.queue.server.ipc_path), **extra})
""")

# Engine A: up, a swap and a storage write and read; then it waits to be killed.
ENGINE_A = COMMON + textwrap.dedent("""
    print(info(flows=swap_and_storage(3, ["a-0", "a-1"]), created=created()), flush=True)
    sys.stdin.readline()  # until the test kills it
""")

# Engine B on A's ports: up (its CTMs ready), it reports what it created; at "go" its data flows, at
# "close" it closes and reports what it left.
ENGINE_B = COMMON + textwrap.dedent("""
    signals = {sig.name: list(sig.identity) for sig in engine.signals.values()}
    print(info(created=created(), signals=signals), flush=True)
    assert sys.stdin.readline().strip() == "go"
    print(json.dumps({"flows": swap_and_storage(7, ["b-0", "b-1"])}), flush=True)
    assert sys.stdin.readline().strip() == "close"
    print(json.dumps({"left": engine.close()}), flush=True)
""")

# FastDeploy's PrefixCacheManager and engine: the signals B must still own after A's CTMs are gone
FASTDEPLOY_SIGNALS = ("prefix_tree_status", "cache_task_broadcast_signal", "cache_ready_signal",
                      "swap_space_ready_signal", "cache_transfer_inited_signal", "cache_task_is_paused",
                      "cache_task_inflight", "worker_healthy_live_signal", "kv_cache_status")


class Engine:
    """An engine process: its stdin for commands, its stdout's JSON lines."""

    def __init__(self, tmp_path, script: str, name: str, ports: tuple[int, int]):
        self.err_path = tmp_path / f"{name}.err"
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", script, str(ports[0]), str(ports[1]), str(tmp_path / "kv")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env={**os.environ, "PYTHONPATH": REPO_ROOT, "CTM_LOG_DIR": str(tmp_path)},
                                     cwd=REPO_ROOT)
        self.info: dict = {}

    def read(self, timeout: float = 60.0) -> dict:
        """The next JSON line (bounded: a watchdog kills a silent engine, which ends the read)."""
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        assert line, f"the engine printed nothing within {timeout}s: {self.err_path.read_text()[-3000:]}"
        return json.loads(line)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the engine and every shell it launched (each the group of its CTM); stopped ones
        get SIGCONT first."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        groups = [(os.killpg, pid) for pid in self.info.get("shells", [])]  # a shell's group: it and its CTM
        for send, pid in [(os.kill, pid) for pid in self.info.get("ctms", [])] + groups:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    send(pid, sig)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        self._err.close()


@contextlib.contextmanager
def engines(tmp_path) -> Iterator[dict]:
    """The two engines' ports; afterwards every process of both killed and nothing of theirs left."""
    ports = (free_port(), free_port())
    started: dict = {"ports": ports, "engines": []}
    try:
        yield started
    finally:
        for engine in started["engines"]:
            engine.kill()
        for name in segments_of(ports[0]):  # only after a failure: leave nothing behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))


def running(pid: int) -> bool:
    return not process_gone(pid)


def wait_gone(pids: list[int], limit: float) -> float:
    start = time.monotonic()
    while any(running(p) for p in pids) and time.monotonic() - start < limit:
        time.sleep(0.02)
    return time.monotonic() - start


def records_of(pid: int) -> list[str]:
    """The creator records (``ops.shm_ledger``) of process ``pid`` in /dev/shm."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{CREATOR_PREFIX}{pid}-")]


def wake_up(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def now_under(names) -> dict[str, list[int] | None]:
    return {name: (list(i) if (i := segment_identity(name)) else None) for name in names}


@pytest.mark.parametrize("wake", ["after_b_is_up", "while_b_starts"])
def test_a_crashed_engines_lingering_ctms_leave_the_engine_restarted_on_its_ports_alone(tmp_path, wake):
    with engines(tmp_path) as run:
        port = run["ports"][0]
        a = Engine(tmp_path, ENGINE_A, "engine-a", run["ports"])
        run["engines"].append(a)
        a.info = a.read()
        assert a.info["flows"] == {"swap": True, "storage": True}, a.info["flows"]
        stale = a.info["ctms"]
        assert len(stale) == 2 and all(running(p) for p in stale)

        for pid in stale:  # A's CTMs linger: they cannot notice anything until woken
            os.kill(pid, signal.SIGSTOP)
        a.proc.kill()
        a.proc.wait(10)
        assert all(running(p) for p in stale)

        b = Engine(tmp_path, ENGINE_B, "engine-b", run["ports"])
        run["engines"].append(b)
        if wake == "while_b_starts":  # A's CTMs run while B replaces A's names and makes its caches
            signal_names = [f"{name}.{port}" for name in FASTDEPLOY_SIGNALS]
            deadline = time.monotonic() + 30
            while now_under(signal_names) == {n: a.info["created"][n] for n in signal_names}:
                assert time.monotonic() < deadline and b.proc.poll() is None, "B never replaced A's signals"
                time.sleep(0.002)
            wake_up(stale)
        b.info = b.read()
        created = b.info["created"]
        mine = {n: i for n, i in created.items() if n.startswith(f"ctm.{port}.") or n.endswith(f".{port}")}
        for name in FASTDEPLOY_SIGNALS:
            assert b.info["signals"][f"{name}.{port}"] == created[f"{name}.{port}"], name
        assert sum(n.startswith(f"ctm.{port}.") for n in mine) >= 16, sorted(mine)  # caches and their handles
        if wake == "after_b_is_up":
            assert now_under(mine) == mine, "B's names changed before A's CTMs ran"

        wake_up(stale)
        gone_after = wait_gone(stale, 15)
        assert not any(running(p) for p in stale), f"A's CTMs still run 15 s after they were woken: {stale}"
        assert gone_after < 5, f"A's CTMs took {gone_after:.1f}s to notice their engine is gone"

        after = now_under(mine)
        removed = sorted(n for n, i in after.items() if i is None)
        replaced = sorted(n for n, i in after.items() if i is not None and i != mine[n])
        assert not removed and not replaced, f"A's CTMs removed {removed} and replaced {replaced} of engine B's"
        assert all(running(p) for p in b.info["ctms"]), "B's CTMs did not survive A's"
        assert os.path.isdir(b.info["queue_dir"]), "A's CTMs removed B's queue directory"
        assert records_of(a.info["pid"]) == [], "what A left is not all gone with its CTMs"

        b.send("go")
        out = b.read()
        assert out["flows"] == {"swap": True, "storage": True}, out["flows"]
        assert now_under(mine) == mine
        b.send("close")
        assert b.read()["left"] == []
        assert b.proc.wait(20) == 0, b.err_path.read_text()[-3000:]
        assert wait_gone(b.info["ctms"], 10) < 10, "B's CTMs outlived its close"
        assert segments_of(port) == [], "left in /dev/shm for the ports after B closed"
        assert records_of(b.info["pid"]) == [], "B's creator record outlived its close"
