"""The fault matrix (DESIGN §3.8, §4): each row causes a fault for real at TP=2 with real CTM
processes and asserts what the engine sees afterwards, byte for byte.  Here: a stalled storage
backend, a store on a full filesystem and the modes of what the store writes.

The other rows: the CTM processes (the order of dependent swaps, a stalled rank, the supervisor,
a paused engine) in ``test_fault_processes.py``; replayed and malformed queue frames in
``test_fault_queue_frames.py``.  One row lives beside the machinery it needs: a real Mooncake
master SIGSTOPped with a write in flight
(``test_mooncake_faults.py::test_stopped_master_late_write_never_stores_or_returns_reused_bytes``).
The unit-level versions live next to their machinery: the FileStore on a full tmpfs
(``test_file_store_full_disk.py``), the queue under replay, forgery and malformed frames
(``test_queue_hardening.py`` and its neighbours, whose Tap in ``queue_helpers.py`` the rows reuse).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from tests.fault_helpers import GRACE, PLUGIN_ENV, TIMEOUT, Latch, _same, _wait_for
from tests.transfer_factory.file.test_file_store_full_disk import FS_BYTES, PAGE, files_under, fill, free_bytes
from transfer_factory.file.store import FileStore
from transfer_factory.keys import storage_key
from tests.service_helpers import block_bytes, fill_distinct, start_service, views, write_random_blocks


# ---------------------------------------------------------------- stalled backend
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
