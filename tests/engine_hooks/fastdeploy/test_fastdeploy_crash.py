"""FastDeploy's engine as it runs today, end to end: its Unix-socket queue address, its signal names,
CTMs launched through a shell, a swap, its control requests answered (pause, resume, sleep, wakeup
onto new caches), then a SIGKILL of the engine.

A FastDeploy engine that dies takes the CTMs it launched with it, however they were launched:
FastDeploy starts them through a shell, ``Popen(cmd, shell=True, preexec_fn=os.setsid)``, with no
engine pid, so a CTM's parent is a shell that outlives the engine.  The CTM watches the process at
the other end of its queue link instead (the kernel's peer credentials, a pidfd), and removes what
the dead engine left in /dev/shm.  A paused engine keeps them all."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Iterator

from engine_hooks.core.launcher import REPO_ROOT
from tests.service_helpers import process_gone

# The engine: FastDeploy's Unix-socket queue and signal names, two CTMs launched as FastDeploy does,
# a swap and its control requests; it reports what it saw, then waits to be killed.
ENGINE = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from cache_manager.cache_data import CacheStatus
    from tests.fastdeploy_engine import FastDeployEngine
    engine = FastDeployEngine(tp=2, unix_socket=True, fastdeploy_signals=True, control_timeout=20.0)
    for rank in range(2):
        engine.launch_like_fastdeploy(rank)
    engine.wait_ready([0, 1], 60)
    codes = {m: engine.control(m).error_code for m in ("pause", "resume")}
    codes["sleep"] = engine.control("sleep", {"tags": "weight,kv_cache"}).error_code
    engine.free_caches()  # the worker frees its caches, then makes new ones at the wakeup
    engine.queue.put_transfer_task((CacheStatus.CTRL, {"request_id": "wake", "method": "wakeup",
                                                       "args": {"tags": "weight,kv_cache"}}))
    engine.recreate_caches(seed=7)
    codes["wakeup"] = engine.queue.get_control_response("wake", 20).error_code
    before = {k: v[3].copy() for k, v in engine.views().items()}
    engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out", [1], [3], [0]))  # on the new caches
    engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in", [1], [9], [0]))
    engine.signals_for(2)
    swapped = all(np.array_equal(v[9], before[k]) for k, v in engine.views().items())
    print(json.dumps({"port": engine.port, "shells": [s.pid for s in engine.shells], "codes": codes,
                      "swap_bit_exact": swapped,
                      "ctms": [p.pid for p in engine.queue._core._joined_processes().values()],
                      "queue_dir": os.path.dirname(engine.queue.server.ipc_path)}), flush=True)
    time.sleep(120)  # until the test kills it
""")


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for a reaper does not)."""
    return not process_gone(pid)


def segments_of(port: int) -> list[str]:
    """Every /dev/shm name of the engine on ``port``: its caches (``ctm.<port>.``) and its signals,
    under FastDeploy's names (``<name>.<port>``) or ours (``ctm.<name>.<port>``)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ctm.{port}.") or n.endswith(f".{port}"))


@contextlib.contextmanager
def engine_process(tmp_path, script: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """``script`` run as the engine process: yields it and the JSON line it printed.  Afterwards the
    engine and every shell it launched (each in its own session: its group is the shell's pid) are
    killed, whatever the test left running."""
    err = open(tmp_path / "engine.err", "wb")
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT, "CTM_LOG_DIR": str(tmp_path)},
                              cwd=REPO_ROOT)
    info = None
    try:
        line = engine.stdout.readline()
        assert line, (tmp_path / "engine.err").read_text()[-3000:]
        info = json.loads(line)
        yield engine, info
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        for pid in (info["shells"] if info else []):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        err.close()


def kill_engine(engine: subprocess.Popen, procs: list[int], limit: float) -> float:
    """SIGKILL the engine; the seconds until none of ``procs`` runs, or ``limit`` if some still do."""
    engine.send_signal(signal.SIGKILL)
    engine.wait(10)
    killed = time.monotonic()
    while any(running(p) for p in procs) and time.monotonic() - killed < limit:
        time.sleep(0.05)
    return time.monotonic() - killed


def test_a_killed_engine_takes_its_shell_launched_ctms_and_leaves_nothing_in_dev_shm(tmp_path):
    with engine_process(tmp_path, ENGINE) as (engine, info):
        assert info["codes"] == {"pause": 200, "resume": 200, "sleep": 200, "wakeup": 200}, info["codes"]
        assert info["swap_bit_exact"], "a swap after the wakeup did not move the new caches' bytes"
        procs = info["shells"] + info["ctms"]
        assert len(procs) == 4 and all(running(p) for p in procs)
        before = segments_of(info["port"])
        assert len(before) > 10 and f"cache_ready_signal.{info['port']}" in before

        engine.send_signal(signal.SIGSTOP)  # paused, not dead: everything stays
        time.sleep(1.5)
        assert all(running(p) for p in procs), "a CTM left a paused engine"
        assert segments_of(info["port"]) == before, "a paused engine's segments were removed"
        engine.send_signal(signal.SIGCONT)

        gone_after = kill_engine(engine, procs, 10)
        assert not any(running(p) for p in procs), f"still running 10 s after the engine died: " \
            f"{[p for p in procs if running(p)]}"
        assert gone_after < 5, f"the CTMs took {gone_after:.1f}s to follow their engine"
        assert segments_of(info["port"]) == [], "the dead engine's segments were left in /dev/shm"
        assert not os.path.exists(info["queue_dir"]), "the dead engine's queue directory was left"


# An engine that dies while its CTMs still wait for its caches (before they join the queue).
STARTING_ENGINE = textwrap.dedent("""
    import json, time
    from cache_manager.cache_data import CACHE_READY_SIGNAL
    from tests.fastdeploy_engine import FastDeployEngine
    engine = FastDeployEngine(tp=2, unix_socket=True, fastdeploy_signals=True)
    engine.signals[CACHE_READY_SIGNAL].value[:] = 0  # the worker is still loading the model
    for rank in range(2):
        engine.launch_like_fastdeploy(rank)
    print(json.dumps({"port": engine.port, "shells": [s.pid for s in engine.shells]}), flush=True)
    time.sleep(120)  # until the test kills it
""")


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out


def test_an_engine_killed_while_its_shell_launched_ctms_wait_for_its_caches_takes_them_at_once(tmp_path):
    with engine_process(tmp_path, STARTING_ENGINE) as (engine, info):
        deadline = time.monotonic() + 20
        ctms: list[int] = []
        while len(ctms) < 2:  # each shell's child: the CTM, waiting for cache_ready (attach timeout 20 s)
            ctms = [c for shell in info["shells"] for c in children(shell)]
            assert time.monotonic() < deadline, "the shells never started their CTMs"
            time.sleep(0.05)
        time.sleep(2.0)  # the CTMs are up (past their first lines) and waiting
        assert all(running(p) for p in ctms)
        gone_after = kill_engine(engine, ctms, 15)
        assert gone_after < 5, f"the waiting CTMs took {gone_after:.1f}s to follow their engine (attach timeout 20 s)"
        deadline = time.monotonic() + 5
        while segments_of(info["port"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segments_of(info["port"]) == [], "the dead engine's segments were left in /dev/shm"
