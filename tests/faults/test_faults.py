"""Faults from outside: hostile traffic on the queue port, flags from the command line.  The engine killed
is in test_platform_service.py, on every platform."""
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from cache_manager.queue import wire
from cache_manager.cache_data import CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, SWAP_SPACE_READY_SIGNAL
from cache_manager.cache_tasks import RankResult
from cache_manager.queue.server import EngineCacheQueueServer
from cache_manager.ipc_signal import IPCSignal
from engine_hooks.core.device_caches import DeviceCaches
from engine_hooks.service import free_port
from ops.cpu import CpuPlatform
from tests.service_helpers import SMALL, fill_distinct, segments_of, start_service, views

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@pytest.fixture(scope="module")
def svc():
    service = start_service()
    yield service
    service.shutdown()


def _round_trip_works(svc) -> None:
    fill_distinct(svc, seed=9)
    v = views(svc)
    want = {k: view[[7]].copy() for k, view in v.items()}
    svc.swap_to_cpu([7], [3]).result(timeout=20)
    for view in v.values():
        view[[7]] = 0
    svc.swap_to_gpu([7], [3]).result(timeout=20)
    assert all(np.array_equal(view[[7]], want[k]) for k, view in v.items())


def test_hostile_traffic_is_dropped_and_the_service_keeps_working(svc, tmp_path):
    ctx = zmq.Context()
    canary = tmp_path / "pwned"
    dropped_before = svc.server.dropped_frames
    try:
        evil = ctx.socket(zmq.DEALER)
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(svc.server.address)
        wrong_secret = wire.new_secret()

        class Exploit:
            def __reduce__(self):
                return (os.system, (f"touch {canary}",))

        frames = [
            wire.encode({"type": "hello", "rank": 0, "pid": 1}, wrong_secret),  # would hijack rank 0
            wire.encode({"type": "result", "task_id": "t0", "rank": 0, "ok": True}, wrong_secret),
            b"\x00garbage\xff" * 10,
            pickle.dumps(Exploit()),
            wire.HEADER + pickle.dumps(Exploit()) + b"\x00" * 32,
            b"",
        ]
        for frame in frames:
            evil.send(frame)
        evil.send_multipart([b"two", b"frames"])
        time.sleep(0.5)
        big = ctx.socket(zmq.DEALER)  # over the size limit: the transport cuts the connection
        big.setsockopt(zmq.LINGER, 0)
        big.connect(svc.server.address)
        big.send(b"x" * (wire.MAX_FRAME_BYTES + 1024))
        time.sleep(0.5)
    finally:
        ctx.destroy(0)
    assert not canary.exists(), "a pickle payload was executed"
    assert svc.server.dropped_frames - dropped_before >= len(frames)
    assert svc.server.registered_ranks() == {0, 1}
    _round_trip_works(svc)


def test_ctm_from_the_command_line_attaches_and_serves(tmp_path):
    port = free_port()
    platform = CpuPlatform(instance=str(port))
    secret = wire.new_secret()
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret.hex() + "\n")
    secret_file.chmod(0o600)
    results: list[RankResult] = []
    sigs = {name: IPCSignal(name, np.zeros(1, np.int32), suffix=port, create=True)
            for name in (CACHE_READY_SIGNAL, SWAP_SPACE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL)}
    caches = DeviceCaches(platform, SMALL, 1, [0])
    caches.create_rank(0)
    server = EngineCacheQueueServer(1, secret, on_result=results.append)
    shape = ",".join(map(str, SMALL.cache_shape))
    argv = [sys.executable, "-m", "cache_manager.cache_transfer_manager", "--splitwise_role", "mixed", "--rank", "0",
            "--device_id", "0", "--max_model_len", "2048", "--num_layers", str(SMALL.num_layers), "--mp_num", "1",
            "--cache_dtype", "bfloat16", "--key_cache_shape", shape, "--value_cache_shape", shape,
            "--cache_queue_port", str(server.port), "--engine_worker_queue_port", str(port), "--num_cpu_blocks", "4",
            "--pod_ip", "127.0.0.1", "--protocol", "ipc", "--kvcache_storage_backend", "none",
            "--log_dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": REPO, wire.SECRET_FILE_ENV: str(secret_file)}
    ctm = subprocess.Popen(argv, env=env, cwd=REPO, stderr=subprocess.PIPE)
    try:
        sigs[CACHE_READY_SIGNAL].value[0] = 1
        deadline = time.monotonic() + 60
        while sigs[CACHE_TRANSFER_INITED_SIGNAL].value[0] != 1 and time.monotonic() < deadline and ctm.poll() is None:
            time.sleep(0.05)
        assert sigs[CACHE_TRANSFER_INITED_SIGNAL].value[0] == 1, ctm.stderr.read() if ctm.poll() is not None else ""
        assert sigs[SWAP_SPACE_READY_SIGNAL].value[0] == 1
        key0 = platform.raw_view(caches.tensors[0]["key_caches"][0])
        key0[:] = np.arange(key0.size, dtype=np.uint64).astype(np.uint8).reshape(key0.shape)
        want = key0[[5]].copy()
        server.broadcast({"task_id": "a", "event_type": 1, "swap_node_ids": [], "gpu_block_ids": [5], "cpu_block_ids": [2]})
        server.broadcast({"task_id": "b", "event_type": 2, "swap_node_ids": [], "gpu_block_ids": [9], "cpu_block_ids": [2]})
        deadline = time.monotonic() + 20
        while len(results) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(r.task_id, r.ok) for r in results] == [("a", True), ("b", True)]
        assert np.array_equal(key0[[9]], want)
        assert os.path.exists(tmp_path / "cache_transfer_manager_rank0.log")
        ctm.send_signal(signal.SIGTERM)
        assert ctm.wait(10) == 0
    finally:
        if ctm.poll() is None:
            ctm.kill()
            ctm.wait()
        server.close()
        caches.close()
        for s in sigs.values():
            s.clear()
    assert segments_of(port) == []


@pytest.mark.parametrize("flag,value", [
    ("--key_cache_shape", "16,2,x,8"),
    ("--cache_dtype", "float64"),
    ("--rank", "2"),
    ("--speculative_config", "{not json"),
    ("--kvcache_storage_backend", "redis"),
    ("--num_cpu_blocks", "-1"),
])
def test_bad_flag_exits_naming_it_before_attaching(flag, value, tmp_path):
    argv = {"--rank": "0", "--mp_num": "2", "--key_cache_shape": "16,2,4,8", "--cache_queue_port": "9",
            "--engine_worker_queue_port": str(free_port()), "--log_dir": str(tmp_path)}
    argv[flag] = value
    cmd = [sys.executable, "-m", "cache_manager.cache_transfer_manager"] + [x for kv in argv.items() for x in kv]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": REPO, wire.SECRET_ENV: "ab" * 16}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert flag in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "cache_transfer_manager_rank0.log"), "it got past flag checking"
    assert time.monotonic() - t0 < 30


def test_ctm_without_a_secret_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (wire.SECRET_ENV, wire.SECRET_FILE_ENV)}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "cache_manager.cache_transfer_manager", "--key_cache_shape", "4,1,1,1",
                           "--cache_queue_port", "9", "--engine_worker_queue_port", "10", "--log_dir", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "CTM_QUEUE_SECRET" in proc.stderr
