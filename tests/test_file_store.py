"""FileStore (transfer_factory/file/store.py): round trips, damage detection, LRU capacity, restart,
isolation, option checking, and concurrent threads and processes on one directory."""
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer_factory import StorageAccess, StorageConfigError, create_storage_backend
from transfer_factory.file import log as file_log
from transfer_factory.file.store import DEAD, HEADER_SIZE, FileStore
from transfer_factory.kvcache_storage import (
    BUFFER_TOO_SMALL, CORRUPT, INVALID, NO_SPACE, NOT_FOUND, OK, UNAVAILABLE,
)

REPO = Path(__file__).resolve().parents[1]
NS = "model-tp2-0123456789abcdef"
HSETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def key(i, rank=0, kind="k", ns=NS):
    return f"{ns}/{i:064x}/{rank}/{kind}"


def rand_bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def open_store(root, namespace=NS, rank=0, **options):
    options.setdefault("fsync", False)
    return FileStore(namespace=namespace, rank=rank, options={"root": str(root), **options})


def put(store, k, arr):
    return store.batch_set([k], [arr.ctypes.data], [arr.nbytes])[0]


def get(store, k, n):
    out = np.zeros(n, dtype=np.uint8)
    code = store.batch_get([k], [out.ctypes.data], [n])[0]
    return code, out


def assert_miss(store, k, n, sentinel=0xA5):
    """A damaged object reads as a miss: a negative code, never a byte count."""
    out = np.full(n, sentinel, dtype=np.uint8)
    code = store.batch_get([k], [out.ctypes.data], [n])[0]
    assert code in (CORRUPT, NOT_FOUND), code
    return code


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "kv") as s:
        yield s


# ------------------------------------------------------------------------------------ round trips
@HSETTINGS
@given(k=st.text(min_size=1, max_size=300), data=st.binary(min_size=1, max_size=4096))
def test_round_trip_any_key_bit_exact(store, k, data):
    src = np.frombuffer(data, dtype=np.uint8).copy()
    assert put(store, k, src) == OK
    assert store.exists([k]) == [1]
    code, out = get(store, k, len(data) + 17)
    assert code == len(data)
    assert out[:code].tobytes() == data
    assert not out[code:].any()                           # nothing written past the payload
    assert store.delete([k]) == [OK]
    assert store.exists([k]) == [0]


@HSETTINGS
@given(sizes=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_round_trip_random_sizes_batched(store, sizes, seed):
    srcs = [rand_bytes(n, seed + i) for i, n in enumerate(sizes)]
    keys = [key(seed * 8 + i) for i in range(len(sizes))]
    assert store.batch_set(keys, [a.ctypes.data for a in srcs], sizes) == [OK] * len(sizes)
    outs = [np.empty(n, dtype=np.uint8) for n in sizes]
    assert store.batch_get(keys, [o.ctypes.data for o in outs], sizes) == sizes
    for src, out in zip(srcs, outs):
        assert np.array_equal(src, out)
    store.clear()


@HSETTINGS
@given(pieces=st.lists(st.integers(0, 70000), min_size=1, max_size=8).filter(lambda p: sum(p) > 0),
       seed=st.integers(0, 2**32 - 1), split=st.integers(1, 5))
def test_multi_buffer_round_trip(store, pieces, seed, split):
    assert store.supports_multi_buffer
    srcs = [rand_bytes(n, seed + i) for i, n in enumerate(pieces)]
    k = key(seed)
    assert store.batch_set_multi([k], [[a.ctypes.data for a in srcs]], [pieces]) == [OK]
    total = sum(pieces)
    outs = [np.empty(n, dtype=np.uint8) for n in pieces]
    assert store.batch_get_multi([k], [[o.ctypes.data for o in outs]], [pieces]) == [total]
    for src, out in zip(srcs, outs):
        assert np.array_equal(src, out)
    # One file is the concatenation in order: read it back whole and in another split.
    code, whole = get(store, k, total)
    assert code == total and np.array_equal(whole, np.concatenate(srcs))
    bounds = np.linspace(0, total, split + 1).astype(int)
    parts = [np.empty(b - a, dtype=np.uint8) for a, b in zip(bounds[:-1], bounds[1:])]
    assert store.batch_get_multi([k], [[p.ctypes.data for p in parts]], [[p.nbytes for p in parts]]) == [total]
    assert np.array_equal(np.concatenate(parts), whole)
    # Scattering into buffers that are too small in total is refused.
    small = [np.empty(n, dtype=np.uint8) for n in pieces]
    small[-1] = np.empty(max(pieces[-1] - 1, 0), dtype=np.uint8)
    if sum(s.nbytes for s in small) < total:
        assert store.batch_get_multi([k], [[s.ctypes.data for s in small]], [[s.nbytes for s in small]]) \
            == [BUFFER_TOO_SMALL]
    store.delete([k])


def test_existing_key_put_is_success(store):
    """The key names the content (the same key is the same prefix's KV), so a put of a present key
    is a success that writes nothing and keeps the object first stored."""
    a, b = rand_bytes(5000, 1), rand_bytes(5000, 2)
    k = key(1)
    assert put(store, k, a) == OK
    used, disk, where = store.used_bytes, store.disk_bytes, store.object_location(k)
    assert put(store, k, b) == OK
    assert store.used_bytes == used and len(store) == 1
    assert store.object_location(k) == where and store.disk_bytes == disk   # not rewritten
    code, out = get(store, k, 5000)
    assert code == 5000 and np.array_equal(out, a)


def test_codes_for_bad_requests(store):
    a = rand_bytes(1000, 3)
    k = key(2)
    assert get(store, k, 1000)[0] == NOT_FOUND
    assert store.batch_set([k], [a.ctypes.data], [0]) == [INVALID]
    assert store.batch_set([k], [0], [1000]) == [INVALID]
    assert store.batch_set([""], [a.ctypes.data], [1000]) == [INVALID]
    assert store.batch_set_multi([k], [[]], [[]]) == [INVALID]
    assert store.batch_get([k], [a.ctypes.data], [-1]) == [INVALID]
    with pytest.raises(ValueError):
        store.batch_set([k, key(3)], [a.ctypes.data], [1000])
    assert put(store, k, a) == OK
    assert get(store, k, 999)[0] == BUFFER_TOO_SMALL
    assert store.exists([k]) == [1]                       # a too-small buffer does not damage anything
    assert store.delete([k, key(3)]) == [OK, NOT_FOUND]
    store.register_buffer(a.ctypes.data, a.nbytes)
    store.register_buffer(a.ctypes.data, a.nbytes)        # twice is harmless
    for ptr, size in ((0, 10), (-5, 10), (a.ctypes.data, 0), (a.ctypes.data, -1), ("x", 10)):
        with pytest.raises(ValueError):
            store.register_buffer(ptr, size)


def test_query_counts_the_present_prefix(store):
    arrs = [rand_bytes(100, i) for i in range(4)]
    keys = [key(i) for i in range(4)]
    store.batch_set(keys[:2] + keys[3:], [a.ctypes.data for a in arrs[:2] + arrs[3:]], [100] * 3)
    assert store.exists(keys) == [1, 1, 0, 1]
    assert store.query(keys) == 2


def test_close_is_idempotent_and_later_calls_fail_softly(tmp_path):
    s = open_store(tmp_path)
    a = rand_bytes(64, 0)
    assert put(s, key(0), a) == OK
    s.close()
    s.close()
    assert put(s, key(1), a) == UNAVAILABLE
    assert get(s, key(0), 64)[0] == UNAVAILABLE
    assert s.exists([key(0)]) == [UNAVAILABLE]


def test_factory_builds_a_file_store(tmp_path):
    s = create_storage_backend("file", namespace=NS, rank=1, options={"root": str(tmp_path), "fsync": True})
    try:
        assert isinstance(s, FileStore) and s.name == "file" and s.access is StorageAccess.HOST_STAGED
        assert s.directory == tmp_path / NS / "rank1"
        a = rand_bytes(3000, 9)
        assert put(s, key(0, rank=1), a) == OK
        assert np.array_equal(get(s, key(0, rank=1), 3000)[1], a)
    finally:
        s.close()


# ------------------------------------------------------------------------------------ damage
def _stored(store, i=0, n=4096):
    a = rand_bytes(n, 100 + i)
    k = key(i)
    assert put(store, k, a) == OK
    loc = store.object_location(k)
    assert loc is not None and loc.length == HEADER_SIZE + n
    return k, a, loc


def flip(path, pos, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ mask]))


def test_a_record_cut_short_is_a_miss_and_its_neighbours_survive(tmp_path, caplog):
    """A segment truncated inside a record (a torn write's tail): that record is a miss, now and
    after a restart, and the records before it read back bit-exact."""
    for cut in (0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 100, HEADER_SIZE + 4095):
        root = tmp_path / f"cut{cut}"
        with open_store(root) as s:
            before = [_stored(s, i) for i in (1, 2)]
            k, a, loc = _stored(s, 3)
            os.truncate(loc.path, loc.offset + cut)
            assert_miss(s, k, a.nbytes)
            assert s.exists([k]) == [0]
            for kb, b, _ in before:
                assert np.array_equal(get(s, kb, b.nbytes)[1], b)
        with open_store(root) as s:                       # the scan after a restart agrees
            assert s.exists([k]) == [0] and len(s) == 2
            for kb, b, _ in before:
                assert np.array_equal(get(s, kb, b.nbytes)[1], b)
            assert put(s, k, a) == OK                     # appended after the torn tail, and found again
        with open_store(root) as s:
            assert np.array_equal(get(s, k, a.nbytes)[1], a)


def test_flipped_payload_byte_is_a_miss(store, caplog):
    for pos in (0, 1, 2047, 4095):
        k, a, loc = _stored(store)
        flip(loc.path, loc.offset + HEADER_SIZE + pos)
        out = np.full(a.nbytes, 0xA5, dtype=np.uint8)
        assert store.batch_get([k], [out.ctypes.data], [a.nbytes]) == [CORRUPT]
        assert store.exists([k]) == [0] and store.object_location(k) is None
        with open(loc.path, "rb") as f:                  # marked dead on disk: no process serves it again
            f.seek(loc.offset)
            assert f.read(4) == DEAD
        assert put(store, k, a) == OK                    # the writer can store it again
        assert np.array_equal(get(store, k, a.nbytes)[1], a)
    assert "corrupt" in caplog.text


def test_every_flipped_header_byte_is_a_miss(store):
    for pos in range(HEADER_SIZE):
        k, a, loc = _stored(store)
        flip(loc.path, loc.offset + pos, 0x80)
        assert assert_miss(store, k, a.nbytes) == CORRUPT, pos
        assert store.exists([k]) == [0]


def test_a_record_copied_over_another_keys_record_is_a_miss(store):
    ka, a, loc_a = _stored(store, 1)
    kb, b, loc_b = _stored(store, 2)
    with open(loc_a.path, "rb") as f:                    # same size, valid checksums, wrong key
        f.seek(loc_a.offset)
        record = f.read(loc_a.length)
    with open(loc_b.path, "r+b") as f:
        f.seek(loc_b.offset)
        f.write(record)
    assert_miss(store, kb, b.nbytes)
    assert np.array_equal(get(store, ka, a.nbytes)[1], a)


def segment_files(root):
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def run_image(headers, ptrs, sizes, counts=None):
    """The bytes ``write_records`` writes for a run: header i, then record i's buffers."""
    out, b = [], 0
    for i in range(len(counts) if counts is not None else len(ptrs)):
        out.append(bytes(headers[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]))
        for _ in range(counts[i] if counts is not None else 1):
            out.append(ctypes.string_at(ptrs[b], sizes[b]))
            b += 1
    return b"".join(out)


def test_full_disk_write_leaves_nothing(store, monkeypatch):
    a = rand_bytes(100000, 5)
    k = key(5)

    def ten_bytes_then_enospc(fd, offset, headers, ptrs, sizes, counts=None):
        os.pwrite(fd, bytes(headers[:10]), offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_log, "write_records", ten_bytes_then_enospc)
    assert put(store, k, a) == NO_SPACE
    monkeypatch.undo()
    assert get(store, k, a.nbytes)[0] == NOT_FOUND
    assert store.used_bytes == 0 and store.disk_bytes == 0
    assert segment_files(store.directory) == []


def test_a_failed_write_is_cut_off_its_segment(store, monkeypatch):
    """A batch that fails half-way into a segment holding earlier records: the segment is
    truncated back to where the batch began; the earlier records stay whole."""
    a, b = rand_bytes(30000, 1), rand_bytes(50000, 2)
    assert put(store, key(1), a) == OK
    size = store.disk_bytes

    def some_then_eio(fd, offset, headers, ptrs, sizes, counts=None):
        os.pwrite(fd, run_image(headers, ptrs, sizes, counts)[:HEADER_SIZE + 777], offset)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(file_log, "write_records", some_then_eio)
    assert put(store, key(2), b) == UNAVAILABLE
    monkeypatch.undo()
    [seg] = segment_files(store.directory)
    assert seg.stat().st_size == size == store.disk_bytes
    assert np.array_equal(get(store, key(1), a.nbytes)[1], a)
    assert get(store, key(2), b.nbytes)[0] == NOT_FOUND
    assert put(store, key(2), b) == OK
    assert np.array_equal(get(store, key(2), b.nbytes)[1], b)


def test_a_write_that_accepts_no_bytes_fails_instead_of_spinning(store, tmp_path):
    """A regular file that accepts no byte (pwritev returning 0) is reported as ENOSPC by the
    record writer at once, and the store turns that into NO_SPACE with nothing left behind."""
    from transfer_factory.file import _records as _file_records
    headers = _file_records.pack_headers([bytes(32)], [4], [0])
    data = rand_bytes(4, 0)
    with open("/dev/full", "wb") as full:                # every write fails: the loop must not spin
        with pytest.raises(OSError):
            _file_records.write_records(full.fileno(), 0, headers, [data.ctypes.data], [4], None)
    a = rand_bytes(100000, 6)
    k = key(6)
    real = file_log.write_records
    start = time.monotonic()
    file_log.write_records = lambda *args: (_ for _ in ()).throw(OSError(28, "write accepted no bytes"))
    try:
        assert put(store, k, a) == NO_SPACE
    finally:
        file_log.write_records = real
    assert time.monotonic() - start < 5
    assert get(store, k, a.nbytes)[0] == NOT_FOUND
    assert segment_files(store.directory) == []
    assert put(store, k, a) == OK                        # nothing about the failure is remembered


_CRASH = r"""
import os, sys
import numpy as np
from transfer_factory.file.store import FileStore
root, ns, mode = sys.argv[1], sys.argv[2], sys.argv[3]
s = FileStore(namespace=ns, rank=0, options={"root": root, "fsync": True})
first = np.arange(3000, dtype=np.uint8) * 7
s.batch_set([sys.argv[5]], [first.ctypes.data], [first.nbytes])
a = np.arange(200000, dtype=np.uint8)
if mode == "half":          # the process dies in the middle of writing the payload
    import ctypes
    from transfer_factory.file import log as file_log
    def die(fd, offset, headers, ptrs, sizes, counts=None):
        os.pwrite(fd, bytes(headers[:56]) + ctypes.string_at(ptrs[0], 5000), offset)
        os._exit(17)
    file_log.write_records = die
else:                       # the process dies after writing everything, before the sync
    os.fdatasync = lambda fd: os._exit(17)
s.batch_set([sys.argv[4]], [a.ctypes.data], [a.nbytes])
"""


@pytest.mark.parametrize("mode", ["half", "before_sync"])
def test_a_crashed_writer_leaves_a_miss_or_the_whole_object(tmp_path, mode):
    k, first_key = key(7), key(8)
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path), NS, mode, k, first_key], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=60)
    assert proc.returncode == 17, proc.stderr.decode()
    with open_store(tmp_path) as s:
        first = np.arange(3000, dtype=np.uint8) * 7
        assert np.array_equal(get(s, first_key, 3000)[1], first)
        if mode == "half":
            assert_miss(s, k, 200000)
            assert s.exists([k]) == [0] and len(s) == 1
        else:                                             # written whole, only the sync was missed
            code, out = get(s, k, 200000)
            assert code == NOT_FOUND or (code == 200000 and np.array_equal(out, np.arange(200000, dtype=np.uint8)))
        a = rand_bytes(10000, 3)
        assert put(s, key(9), a) == OK                    # a new segment: the dead writer's is never appended to
    with open_store(tmp_path) as s:
        assert np.array_equal(get(s, key(9), 10000)[1], a)


def test_a_segment_being_created_by_a_live_writer_is_kept_and_never_read(store, tmp_path):
    import fcntl
    live = store.directory / "0000000000000001.0badc0de.seg.new"
    dead = store.directory / "0000000000000002.0badc0de.seg.new"
    for p in (live, dead):
        p.write_bytes(b"\0" * 1000)
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)                   # as its creator holds it until the rename
        with open_store(tmp_path / "kv") as again:
            assert live.exists() and not dead.exists()
            assert len(again) == 0
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ capacity
def test_lru_eviction_order_and_no_space(tmp_path):
    n = 1000
    s = open_store(tmp_path, capacity_bytes=3 * (HEADER_SIZE + n))
    arrs = [rand_bytes(n, i) for i in range(6)]
    for i in range(3):
        assert put(s, key(i), arrs[i]) == OK
    assert s.used_bytes == 3 * (HEADER_SIZE + n)
    assert get(s, key(0), n)[0] == n                     # key 0 is now the most recently used
    assert put(s, key(3), arrs[3]) == OK                 # evicts key 1
    assert s.exists([key(i) for i in range(4)]) == [1, 0, 1, 1]
    assert put(s, key(2), arrs[2]) == OK                 # a put of a present key refreshes it too
    assert put(s, key(4), arrs[4]) == OK                 # evicts key 0
    assert s.exists([key(i) for i in range(5)]) == [0, 0, 1, 1, 1]
    big = rand_bytes(3 * n + 2 * HEADER_SIZE + 1, 9)     # its file alone exceeds the capacity
    assert put(s, key(9), big) == NO_SPACE
    assert s.exists([key(i) for i in (2, 3, 4, 9)]) == [1, 1, 1, 0]   # nothing was evicted for it
    double = rand_bytes(2 * n + HEADER_SIZE, 10)         # needs two slots: evicts the two LRU objects
    assert put(s, key(10), double) == OK
    assert s.exists([key(i) for i in (2, 3, 4, 10)]) == [0, 0, 1, 1]
    assert s.used_bytes == 3 * (HEADER_SIZE + n)
    for i in (4, 10):
        src = arrs[4] if i == 4 else double
        assert np.array_equal(get(s, key(i), src.nbytes)[1], src)
    s.close()


def block(i, kind, rank=0):
    """A key of one kind of one block, as the CTM builds them: a block's kinds form one group."""
    return key(i, rank=rank, kind=kind)


def test_a_block_is_stored_all_or_none(store):
    n = 3000
    k = {i: rand_bytes(n, 10 + i) for i in range(3)}
    v = {i: rand_bytes(n, 20 + i) for i in range(3)}
    # The CTM's order: every K of the batch, then every V.  Block 1's V fails (a null pointer).
    keys = [block(0, "k"), block(1, "k"), block(2, "k"), block(0, "v"), block(1, "v"), block(2, "v")]
    ptrs = [k[0].ctypes.data, k[1].ctypes.data, k[2].ctypes.data, v[0].ctypes.data, 0, v[2].ctypes.data]
    assert store.batch_set(keys, ptrs, [n] * 6) == [OK, INVALID, OK, OK, INVALID, OK]
    assert store.exists(keys) == [1, 0, 1, 1, 0, 1]      # block 1's K, already written, was removed
    assert store.object_location(block(1, "k")) is None and len(store) == 4
    # A failed first member: the rest of its block is not even written.
    assert store.batch_set([block(5, "k"), block(5, "v")], [0, v[0].ctypes.data], [n, n]) == [INVALID, INVALID]
    assert store.object_location(block(5, "v")) is None and len(store) == 4
    # Keys that are not a block's kinds are independent of each other.
    assert store.batch_set(["x/1", "x/2"], [0, k[0].ctypes.data], [n, n]) == [INVALID, OK]
    for i in (0, 2):
        assert np.array_equal(get(store, block(i, "k"), n)[1], k[i])
        assert np.array_equal(get(store, block(i, "v"), n)[1], v[i])


def test_a_lone_k_left_by_a_crash_is_completed_by_the_next_write(store):
    n = 2000
    kk, vv = rand_bytes(n, 1), rand_bytes(n, 2)
    assert put(store, block(0, "k"), kk) == OK            # as if the writer died before the V
    assert store.batch_set([block(0, "k"), block(0, "v")], [kk.ctypes.data, vv.ctypes.data], [n, n]) == [OK, OK]
    assert np.array_equal(get(store, block(0, "v"), n)[1], vv)


def test_the_capacity_never_evicts_what_the_running_batch_stored(tmp_path):
    n = 1000
    s = open_store(tmp_path, capacity_bytes=3 * (HEADER_SIZE + n))
    arrs = [rand_bytes(n, i) for i in range(5)]
    assert put(s, "other", arrs[4]) == OK
    keys = [block(0, "k"), block(1, "k"), block(0, "v"), block(1, "v")]
    # K0, K1 fit; V0 evicts the unrelated LRU object; V1 would have to evict this batch's own K0.
    assert s.batch_set(keys, [a.ctypes.data for a in arrs[:4]], [n] * 4) == [OK, NO_SPACE, OK, NO_SPACE]
    assert s.exists(keys + ["other"]) == [1, 0, 1, 0, 0]
    assert len(s) == 2 and s.used_bytes == 2 * (HEADER_SIZE + n)
    assert np.array_equal(get(s, block(0, "k"), n)[1], arrs[0])
    assert np.array_equal(get(s, block(0, "v"), n)[1], arrs[2])
    s.close()


def test_index_is_rebuilt_on_reopen(tmp_path):
    n = 2000
    cap = 4 * (HEADER_SIZE + n)
    s = open_store(tmp_path, capacity_bytes=cap)
    arrs = [rand_bytes(n, i) for i in range(6)]
    for i in range(4):
        assert put(s, key(i), arrs[i]) == OK
    directory = s.directory
    s.close()
    # Some garbage in the directory, and an empty segment left by a crash.
    (directory / "README").write_text("not an object")
    (directory / "ab").mkdir()                          # the older one-file-per-object layout
    (directory / "ab" / ("ab" + "0" * 62 + ".kv")).write_bytes(b"x" * 100)
    empty = directory / "0000000000000001.deadbeef.seg"
    empty.write_bytes(b"")

    s = open_store(tmp_path, capacity_bytes=cap)
    assert len(s) == 4 and s.used_bytes == cap
    assert not empty.exists() and not (directory / "ab").exists() and (directory / "README").exists()
    for i in range(4):
        assert np.array_equal(get(s, key(i), n)[1], arrs[i])
    assert get(s, key(0), n)[0] == n                     # key 0 is the most recently used now
    assert put(s, key(4), arrs[4]) == OK                 # full: evicts key 1, the least recently used
    assert s.exists([key(i) for i in range(5)]) == [1, 0, 1, 1, 1]
    assert s.used_bytes == cap
    s.close()

    # After a restart the order is the write order (reads are not recorded on disk); an object
    # evicted but still in its segment may come back, with its own bytes.
    s = open_store(tmp_path, capacity_bytes=2 * (HEADER_SIZE + n))   # a smaller capacity: trimmed at once
    assert len(s) == 2 and s.used_bytes == 2 * (HEADER_SIZE + n)
    present = [i for i in range(5) if s.exists([key(i)]) == [1]]
    assert len(present) == 2
    for i in present:
        assert np.array_equal(get(s, key(i), n)[1], arrs[i])
    s.close()


# ------------------------------------------------------------------------------------ isolation
def test_namespaces_and_ranks_are_isolated(tmp_path):
    stores = {(ns, r): open_store(tmp_path, namespace=ns, rank=r) for ns in ("nsA", "nsB") for r in (0, 1)}
    k = "same/key/for/everyone"
    arrs = {}
    for i, (where, s) in enumerate(stores.items()):
        assert s.exists([k]) == [0]
        arrs[where] = rand_bytes(777 + i, i)
        assert put(s, k, arrs[where]) == OK
    for where, s in stores.items():
        code, out = get(s, k, 1000)
        assert code == arrs[where].nbytes and np.array_equal(out[:code], arrs[where])
    assert put(stores[("nsA", 0)], "only-A0", arrs[("nsA", 0)]) == OK
    for where, s in stores.items():
        assert s.exists(["only-A0"]) == [int(where == ("nsA", 0))]
    stores[("nsA", 0)].clear()
    assert stores[("nsA", 0)].exists([k, "only-A0"]) == [0, 0]
    for where, s in stores.items():
        if where != ("nsA", 0):
            assert s.exists([k]) == [1] and len(s) == 1
    assert sorted(p.name for p in (tmp_path / "nsA").iterdir()) == ["rank0", "rank1"]
    for s in stores.values():
        s.close()


# ------------------------------------------------------------------------------------ modes
def _modes(root):
    return {str(p.relative_to(root)): p.stat().st_mode & 0o7777 for p in [root, *root.rglob("*")]}


def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path):
    root = tmp_path / "fresh" / "kv"                      # every directory below tmp_path is the store's
    a = rand_bytes(4096, 1)
    old = os.umask(0)
    try:
        with open_store(root, capacity_bytes=1 << 20) as s:   # 64 KiB segments
            for i in range(20):                           # enough bytes to fill more than one segment
                assert put(s, key(i), a) == OK
            assert s.batch_set_multi([key(99)], [[a.ctypes.data, a.ctypes.data]], [[100, 200]]) == [OK]
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "fresh")
    files = {p: m for p, m in modes.items() if (tmp_path / "fresh" / p).is_file()}
    dirs = {p: m for p, m in modes.items() if p not in files}
    assert len(files) >= 2 and all(p.endswith(".seg") for p in files), files
    assert set(files.values()) == {0o600}, files
    assert len(dirs) == 4 and set(dirs.values()) == {0o700}, dirs   # fresh, kv, namespace, rank0


def test_a_store_left_readable_by_an_older_version_is_made_private(tmp_path):
    a = rand_bytes(512, 2)
    with open_store(tmp_path) as s:
        assert put(s, key(1), a) == OK
        path = s.object_location(key(1)).path           # the segment file
    for p in (path, path.parent, path.parent.parent):
        p.chmod(0o755 if p.is_dir() else 0o644)
    tmp_path.chmod(0o755)
    with open_store(tmp_path) as s:
        assert np.array_equal(get(s, key(1), 512)[1], a)
    assert path.stat().st_mode & 0o777 == 0o600
    assert {p.stat().st_mode & 0o777 for p in (path.parent, path.parent.parent)} == {0o700}
    assert tmp_path.stat().st_mode & 0o777 == 0o755       # the root existed before: not the store's to change


# ------------------------------------------------------------------------------------ options
@pytest.mark.parametrize("options, name", [
    ({"root": ""}, "root"),
    ({"root": 42}, "root"),
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": -1}, "capacity_bytes"),
    ({"capacity_bytes": 1.5}, "capacity_bytes"),
    ({"capacity_bytes": True}, "capacity_bytes"),
    ({"capacity_bytes": "lots"}, "capacity_bytes"),
    ({"fsync": "maybe"}, "fsync"),
    ({"fsync": 2}, "fsync"),
    ({"read_piece_bytes": -1}, "read_piece_bytes -1"),
    ({"read_piece_bytes": True}, "read_piece_bytes True"),
    ({"read_piece_bytes": "4M"}, "read_piece_bytes '4M'"),
    ({"capcity_bytes": 10}, "capcity_bytes"),
])
def test_bad_options_name_the_option(tmp_path, options, name):
    with pytest.raises(StorageConfigError, match=name):
        FileStore(namespace=NS, rank=0, options={"root": str(tmp_path), **options})


def test_bad_root_namespace_rank_env(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StorageConfigError, match="root"):
        FileStore(namespace=NS, rank=0, options={"root": str(afile)})
    for ns in ("", "..", "a/b"):
        with pytest.raises(StorageConfigError, match="namespace"):
            FileStore(namespace=ns, rank=0, options={"root": str(tmp_path)})
    for rank in (-1, "0", True):
        with pytest.raises(StorageConfigError, match="rank"):
            FileStore(namespace=NS, rank=rank, options={"root": str(tmp_path)})
    monkeypatch.setenv("CTM_FILE_STORE_CAPACITY", "plenty")
    with pytest.raises(StorageConfigError, match="capacity_bytes.*CTM_FILE_STORE_CAPACITY"):
        FileStore(namespace=NS, rank=0, options={"root": str(tmp_path)})


def test_defaults_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("CTM_FILE_STORE_ROOT", raising=False)
    monkeypatch.delenv("CTM_FILE_STORE_CAPACITY", raising=False)
    monkeypatch.delenv("FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with FileStore(namespace=NS, rank=3, options={}) as s:
        assert s.directory == tmp_path / "home/.cache/cache-transfer-manager/kv" / NS / "rank3"
        assert s.capacity_bytes == 64 << 30 and s.fsync is True and s.staged_read_piece_bytes == 4 << 20
    monkeypatch.setenv("FILE_BACKEND_STORAGE_DIR", str(tmp_path / "fastdeploy"))  # FastDeploy's variable
    with FileStore(namespace=NS, rank=1, options={}) as s:
        assert s.directory == tmp_path / "fastdeploy" / NS / "rank1"
    monkeypatch.setenv("CTM_FILE_STORE_ROOT", str(tmp_path / "envroot"))  # ours wins over FastDeploy's
    monkeypatch.setenv("CTM_FILE_STORE_CAPACITY", "2G")
    with FileStore(namespace=NS, rank=0, options={"fsync": "false"}) as s:
        assert s.directory == tmp_path / "envroot" / NS / "rank0"
        assert s.capacity_bytes == 2 << 30 and s.fsync is False
    with FileStore(namespace=NS, rank=0, options={"root": tmp_path / "opt", "capacity_bytes": 12345}) as s:
        assert s.directory == tmp_path / "opt" / NS / "rank0" and s.capacity_bytes == 12345


# ------------------------------------------------------------------------------------ concurrency
# Every writer stores one of VARIANTS payloads per key (sizes differ, so a put over another variant
# rewrites the file while others read it); every successful read must equal one variant exactly.
_WORKLOAD = r"""
import numpy as np
from transfer_factory.kvcache_storage import NOT_FOUND, OK

KEYS, VARIANTS, MAXLEN = 24, 3, 48000

def payload(k, v):
    n = 1000 + (k * 7919 + v * 15013) % (MAXLEN - 1000)
    return np.random.default_rng(k * 100 + v).integers(0, 256, n, dtype=np.uint8)

def workload(store, seed, iters):
    rng = np.random.default_rng(seed)
    expected = {k: {payload(k, v).tobytes() for v in range(VARIANTS)} for k in range(KEYS)}
    out = np.empty(MAXLEN, dtype=np.uint8)
    stats = {"hits": 0, "wrong": 0, "bad_codes": []}
    for _ in range(iters):
        k = int(rng.integers(KEYS))
        name = "ns/%064x/0/k" % k
        op = rng.random()
        if op < 0.45:
            src = payload(k, int(rng.integers(VARIANTS)))
            code = store.batch_set([name], [src.ctypes.data], [src.nbytes])[0]
            if code != OK:
                stats["bad_codes"].append(("set", code))
        elif op < 0.93:
            code = store.batch_get([name], [out.ctypes.data], [MAXLEN])[0]
            if code > 0:
                stats["hits"] += 1
                if out[:code].tobytes() not in expected[k]:
                    stats["wrong"] += 1
            elif code != NOT_FOUND:
                stats["bad_codes"].append(("get", code))
        else:
            code = store.delete([name])[0]
            if code not in (OK, NOT_FOUND):
                stats["bad_codes"].append(("delete", code))
    return stats
"""
_PROCESS = _WORKLOAD + r"""
import json, sys
from transfer_factory.file.store import FileStore
root, seed, iters, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with FileStore(namespace="shared", rank=0, options={"root": root, "fsync": False, "capacity_bytes": cap}) as s:
    print("ready", flush=True)
    sys.stdin.readline()                                # start together with the other writers
    print(json.dumps(workload(s, seed, iters)))
"""
_ns: dict = {}
exec(_WORKLOAD, _ns)
CAPACITY = 10 * 48000                                  # about half the keys fit: eviction churns too


def _check(stats):
    assert stats["wrong"] == 0, stats
    assert stats["bad_codes"] == [], stats


def test_concurrent_threads_never_read_a_wrong_payload(tmp_path):
    shared = open_store(tmp_path, namespace="shared", capacity_bytes=CAPACITY)
    other = open_store(tmp_path, namespace="shared", capacity_bytes=CAPACITY)   # a second index, same files
    results = [None] * 6

    def run(i):
        results[i] = _ns["workload"](shared if i % 2 else other, 1000 + i, 600)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for stats in results:
        _check(stats)
    assert sum(r["hits"] for r in results) > 100
    shared.close()
    other.close()


def test_concurrent_processes_never_read_a_wrong_payload(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(tmp_path), str(seed), "1500", str(CAPACITY)],
                              cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    with open_store(tmp_path, namespace="shared", capacity_bytes=CAPACITY) as mine:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        local = _ns["workload"](mine, 3, 1500)              # this process joins in meanwhile
        results = [local]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append(json.loads(out))
        for stats in results:
            _check(stats)
        assert sum(r["hits"] for r in results) > 100
        # Afterwards every file on disk is whole: each present key reads back as one variant.
        buf = np.empty(48000, dtype=np.uint8)
        for k in range(_ns["KEYS"]):
            code = mine.batch_get(["ns/%064x/0/k" % k], [buf.ctypes.data], [48000])[0]
            assert code == NOT_FOUND or buf[:code].tobytes() in {
                _ns["payload"](k, v).tobytes() for v in range(_ns["VARIANTS"])}
    assert not list(tmp_path.rglob("*.new"))
