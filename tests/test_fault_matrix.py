"""The fault matrix (DESIGN §3.8, §4): each row causes a fault for real at TP=2 with real CTM
processes and asserts what the engine sees afterwards, byte for byte.

One row lives beside the machinery it needs: a real Mooncake master SIGSTOPped with a write
in flight (``test_mooncake_faults.py::test_stopped_master_late_write_never_stores_or_returns_reused_bytes``).
The unit-level versions live next to their machinery: the FileStore on a full tmpfs
(``test_file_store_full_disk.py``), the queue under replay, forgery and malformed frames
(``test_queue_hardening.py``, whose Tap the rows here reuse).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from engine_hooks import TaskTimeoutError
from tests.test_file_store_full_disk import FS_BYTES, PAGE, files_under, fill, free_bytes
from transfer_factory.file.store import FileStore
from transfer_factory.keys import storage_key
from tests.service_helpers import (block_bytes, fill_distinct, process_gone, segments_of, start_service, views,
                                  write_random_blocks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_ENV = {"CTM_STORAGE_PLUGINS": "latched=tests.latched_store:LatchedStore"}
TIMEOUT = 1.0
GRACE = 5.0  # what the service adds to a storage task's timeout for the ranks' answers to arrive



def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


def _wait_for(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


# ---------------------------------------------------------------- stalled backend
class Latch:
    def __init__(self, path):
        self.dir = path
        path.mkdir()

    def close(self, call: str) -> None:
        (self.dir / call).touch()

    def open(self, call: str) -> None:
        (self.dir / call).unlink()

    def seen(self, call: str, what: str, tp: int = 2) -> bool:
        return all((self.dir / f"{call}.{what}.{r}").exists() for r in range(tp))


@pytest.fixture(params=["staged", "direct"])  # fresh: a stuck direct call moves a rank to staging
def latched(request, tmp_path):
    root = tmp_path
    latch = Latch(root / "latch")
    svc = start_service(storage_backend="latched", storage_transfer=request.param, extra_env=PLUGIN_ENV,
                        storage_options={"root": str(root / "store"), "latch_dir": str(latch.dir), "fsync": False})
    yield request.param, svc, latch
    svc.shutdown()


def _stalled(latch: Latch, call: str, submit):
    """Submit a storage task with ``call`` latched: it must answer 0 blocks by its timeout
    (plus the service's grace for the answer to arrive) while the call is still stuck."""
    latch.close(call)
    t0 = time.monotonic()
    future = submit()
    blocks = future.result(timeout=TIMEOUT + GRACE + 5)
    answered_s = time.monotonic() - t0
    assert blocks == [] and answered_s < TIMEOUT + GRACE, (blocks, answered_s)
    _wait_for(lambda: latch.seen(call, "entered"), 5, "the latched call to start")
    return future


def _hashes(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:04d}{os.getpid():08x}" for i in range(n)]


def test_stalled_backend_write_never_stores_bytes_written_after_the_task(latched):
    mode, svc, latch = latched
    call = "batch_set" if mode == "staged" else "batch_set_multi"
    fill_distinct(svc, seed=1)
    hashes, blocks = _hashes(f"w{mode}", 2), [1, 2]
    original = block_bytes(svc, blocks)
    future = _stalled(latch, call, lambda: svc.write_storage(hashes, blocks, timeout=TIMEOUT))
    if mode == "staged":
        # The late call holds only its snapshot: the blocks are the engine's again at once.
        assert future.released.done()
    else:
        # A direct call still reads the device blocks: they stay the task's until it returns.
        time.sleep(0.3)
        assert not future.released.done()
        assert svc.unreleased_tasks()
    if mode == "staged":
        write_random_blocks(svc, blocks, seed=2)  # the engine reuses the blocks
    latch.open(call)
    future.released.result(timeout=10)
    if mode == "direct":
        write_random_blocks(svc, blocks, seed=2)  # only now may the engine reuse them
    _wait_for(lambda: latch.seen(call, "done"), 10, "the late call to return")
    reused = block_bytes(svc, blocks)
    time.sleep(0.2)
    assert _same(block_bytes(svc, blocks), reused), "a device block changed after the task answered"
    # What the store holds under those hashes is the original bytes or nothing, never the new ones.
    target = [5, 6]
    write_random_blocks(svc, target, seed=3)
    loaded = svc.read_storage(hashes, target, timeout=10).result(timeout=20)
    got = block_bytes(svc, target)
    for i, block in enumerate(loaded):
        for k in got:
            assert np.array_equal(got[k][i], original[k][i]), f"block {block} ({k}) is not the original bytes"
            assert not np.array_equal(got[k][i], reused[k][i])


def test_stalled_backend_read_never_changes_a_device_block_after_the_task(latched):
    mode, svc, latch = latched
    call = "batch_get" if mode == "staged" else "batch_get_multi"
    fill_distinct(svc, seed=4)
    hashes = _hashes(f"r{mode}", 2)
    original = block_bytes(svc, [1, 2])
    assert svc.write_storage(hashes, [1, 2], timeout=10).result(timeout=20) == [1, 2]
    target = [7, 8]
    write_random_blocks(svc, target, seed=5)
    future = _stalled(latch, call, lambda: svc.read_storage(hashes, target, timeout=TIMEOUT))
    if mode == "staged":
        assert future.released.done()
        reused = write_random_blocks(svc, target, seed=6)  # the engine computes into the blocks
        latch.open(call)
        _wait_for(lambda: latch.seen(call, "done"), 10, "the late call to return")
        time.sleep(0.3)
        assert _same(block_bytes(svc, target), reused), "a late read scattered into reused device blocks"
    else:
        time.sleep(0.3)
        assert not future.released.done()  # the direct read may still write the blocks
        latch.open(call)
        future.released.result(timeout=10)
        reused = write_random_blocks(svc, target, seed=6)
        time.sleep(0.3)
        assert _same(block_bytes(svc, target), reused)
    # The store still serves the original bytes.
    assert svc.read_storage(hashes, [9, 10], timeout=10).result(timeout=20) == [9, 10]
    assert _same(block_bytes(svc, [9, 10]), original)


def test_read_stuck_after_its_first_piece_never_changes_a_device_block_after_the_task(tmp_path):
    """The file backend's staged read goes in pieces, each scattered at once by the I/O thread
    under the task's lease.  Here the second piece's get hangs past the deadline: the task answers
    0 blocks in time, and when the get returns, nothing more reaches the device blocks."""
    latch = Latch(tmp_path / "latch")
    svc = start_service(storage_backend="latched", extra_env=PLUGIN_ENV,
                        storage_options={"root": str(tmp_path / "store"), "latch_dir": str(latch.dir),
                                         "fsync": False, "read_piece_bytes": 1})  # one block per piece
    try:
        fill_distinct(svc, seed=14)
        hashes, target = _hashes("pieces", 3), [7, 8, 9]
        original = block_bytes(svc, [1, 2, 3])
        assert svc.write_storage(hashes, [1, 2, 3], timeout=10).result(timeout=20) == [1, 2, 3]
        write_random_blocks(svc, target, seed=15)
        (latch.dir / "batch_get").write_text("1")  # each rank's first piece goes through
        future = _stalled(latch, "batch_get", lambda: svc.read_storage(hashes, target, timeout=TIMEOUT))
        assert future.released.done()
        reused = write_random_blocks(svc, target, seed=16)  # the engine computes into the blocks
        latch.open("batch_get")
        _wait_for(lambda: latch.seen("batch_get", "done"), 10, "the stuck piece to return")
        time.sleep(0.3)
        assert _same(block_bytes(svc, target), reused), "a late piece scattered into reused device blocks"
        # Unlatched, the same read loads every piece, bit-exact.
        assert svc.read_storage(hashes, [10, 11, 12], timeout=10).result(timeout=20) == [10, 11, 12]
        assert _same(block_bytes(svc, [10, 11, 12]), original)
    finally:
        svc.shutdown()


def test_stalled_backend_backlog_is_bounded_and_fails_tasks_fast(latched):
    """A backend stuck for good: tasks keep failing in time; nothing piles up; it recovers."""
    mode, svc, latch = latched
    call = "exists"
    fill_distinct(svc, seed=7)
    latch.close(call)
    try:
        futures = [svc.write_storage(_hashes(f"b{mode}{i}", 1), [3 + i], timeout=0.5) for i in range(8)]
        t0 = time.monotonic()
        results = [f.result(timeout=0.5 + GRACE + 5) for f in futures]
        assert results == [[]] * 8
        assert time.monotonic() - t0 < 0.5 + GRACE
        assert all(f.released.done() for f in futures)  # nothing of them touches a device block
    finally:
        latch.open(call)
    hashes = _hashes(f"after{mode}", 1)
    assert svc.write_storage(hashes, [3], timeout=10).result(timeout=20) == [3]


def test_unrelated_tasks_overlap_while_related_ones_wait(latched):
    mode, svc, latch = latched
    fill_distinct(svc, seed=8)
    call = "batch_set" if mode == "staged" else "batch_set_multi"
    latch.close(call)
    try:
        write = svc.write_storage(_hashes(f"o{mode}", 1), [1], timeout=5.0)
        _wait_for(lambda: latch.seen(call, "entered"), 5, "the write to reach the store")
        unrelated = svc.swap_to_cpu([2], [0])
        unrelated.result(timeout=4)  # runs while the write is in flight
        related = svc.swap_to_gpu([1], [3])  # block 1 is the write's until it answers
        time.sleep(0.3)
        assert not write.done() and not related.done()
    finally:
        latch.open(call)
    assert write.result(timeout=10) == [1]
    related.result(timeout=10)


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
def _deadlines_still_fire(svc, rank: int) -> None:
    """A task that a stopped rank cannot answer still fails at its deadline (0.5 s), not later."""
    pid = svc.pids()[rank]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TaskTimeoutError):
            svc.control("ping", timeout=0.5).result(timeout=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        os.kill(pid, signal.SIGCONT)


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


# ---------------------------------------------------------------- a full filesystem
def test_a_store_on_a_full_filesystem_fails_cleanly_and_recovers(small_fs: Path) -> None:
    """Fault matrix row "a store directory on a small full filesystem": writes fail cleanly, and
    once space frees they succeed again and read back bit-exact, with real CTM processes."""
    root = small_fs / "store"
    svc = start_service(storage_backend="file", storage_options={"root": str(root), "fsync": True})
    try:
        fill_distinct(svc, seed=11)
        v = views(svc)
        keys = [hashlib.sha256(f"full disk {i}".encode()).hexdigest() for i in range(4)]
        blocks = [1, 2, 3, 4]
        want = {k: view[blocks].copy() for k, view in v.items()}
        ballast = small_fs / "ballast"
        fill(ballast)

        start = time.monotonic()
        got = svc.write_storage(keys, blocks, timeout=10).result(timeout=30)
        failed_in = time.monotonic() - start
        assert got == [], got
        assert failed_in < 10, failed_in
        assert not [f for f in files_under(root) if ".tmp." in f or f.endswith((".kv", ".seg"))], files_under(root)
        assert svc.read_storage(keys, [10, 11, 12, 13], timeout=10).result(timeout=30) == []

        # Room for one page: the file store packs a rank's whole batch (4 blocks x K, V) into one
        # segment page, so at most one of the two racing ranks gets it.  Whatever each got, no rank
        # may keep half a block, and what is reported is whole.
        os.truncate(ballast, os.path.getsize(ballast) - PAGE)
        start = time.monotonic()
        partial = svc.write_storage(keys, blocks, timeout=10).result(timeout=30)
        assert time.monotonic() - start < 10 and partial == blocks[:len(partial)] and len(partial) < 4, partial
        ns = str(svc.namespace())
        for rank in range(2):
            probe = FileStore(ns, rank, {"root": str(root), "fsync": False})
            for i, h in enumerate(keys):
                has_k, has_v = probe.exists([storage_key(ns, h, rank, "k"), storage_key(ns, h, rank, "v")])
                assert has_k == has_v, f"rank {rank} block {i}: k {has_k} v {has_v}"
                assert has_k == 1 or i >= len(partial)
            probe.close()
        assert not [f for f in files_under(root) if ".tmp." in f]

        ballast.unlink()
        assert free_bytes(small_fs) > FS_BYTES // 2
        start = time.monotonic()
        assert svc.write_storage(keys, blocks, timeout=10).result(timeout=30) == blocks
        wrote_in = time.monotonic() - start
        for view in v.values():
            view[blocks] = 0
        assert svc.read_storage(keys, blocks, timeout=10).result(timeout=30) == blocks
        compared = 0
        for k, view in v.items():
            assert np.array_equal(view[blocks], want[k]), f"rank/kind/layer {k}"
            compared += want[k].nbytes
        logging.getLogger(__name__).info("TP=2 full disk: write of %d blocks failed (0 stored) in %.3f s; with room for one page %d "
                 "stored, no half block; after freeing, stored in %.3f s; %d bytes compared bit-exact over %d views",
                 len(keys), failed_in, len(partial), wrote_in, compared, len(v))
    finally:
        svc.shutdown()


# ---------------------------------------------------------------- modes of what the store writes
def test_store_objects_and_directories_are_private(tmp_path):
    root = tmp_path / "store"
    service = start_service(storage_backend="file", storage_options={"root": str(root), "fsync": False})
    try:
        fill_distinct(service, seed=31)
        assert service.write_storage(_hashes("m", 2), [1, 2], timeout=10).result(timeout=20) == [1, 2]
    finally:
        service.shutdown()
    files = dirs = 0
    for path, subdirs, names in os.walk(root):
        for d in subdirs:
            assert stat.S_IMODE(os.stat(os.path.join(path, d)).st_mode) == 0o700, d
            dirs += 1
        for n in names:
            assert stat.S_IMODE(os.stat(os.path.join(path, n)).st_mode) == 0o600, n
            files += 1
    assert files >= 2 and dirs >= 2  # K and V of 2 blocks on 2 ranks, in one segment file per rank


# ---------------------------------------------------------------- replayed and malformed frames
@pytest.fixture(scope="module")
def tapped():
    """TP=2 CTMs that reach the engine's queue through a Tap (tests/test_queue_hardening.py), a
    man in the middle that records the exact frames and can replay them."""
    import engine_hooks.service as service_module
    from tests.test_queue_hardening import Tap

    real_server = service_module.EngineCacheQueueServer
    made = {}

    def server_with_tap(*args, **kwargs):
        server = real_server(*args, **kwargs, local_links=False)  # the tap sees zmq frames only
        made["tap"] = tap = Tap(server)
        host, port = tap.address.rsplit(":", 1)
        made["svc"].extra_flags.update(pod_ip=host.rsplit("/", 1)[1], cache_queue_port=int(port))
        return server

    from engine_hooks import CacheTransferService
    from tests.service_helpers import NUM_CPU_BLOCKS, SMALL

    service_module.EngineCacheQueueServer = server_with_tap
    try:
        svc = made["svc"] = CacheTransferService(SMALL, tp=2, num_cpu_blocks=NUM_CPU_BLOCKS, task_timeout=20.0)
        svc.start()
    finally:
        service_module.EngineCacheQueueServer = real_server
    yield svc, made["tap"]
    svc.shutdown()
    made["tap"].close()


def _ctm_log(svc, rank: int) -> str:
    with open(svc.procs[rank].log_path, errors="replace") as f:
        return f.read()


def _round_trip(svc, block: int, slot: int, seed: int) -> None:
    want = write_random_blocks(svc, [block], seed)
    svc.swap_to_cpu([block], [slot]).result(timeout=20)
    write_random_blocks(svc, [block], seed + 1)
    svc.swap_to_gpu([block], [slot]).result(timeout=20)
    assert _same(block_bytes(svc, [block]), want)


def test_a_replayed_task_frame_never_runs_again(tapped):
    svc, tap = tapped
    write_random_blocks(svc, [3], seed=41)
    svc.swap_to_cpu([3], [0]).result(timeout=20)
    before = {r: len(tap.frames("down", "tasks", f"rank{r}.t".encode())) for r in range(2)}
    svc.swap_to_gpu([3], [0], timeout=60).result(timeout=20)  # a deadline far off: only the counter stops a replay
    frames = {r: tap.frames("down", "tasks", f"rank{r}.t".encode())[before[r]:] for r in range(2)}
    assert all(len(f) == 1 for f in frames.values()), frames
    reused = write_random_blocks(svc, [3], seed=42)  # the engine reuses block 3
    logged = [_ctm_log(svc, r).count("dropped frame") for r in range(2)]  # the log files are the session's
    for r in range(2):
        identity = tap.identity("tasks", f"rank{r}.t".encode())
        tap.replay("down", "tasks", identity, frames[r][0])  # the same bytes on the same connection
        tap.replay("down", "tasks", tap.identity("tasks", f"rank{1 - r}.t".encode()), frames[r][0])  # the other rank's
    _wait_for(lambda: all(_ctm_log(svc, r).count("dropped frame") >= logged[r] + 2 for r in range(2)), 5, "the drops")
    time.sleep(0.2)
    assert _same(block_bytes(svc, [3]), reused), "a replayed swap ran again"
    _round_trip(svc, 3, 1, seed=43)


def test_a_replayed_hello_from_another_connection_takes_nothing_over(tapped):
    import zmq

    svc, tap = tapped
    hello = tap.frames("up", "control", b"rank0")[0]  # rank 0's first frame: its hello
    ctx = zmq.Context()
    try:
        attacker = ctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(svc.server.address)
        dropped = svc.server.dropped_frames
        attacker.send(hello)
        attacker.send(b"CTMQ garbage that never authenticated")
        _wait_for(lambda: svc.server.dropped_frames >= dropped + 2, 5, "the drops")
        assert not attacker.poll(300), "the attacker was answered"
        assert svc.server.registered_ranks() == {0, 1}
        _round_trip(svc, 5, 2, seed=44)  # rank 0 still gets its tasks and answers them
        assert not attacker.poll(100), "the attacker received a task"
    finally:
        ctx.destroy(0)


def test_malformed_authenticated_frames_are_dropped_and_every_thread_lives(tapped):
    import zmq

    from cache_manager.queue import wire

    svc, tap = tapped
    secret = svc._secret
    nonce = os.urandom(16)
    hello = {"type": "hello", "channel": "control", "rank": 0, "pid": 1, "nonce": nonce}
    nested: object = 0
    for _ in range(100):
        nested = [nested]
    bodies = [{**hello, "rank": [0]}, {**hello, "rank": 7}, {**hello, "rank": True}, {**hello, "pid": float("inf")},
              {**hello, "pid": float("nan")}, {**hello, "pid": 10 ** 30 % 2 ** 64}, {**hello, "nonce": nested},
              {**hello, "channel": {"a": 1}}, {"type": "barrier", "name": "b", "value": 0, "timeout": float("inf")},
              {"type": ["hello"]}]
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.server.address)
        dropped = svc.server.dropped_frames
        for body in bodies:
            sock.send(wire.encode(body, secret))
        _wait_for(lambda: svc.server.dropped_frames >= dropped + len(bodies), 5, "the drops")
        assert svc.server.dropped_frames == dropped + len(bodies)
        assert not sock.poll(200)
    finally:
        ctx.destroy(0)
    assert svc.server.loop_errors == 0 and svc.server.io_thread_alive()
    assert svc._supervisor.is_alive()
    _round_trip(svc, 6, 3, seed=45)


def test_an_exception_in_the_queue_io_loop_costs_one_iteration(tapped, monkeypatch):
    svc, _ = tapped
    server = svc.server
    real = server._expire_barriers
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected queue fault")
        return real(*args, **kwargs)

    errors = server.loop_errors
    monkeypatch.setattr(server, "_expire_barriers", failing_once)
    svc.control("ping").result(timeout=10)  # wakes the I/O loop
    _wait_for(lambda: server.loop_errors == errors + 1, 5, "the injected fault")
    assert server.io_thread_alive()
    _deadlines_still_fire(svc, rank=1)
    _round_trip(svc, 7, 4, seed=46)
