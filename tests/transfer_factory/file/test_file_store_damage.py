"""FileStore damage and failed writes (transfer_factory/file/store.py): records cut short, flipped
bytes, records copied over others, full disks and failed writes, crashed writer processes, and
segments still being created by a live writer."""
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.file_store_helpers import NS, REPO, get, key, open_store, put, rand_bytes, store_fixture
from transfer_factory.file import log as file_log
from transfer_factory.file.store import DEAD, HEADER_SIZE
from transfer_factory.kvcache_storage import CORRUPT, NO_SPACE, NOT_FOUND, OK, UNAVAILABLE

store = store_fixture  # the shared fixture (tests/file_store_helpers.py), under the name the tests ask for


def assert_miss(store, k, n, sentinel=0xA5):
    """A damaged object reads as a miss: a negative code, never a byte count."""
    out = np.full(n, sentinel, dtype=np.uint8)
    code = store.batch_get([k], [out.ctypes.data], [n])[0]
    assert code in (CORRUPT, NOT_FOUND), code
    return code


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
