"""Mooncake faults and hygiene, for real: a real mooncake_master, real Mooncake clients in real CTMs.

* every listener of the master and of the CTMs' Mooncake clients is on loopback (/proc/net/tcp*);
* the master leaves nothing in the temp directory, after a ``with`` block and after its owner
  is SIGKILLed (and the master goes with its owner);
* the engine SIGKILLed: every CTM is gone within 10 s with Mooncake storage, whether the master
  outlives the engine, dies with it, or is stopped with a write in flight;
* fault-matrix row: the master SIGSTOPped past the task timeout with a write in flight, SIGCONT
  after the engine reused the blocks: no stored object holds the later bytes, no read returns them.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest

from ops.procs import listening_sockets

pytest.importorskip("mooncake.store")

from tests.service_helpers import (block_bytes, fill_distinct, process_gone, segments_of, start_service,  # noqa: E402
                                  write_random_blocks)
from transfer_factory.keys import chain_hash_ids, storage_key  # noqa: E402
from transfer_factory.mooncake.loopback import loopback_address  # noqa: E402
from scripts.local_mooncake_master import LocalMooncakeMaster  # noqa: E402
from transfer_factory.mooncake.store import MooncakeStore  # noqa: E402

log = logging.getLogger(__name__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SIZES = {"global_segment_size": 64 << 20, "local_buffer_size": 16 << 20}
EXIT_BUDGET_S = 10.0
MC_ENV = ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES")


@pytest.fixture(autouse=True)
def _own_mooncake_env(monkeypatch):
    """The CTMs get the RPC timeouts these tests choose, not ones left in the environment."""
    for name in MC_ENV:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- listeners
def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that ``pid`` holds."""
    return sorted(listening_sockets(pid))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_loopback_hostnames_pick_the_bind_address():
    assert loopback_address("127.0.0.1") == "127.0.0.1"
    assert loopback_address("[::1]") == "::1"
    assert loopback_address("localhost") in ("127.0.0.1", "::1")
    assert loopback_address("10.1.2.3") is None and loopback_address("192.0.2.1") is None


def test_everything_listens_on_loopback_only():
    with LocalMooncakeMaster() as master:
        svc = start_service(storage_backend="mooncake", storage_options={**master.config(), **SIZES},
                            model_id="mcfault/binds")
        try:
            fill_distinct(svc, seed=1)
            hashes = chain_hash_ids([f"binds-{i}" for i in range(6)])
            # Objects land in either CTM's segment: the ranks talk to each other's data ports.
            assert svc.write_storage(hashes, list(range(6))).result(timeout=60) == list(range(6))
            assert svc.read_storage(hashes, list(range(8, 14))).result(timeout=60) == list(range(8, 14))
            found = {"master": listeners(master.pid), **{f"rank{r}": listeners(p) for r, p in svc.pids().items()}}
        finally:
            svc.shutdown()
    log.info("listening sockets: %s", found)
    assert found["master"], "the master's RPC port should be listed"
    for who, socks in found.items():
        if who != "master":   # the handshake socket and the TCP transport's data port, at least
            assert len(socks) >= 2, f"{who} lists {socks}: the Mooncake client's listeners are missing"
        wide = [s for s in socks if not is_loopback(s[0])]
        assert not wide, f"{who} listens beyond loopback: {wide} (all: {socks})"


# ---------------------------------------------------------------- leftovers
def _temp_master_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mooncake-master-")}


def test_the_master_logs_to_the_log_dir_and_leaves_nothing_in_temp(tmp_path, monkeypatch):
    monkeypatch.setenv("CTM_LOG_DIR", str(tmp_path / "logs"))
    before = _temp_master_dirs()
    with LocalMooncakeMaster() as master:
        pid = master.pid
        assert master.log_path == str(tmp_path / "logs" / "mooncake_master.log")
    assert process_gone(pid)
    assert f"--rpc_port={master.rpc_port}" in (tmp_path / "logs" / "mooncake_master.log").read_text()
    assert _temp_master_dirs() - before == set()


OWNER = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, %r)
    from scripts.local_mooncake_master import LocalMooncakeMaster
    master = LocalMooncakeMaster().start()
    print(json.dumps({"pid": master.pid, "log": master.log_path}), flush=True)
    time.sleep(600)
    """
) % REPO


def test_a_killed_owner_takes_its_master_along_and_leaves_nothing_in_temp(tmp_path):
    before = _temp_master_dirs()
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "CTM_LOG_DIR": str(tmp_path / "logs")})
    try:
        info = json.loads(owner.stdout.readline())
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while not process_gone(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(info["pid"]), "the master outlived its SIGKILLed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert info["log"] == str(tmp_path / "logs" / "mooncake_master.log") and os.path.exists(info["log"])
    assert _temp_master_dirs() - before == set()


# ---------------------------------------------------------------- the engine dies
ENGINE = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, %r)
    from tests.service_helpers import fill_distinct, start_service
    from transfer_factory.keys import chain_hash_ids
    from scripts.local_mooncake_master import LocalMooncakeMaster
    options = json.loads(sys.argv[1])
    log_dir = options.pop("log_dir")
    master = None
    if "master_server_addr" not in options:      # the engine runs its own master
        master = LocalMooncakeMaster(log_dir=log_dir).start()
        options.update(master.config())
    svc = start_service(storage_backend="mooncake", storage_options=options, model_id="mcfault/engine",
                        log_dir=log_dir)
    fill_distinct(svc, seed=3)
    stored = svc.write_storage(chain_hash_ids(["e0", "e1"]), [0, 1]).result(timeout=60)
    print(json.dumps({"port": svc.port, "pids": list(svc.pids().values()), "stored": stored,
                      "master": master.pid if master else None}), flush=True)
    sys.stdin.readline()                         # the test may stop the master first
    svc.write_storage(chain_hash_ids(["late0", "late1"]), [2, 3], timeout=30)
    print("submitted", flush=True)
    time.sleep(600)
    """
) % REPO


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("master_case", ["outlives_engine", "dies_with_engine", "stopped_with_write_in_flight"])
def test_killed_engine_takes_its_mooncake_ctms_within_10s(master_case, tmp_path):
    master = None if master_case == "dies_with_engine" else LocalMooncakeMaster().start()
    options = {**SIZES, **(master.config() if master else {})}
    options["log_dir"] = str(tmp_path)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, json.dumps(options)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "wb"), text=True)
    try:
        line = engine.stdout.readline()
        assert line, (tmp_path / "err").read_text()[-3000:]
        info = json.loads(line)
        assert info["stored"] == [0, 1] and segments_of(info["port"])
        if master_case == "stopped_with_write_in_flight":
            os.kill(master.pid, signal.SIGSTOP)
        engine.stdin.write("go\n")
        engine.stdin.flush()
        assert engine.stdout.readline().strip() == "submitted"
        time.sleep(0.5)                              # the write is in the CTMs' Mooncake clients
        t0 = time.monotonic()
        engine.kill()
        engine.wait(10)
        pids = info["pids"] + ([info["master"]] if info["master"] else [])
        gone_at: dict[int, float] = {}
        while len(gone_at) < len(pids) and time.monotonic() - t0 < EXIT_BUDGET_S + 20:
            for pid in pids:
                if pid not in gone_at and process_gone(pid):
                    gone_at[pid] = time.monotonic() - t0
            time.sleep(0.05)
        log.info("%s: gone after %s s", master_case, {p: round(t, 2) for p, t in gone_at.items()})
        slow = {p: round(gone_at.get(p, float("inf")), 1) for p in pids if gone_at.get(p, float("inf")) > EXIT_BUDGET_S}
        assert not slow, f"outlived the engine by more than {EXIT_BUDGET_S:.0f}s: {slow} (all: {gone_at})"
        deadline = time.monotonic() + 5
        while segments_of(info["port"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert segments_of(info["port"]) == []
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        if master is not None:
            if master.is_running() and _state(master.pid) == "T":
                os.kill(master.pid, signal.SIGCONT)
            master.stop()


# ---------------------------------------------------------------- fault matrix: a stopped master
GRACE = 5.0              # the service's storage grace (answers of the ranks in flight)
STOP_S = 3.5             # how long the master stays stopped: longer than either task timeout
# Two ways a write is in flight while the master is stopped:
# * query_late: the task's first call (the query) waits on the stopped master past the deadline and,
#   as the RPC timeout is longer than the stop, completes after SIGCONT, when the engine has
#   reused the blocks (what the issue measured: all keys then held the new bytes);
# * put_late: a short RPC timeout fails the query inside the task, so the put starts, waits on the
#   stopped master and outlives the task.
SCENARIOS = {
    "query_late": {"timeout": 1.0, "options": {"rpc_timeout_ms": 8000},
                   "evidence": r"storage (?:query|write)[^\n]*still running"},
    "put_late": {"timeout": 2.0, "options": {"rpc_timeout_ms": 1200, "retry_interval": 0.0},
                 "evidence": r"storage write[^\n]*still running"},
}



def _objects(blocks: dict, i: int) -> dict[tuple[int, str], bytes]:
    """(rank, kind tag) -> the object a rank stores for the i-th block: its layers, concatenated."""
    tags = {"key_caches": "k", "value_caches": "v", "key_cache_scales": "k_scale", "value_cache_scales": "v_scale"}
    parts: dict[tuple[int, str], list[tuple[int, bytes]]] = {}
    for (rank, kind, layer), arr in blocks.items():
        parts.setdefault((rank, tags[kind]), []).append((layer, arr[i].tobytes()))
    return {key: b"".join(b for _, b in sorted(layers)) for key, layers in parts.items()}


def _stored_objects(master, namespace: str, hashes: list[str], like: dict) -> dict[tuple[str, int, str], bytes]:
    """What the pool holds under these hashes, read with a separate client (misses left out)."""
    store = MooncakeStore(namespace="inspector", rank=99, options={**master.config(), **SIZES})
    try:
        out = {}
        for h in hashes:
            for (rank, tag), want in like.items():
                key = storage_key(namespace, h, rank, tag)
                buf = np.zeros(len(want), dtype=np.uint8)
                store.register_buffer(buf.ctypes.data, buf.nbytes)
                if store.batch_get([key], [buf.ctypes.data], [buf.nbytes]) == [buf.nbytes]:
                    out[(h, rank, tag)] = buf.tobytes()
        return out
    finally:
        store.close()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_stopped_master_late_write_never_stores_or_returns_reused_bytes(mode, scenario, tmp_path):
    timeout, options, evidence = (SCENARIOS[scenario][k] for k in ("timeout", "options", "evidence"))
    with LocalMooncakeMaster() as master:
        svc = start_service(storage_backend="mooncake", storage_transfer=mode, log_dir=str(tmp_path),
                            storage_options={**master.config(), **SIZES, **options},
                            model_id=f"mcfault/stall-{mode}-{scenario}")
        try:
            fill_distinct(svc, seed=5)
            # A control block stored while the master runs: the checks below can see a stored object.
            control = chain_hash_ids([f"control-{mode}-{scenario}-{os.getpid()}"])
            assert svc.write_storage(control, [0]).result(timeout=60) == [0]
            hashes = chain_hash_ids([f"stall-{mode}-{scenario}-{os.getpid()}-{i}" for i in range(2)])
            blocks = [1, 2]
            original, control_bytes = block_bytes(svc, blocks), block_bytes(svc, [0])
            reused = None
            os.kill(master.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                future = svc.write_storage(hashes, blocks, timeout=timeout)
                stored = future.result(timeout=timeout + GRACE + 5)
                answered_s = time.monotonic() - stopped_at
                assert stored == [] and answered_s < timeout + GRACE, (stored, answered_s)
                # The engine reuses the blocks once the task lets go of them: at once unless a direct
                # call still reads them (then only once that call returned).
                try:
                    future.released.result(timeout=max(0.1, STOP_S - 0.5 - (time.monotonic() - stopped_at)))
                except FutureTimeout:
                    pass
                else:
                    assert _state(master.pid) == "T"
                    reused = write_random_blocks(svc, blocks, seed=6)
                time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped_at)))
            finally:
                os.kill(master.pid, signal.SIGCONT)
            reused_while_stopped = reused is not None
            if reused is None:
                future.released.result(timeout=10 + GRACE)
                reused = write_random_blocks(svc, blocks, seed=6)
            time.sleep(3.0)     # the master answers what queued up while it was stopped; late calls end
            logs = "".join(open(os.path.join(svc.log_dir, f"cache_transfer_manager_rank{r}.log")).read()
                           for r in (0, 1))
            in_flight = re.findall(evidence, logs)
            assert in_flight, "no storage call of the write was in flight past the deadline: the row tested nothing"

            held = _stored_objects(master, str(svc.namespace()), control + hashes, _objects(original, 0))
            assert {k[1:]: v for k, v in held.items() if k[0] == control[0]} == _objects(control_bytes, 0)
            for i, h in enumerate(hashes):
                want, later = _objects(original, i), _objects(reused, i)
                for (rank, tag), got in ((k[1:], v) for k, v in held.items() if k[0] == h):
                    is_later, is_original = got == later[(rank, tag)], got == want[(rank, tag)]
                    assert not is_later, f"block {i} rank {rank} {tag}: the store holds the reused bytes"
                    assert is_original, f"block {i} rank {rank} {tag}: the store holds bytes of neither"

            target = [8, 9, 10]
            write_random_blocks(svc, target, seed=7)
            loaded = svc.read_storage(control + hashes, target, timeout=10).result(timeout=30)
            assert loaded[:1] == [8], "the control block should read back once the master runs again"
            got = block_bytes(svc, target)
            for k in got:
                assert np.array_equal(got[k][0], control_bytes[k][0])
            for i, block in enumerate(loaded[1:]):
                for k in got:
                    assert not np.array_equal(got[k][i + 1], reused[k][i]), f"a read returned reused bytes ({k})"
                    assert np.array_equal(got[k][i + 1], original[k][i]), f"block {block} ({k}) is not the original"
            log.info("%s/%s: answered in %.2fs, blocks reused %s SIGCONT; of the stalled blocks %d objects held "
                     "and %d read back; in flight: %s", mode, scenario, answered_s,
                     "before" if reused_while_stopped else "after", len(held) - len(_objects(control_bytes, 0)),
                     len(loaded) - 1, in_flight)
        finally:
            svc.shutdown()
