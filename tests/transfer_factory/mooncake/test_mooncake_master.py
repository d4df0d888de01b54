"""MooncakeStore when its real mooncake_master is killed, hung or gone, the master's HTTP metadata
server, and the helper script that starts a master; no mocks.

Needs the mooncake-transfer-engine(-non-cuda) wheel; skipped without it.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from scripts.local_mooncake_master import LocalMooncakeMaster  # noqa: E402
from transfer_factory.mooncake import MooncakeStore  # noqa: E402
from transfer_factory.mooncake.config import load_mooncake_config  # noqa: E402
from tests import mooncake_helpers  # noqa: E402
from tests.mooncake_helpers import SMALL, Buffers, keys_for  # noqa: E402

_clean_mooncake_env = mooncake_helpers._clean_mooncake_env  # the shared fixture, under its name here

HANG_BOUND_S = 30.0      # a hang check, not a speed check
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---- master failures ---------------------------------------------------------------------------

def _timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def _wait_until_works(s, b, keys, deadline_s):
    """Write and read back until both succeed (the master came back empty); returns seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        results, took = _timed(s.batch_set, keys, b.src_ptrs(), b.sizes())
        assert took < HANG_BOUND_S
        if results == [0] * len(keys):
            b.dst[:] = 0
            got, took = _timed(s.batch_get, keys, b.dst_ptrs(), b.sizes())
            assert took < HANG_BOUND_S
            if got == b.sizes() and np.array_equal(b.src, b.dst):
                return time.monotonic() - start
        else:
            assert all(r < 0 for r in results), results
        time.sleep(0.2)
    pytest.fail(f"store did not recover within {deadline_s}s: {s.stats}")


def test_master_killed_then_restarted():
    with LocalMooncakeMaster(lease_ttl_ms=500) as m:
        s = MooncakeStore(namespace="fault", rank=0, options={**m.config(), **SMALL, "retry_interval": 0.5,
                                                              "reconnect_after": 5, "rpc_timeout_ms": 3000})
        try:
            b = Buffers(s, 8, 32 << 10, seed=10)
            keys = keys_for("fault", "k", 8)
            assert s.batch_set(keys, b.src_ptrs(), b.sizes()) == [0] * 8
            assert s.batch_get(keys, b.dst_ptrs(), b.sizes()) == b.sizes()

            m.kill()
            worst = 0.0
            outage_start = time.monotonic()
            while time.monotonic() - outage_start < 3.0:
                for fn, args in ((s.exists, (keys,)), (s.batch_set, (keys, b.src_ptrs(), b.sizes())),
                                 (s.batch_get, (keys, b.dst_ptrs(), b.sizes())),
                                 (s.batch_get_multi, (keys, [[p] for p in b.dst_ptrs()], [[n] for n in b.sizes()]))):
                    results, took = _timed(fn, *args)
                    worst = max(worst, took)
                    assert all(r < 0 for r in results), (fn.__name__, results)
                time.sleep(0.05)
            assert worst < HANG_BOUND_S
            assert s.is_down() and s.stats["fast_failed"] > 0

            m.restart()                                     # same ports, empty
            _wait_until_works(s, b, keys, deadline_s=30.0)
            assert not s.is_down()

            # A forced re-setup: new client, buffers registered again, old one retired.
            assert s.reconnect()
            assert s.stats["reconnects"] >= 1
            _wait_until_works(s, b, keys_for("fault", "after", 8), deadline_s=30.0)
        finally:
            s.close()


def test_master_hung_calls_are_bounded():
    """SIGSTOP: the master accepts connections but never answers; calls end with the RPC timeout."""
    with LocalMooncakeMaster(lease_ttl_ms=500) as m:
        s = MooncakeStore(namespace="hung", rank=0, options={**m.config(), **SMALL, "retry_interval": 0.5,
                                                             "rpc_timeout_ms": 1000})
        b = Buffers(s, 4, 4096, seed=11)
        keys = keys_for("hung", "k", 4)
        try:
            assert s.batch_set(keys, b.src_ptrs(), b.sizes()) == [0] * 4
            os.kill(m.pid, signal.SIGSTOP)
            try:
                worst = 0.0
                start = time.monotonic()
                while time.monotonic() - start < 2.5:
                    results, took = _timed(s.batch_set, keys_for("hung", "new", 4), b.src_ptrs(), b.sizes())
                    worst = max(worst, took)
                    assert all(r < 0 for r in results), results
                assert worst < HANG_BOUND_S
                assert s.is_down()
                # A reconnect against a stopped master is not tried: its setup would hold the GIL
                # (every thread here stopped) for the RPC timeout times the retries.
                reconnect_s = _timed(s.reconnect)
                assert reconnect_s[0] is False and reconnect_s[1] < 2.5, reconnect_s
            finally:
                os.kill(m.pid, signal.SIGCONT)
            _wait_until_works(s, b, keys_for("hung", "again", 4), deadline_s=30.0)
        finally:
            s.close()


CLOSE_AFTER_KILL = """
import json, os, sys, threading, time
sys.path.insert(0, %r)
from scripts.local_mooncake_master import LocalMooncakeMaster
from transfer_factory.mooncake.store import MooncakeStore
m = LocalMooncakeMaster().start()
s = MooncakeStore(namespace="gone", rank=0, options={**m.config(), "global_segment_size": "16mb",
                                                     "local_buffer_size": "16mb"})
m.kill()
time.sleep(3)                     # the client's heartbeat is now stuck reconnecting
gaps = [0.0]
def tick():
    last = time.monotonic()
    while True:
        time.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.1)
t0 = time.monotonic()
s.close()
print(json.dumps({"close_s": time.monotonic() - t0, "max_gap_s": max(gaps)}), flush=True)
os._exit(0)                       # as a CTM does: the library's teardown would block for seconds
"""


def test_close_with_the_master_gone_is_quick_and_never_freezes_the_process():
    # Mooncake's close holds the GIL for 11-19 s once the master is gone; the store parks the client.
    out = subprocess.run([sys.executable, "-c", CLOSE_AFTER_KILL % REPO], capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["close_s"] < 3.0 and result["max_gap_s"] < 1.5, result


def test_the_http_metadata_server_runs_only_when_asked_for():
    with LocalMooncakeMaster(lease_ttl_ms=500, http_metadata=True) as m:
        assert m.metadata_server.startswith("http://127.0.0.1:")
        s = MooncakeStore(namespace="http", rank=0, options={**m.config(), **SMALL})
        try:
            b = Buffers(s, 2, 4096, seed=12)
            keys = keys_for("http", "k", 2)
            assert s.batch_set(keys, b.src_ptrs(), b.sizes()) == [0, 0]
            assert s.batch_get(keys, b.dst_ptrs(), b.sizes()) == b.sizes() and np.array_equal(b.src, b.dst)
        finally:
            s.close()
    with LocalMooncakeMaster() as m:
        assert m.metadata_server == "P2PHANDSHAKE" and "--enable_http_metadata_server=true" not in m._argv()


# ---- the helper script --------------------------------------------------------------------------

def test_start_script_prints_config_and_stops_on_sigint(tmp_path):
    temp_dirs = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mooncake-master-")}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "start_mooncake_master.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CTM_LOG_DIR": str(tmp_path)})
    try:
        line = proc.stdout.readline()
        config = json.loads(line)
        assert config["master_server_addr"].startswith("127.0.0.1:")
        assert config["metadata_server"] == "P2PHANDSHAKE"  # no metadata server: nothing beyond loopback
        cfg, _ = load_mooncake_config(config, {})
        assert cfg.master_server_addr == config["master_server_addr"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{config['pid']}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{config['pid']}"), "master left running"
        assert config["log"] == str(tmp_path / "mooncake_master.log") and os.path.exists(config["log"])
        assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mooncake-master-")} <= temp_dirs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
