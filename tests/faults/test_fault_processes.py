"""Fault matrix rows (DESIGN §3.8, §4) of the CTM processes at TP=2, for real: the order of
dependent swaps, a swap queued on a stopped rank, an exception in the supervisor, a paused
engine.  Each asserts what the engine sees afterwards, byte for byte.  The rest of the matrix
is in test_fault_matrix.py and test_fault_queue_frames.py.
"""
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

from engine_hooks import TaskTimeoutError
from tests.fault_helpers import TIMEOUT, _deadlines_still_fire, _same, _wait_for
from tests.service_helpers import (block_bytes, fill_distinct, process_gone, segments_of, start_service, views,
                                  write_random_blocks)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- order of dependent swaps
@pytest.fixture(scope="module")
def svc():
    service = start_service(extra_flags={"swap_threads": 2})
    yield service
    service.shutdown()


def test_dependent_swaps_take_effect_in_submission_order(svc):
    """1,000 swap-out/swap-in pairs through the same host slot, submitted with no wait between."""
    rng = np.random.default_rng(11)
    v = views(svc)
    num_blocks = svc.spec.num_blocks
    sequences = 0
    while sequences < 1000:
        ids = rng.permutation(num_blocks)[:8]
        slots = rng.permutation(svc.num_cpu_blocks)[:4].tolist()
        sources, targets = ids[:4].tolist(), ids[4:].tolist()
        for view in v.values():
            view[sources] = rng.integers(0, 256, view[sources].shape, dtype=np.uint8)
        want = {k: view[sources].copy() for k, view in v.items()}
        futures = []
        for src, dst, slot in zip(sources, targets, slots):
            futures.append(svc.swap_to_cpu([src], [slot]))
            futures.append(svc.swap_to_gpu([dst], [slot]))
        for f in futures:
            f.result(timeout=20)
        for k, view in v.items():
            assert np.array_equal(view[targets], want[k]), f"sequence {sequences}: {k} out of order"
        sequences += len(sources)


# ---------------------------------------------------------------- a stalled rank
def test_a_swap_queued_on_a_stopped_rank_never_touches_the_reused_block(svc):
    fill_distinct(svc, seed=12)
    assert svc.swap_to_cpu([4], [5]).result(timeout=20)
    held = views(svc)
    pid = svc.pids()[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        future = svc.swap_to_gpu([6], [5], timeout=TIMEOUT)
        with pytest.raises(TaskTimeoutError) as err:
            future.result(timeout=TIMEOUT + 5)
        assert err.value.missing_ranks == [1]
        assert not future.released.done()  # rank 1 has not let go: the engine may not reuse block 6 yet
        rng = np.random.default_rng(13)
        for (rank, _, _), view in held.items():
            view[6] = rng.integers(0, 256, view[6].shape, dtype=np.uint8)  # the engine reuses block 6 anyway
        reused = block_bytes(svc, [6])
    finally:
        os.kill(pid, signal.SIGCONT)
    future.released.result(timeout=10)  # rank 1 answered: it dropped the task, past its deadline
    time.sleep(0.2)
    assert _same(block_bytes(svc, [6]), reused), "the late swap overwrote a block the engine reused"
    assert svc.swap_to_gpu([6], [5]).result(timeout=20)  # and the rank serves on


# ---------------------------------------------------------------- the supervisor survives
def test_an_exception_in_the_supervisor_does_not_stop_deadlines(svc, monkeypatch):
    real = svc.tracker.expire
    calls = {"n": 0}

    def failing_once(now):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected supervisor fault")
        return real(now)

    monkeypatch.setattr(svc.tracker, "expire", failing_once)
    errors = svc.supervisor_errors
    _wait_for(lambda: svc.supervisor_errors > errors, 5, "the injected fault")
    assert svc._supervisor.is_alive()
    _deadlines_still_fire(svc, rank=0)
    fill_distinct(svc, seed=14)
    want = block_bytes(svc, [9])
    svc.swap_to_cpu([9], [1]).result(timeout=20)
    write_random_blocks(svc, [9], seed=15)
    svc.swap_to_gpu([9], [1]).result(timeout=20)
    assert _same(block_bytes(svc, [9]), want)


# ---------------------------------------------------------------- a paused engine
PAUSED_ENGINE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, %r)
    import numpy as np
    from tests.service_helpers import start_service, fill_distinct, views
    svc = start_service()
    fill_distinct(svc, seed=21)
    print(json.dumps({"port": svc.port, "pids": list(svc.pids().values())}), flush=True)
    sys.stdin.readline()
    v = views(svc)
    want = {k: view[[3]].copy() for k, view in v.items()}
    svc.swap_to_cpu([3], [0]).result(timeout=20)
    for view in v.values():
        view[[3]] = 0
    svc.swap_to_gpu([3], [0]).result(timeout=20)
    ok = all(np.array_equal(view[[3]], want[k]) for k, view in v.items())
    print(json.dumps({"round_trip": ok, "pids": list(svc.pids().values())}), flush=True)
    sys.stdin.readline()
    svc.shutdown()
    """
) % REPO


def test_a_paused_engine_keeps_its_caches_and_ctms(tmp_path):
    exit_timeout = 2
    env = {**os.environ, "PYTHONPATH": REPO, "FD_CACHE_PROC_EXIT_TIMEOUT": str(exit_timeout)}
    engine = subprocess.Popen([sys.executable, "-c", PAUSED_ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / "err", "wb"), text=True, env=env)
    try:
        line = engine.stdout.readline()
        assert line, (tmp_path / "err").read_text()[-2000:]
        info = json.loads(line)
        before = segments_of(info["port"])
        engine.send_signal(signal.SIGSTOP)
        time.sleep(2 * exit_timeout + 1)
        engine.send_signal(signal.SIGCONT)
        assert segments_of(info["port"]) == before, "a live engine's segments were removed"
        assert not any(process_gone(p) for p in info["pids"]), "a CTM left a paused engine"
        engine.stdin.write("go\n")
        engine.stdin.flush()
        after = json.loads(engine.stdout.readline())
        assert after == {"round_trip": True, "pids": info["pids"]}
        engine.stdin.write("stop\n")
        engine.stdin.flush()
        assert engine.wait(30) == 0
        assert segments_of(info["port"]) == []
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
