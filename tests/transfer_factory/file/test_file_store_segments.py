"""FileStore segment format under damage and churn (transfer_factory/file/segments.py).

Every check compares bytes: after segments are torn, truncated or damaged, after thousands of
writes through a small capacity, and after the rank directory is moved, replaced or cleared under
an open store, every key either reads back bit-exact or is a miss.  Killed writers and two writer
processes are in test_file_store_processes.py.  No assertion is about time.
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest

from tests.file_store_segment_helpers import (
    MAXLEN, NS, check_all, key_of, open_store, payload, put_ids, read_one, segments,
)
from transfer_factory.file.segments import HEADER_SIZE, segment_size
from transfer_factory.file.store import FileStore
from transfer_factory.kvcache_storage import CORRUPT, NOT_FOUND, OK, UNAVAILABLE


# ------------------------------------------------------------------------------------ torn and damaged segments
def _filled(root, ids) -> FileStore:
    store = open_store(root)
    put_ids(store, ids)
    return store


def test_a_torn_segment_tail_is_stepped_over_on_reopen(tmp_path):
    """The segment's last record cut at many points, or garbage after it: rebuilt on reopen with
    every other record bit-exact; the torn one misses; new records after the tail are found."""
    ids = list(range(30))
    for cut in (1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, 1000):
        root = tmp_path / f"cut{cut}"
        with _filled(root, ids) as store:
            last = store.object_location(key_of(ids[-1]))
        os.truncate(last.path, last.offset + cut)
        with open_store(root) as store:
            assert len(store) == len(ids) - 1
            for i in ids[:-1]:
                assert read_one(store, i) > 0
            assert read_one(store, ids[-1]) < 0
            put_ids(store, [500, 501])
        check_all(root, ids[:-1] + [500, 501], must=set(ids[:-1]) | {500, 501})
    root = tmp_path / "garbage"
    with _filled(root, ids) as store:
        last = store.object_location(key_of(ids[-1]))
    with open(last.path, "ab") as f:
        f.write(b"CTKR" + os.urandom(5000))             # a torn header that even starts right
    check_all(root, ids, must=set(ids))


@pytest.mark.parametrize("damage", ["zeroed_page", "garbage_header", "truncated_header"])
def test_a_torn_record_in_the_middle_of_a_segment_is_a_miss(tmp_path, damage):
    """A record in the middle of a segment torn (a page of zeros over its header, garbage over
    its header, or its header half overwritten by zeros): on reopen it misses and the scan finds
    every record after it; before the reopen, the open store misses it too."""
    ids = list(range(40))
    victim = 17
    store = _filled(tmp_path, ids)
    loc = store.object_location(key_of(victim))
    with open(loc.path, "r+b") as f:
        if damage == "zeroed_page":
            f.seek(loc.offset - 100)
            f.write(b"\0" * 4096)                        # the end of the record before it too
        elif damage == "garbage_header":
            f.seek(loc.offset)
            f.write(os.urandom(HEADER_SIZE))
        else:
            f.seek(loc.offset + HEADER_SIZE // 2)
            f.write(b"\0" * (HEADER_SIZE // 2))
    assert read_one(store, victim) < 0
    store.close()
    gone = {victim, victim - 1} if damage == "zeroed_page" else {victim}
    with open_store(tmp_path) as store:
        for i in ids:
            code = read_one(store, i)
            assert (code < 0) == (i in gone), (i, code)


def test_a_flipped_payload_byte_in_the_middle_is_a_miss_after_reopen(tmp_path):
    """Damage the scan cannot see (the header is intact): found at read, marked dead, and a miss
    from then on, across reopens; the records around it read back bit-exact."""
    ids = list(range(20))
    with _filled(tmp_path, ids) as store:
        loc = store.object_location(key_of(7))
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + HEADER_SIZE + 1234)
        byte = f.read(1)
        f.seek(loc.offset + HEADER_SIZE + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    with open_store(tmp_path) as store:
        assert len(store) == 20                          # the scan reads headers only
        assert read_one(store, 7) == CORRUPT
        for i in ids:
            assert (read_one(store, i) < 0) == (i == 7)
    with open_store(tmp_path) as store:
        assert len(store) == 19 and store.exists([key_of(7)]) == [0]


# ------------------------------------------------------------------------------------ capacity and reclaiming
def test_capacity_and_reclaiming_bound_memory_and_disk_over_many_writes(tmp_path):
    """Thousands of objects through a 3 MiB store, with reads that reorder the LRU and deletes:
    after every call the live bytes stay within the capacity and the segment files within the
    capacity plus one segment; the newest objects read back bit-exact, and compaction kept the
    objects that were read recently."""
    cap = 3 << 20
    seg = segment_size(cap, 0)
    rng = random.Random(3)
    store = open_store(tmp_path, capacity_bytes=cap)
    assert store.segment_bytes == seg
    hot = list(range(0, 40, 2))                          # read after every batch: must survive
    put_ids(store, hot)
    i = 1000
    for n in range(400):
        batch = list(range(i, i + rng.choice([1, 2, 6, 12])))
        i += len(batch)
        put_ids(store, batch)
        for h in hot:
            assert read_one(store, h) > 0, h
        if n % 7 == 0:
            assert store.delete([key_of(rng.randrange(1000, i))])[0] in (OK, NOT_FOUND)
        disk = sum(p.stat().st_size for p in segments(tmp_path))
        assert store.used_bytes <= cap
        assert disk == store.disk_bytes
        assert disk <= cap + seg, (n, disk)
    for j in range(i - 4, i):
        assert read_one(store, j) > 0
    # Few files: segments hold many objects (compacted survivors may sit in small ones).
    assert len(segments(tmp_path)) <= 2 * (cap // seg) + 4
    store.close()
    with open_store(tmp_path, capacity_bytes=cap) as again:   # what the index said is what is on disk
        for h in hot:
            assert read_one(again, h) > 0
        assert again.used_bytes <= cap


def test_many_small_objects_make_few_files_and_clear_removes_them(tmp_path):
    """The point of segments: ten thousand 4 KiB objects are a handful of files, and clear()
    removes them all."""
    store = open_store(tmp_path, capacity_bytes=1 << 30)
    a = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    for b in range(100):
        keys = [f"{NS}/{b * 100 + j:064x}/0/k" for j in range(100)]
        assert store.batch_set(keys, [a.ctypes.data] * 100, [4096] * 100) == [OK] * 100
    assert len(store) == 10000
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 2, files
    out = np.empty(4096, dtype=np.uint8)
    assert store.batch_get([f"{NS}/{1234:064x}/0/k"], [out.ctypes.data], [4096]) == [4096]
    assert np.array_equal(out, a)
    store.clear()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [] and len(store) == 0
    store.close()


# ------------------------------------------------------------------------------------ the directory under an open store
def test_a_rank_directory_moved_away_or_replaced_under_an_open_store(tmp_path):
    """Moved away: every call fails softly and the directory is not made again; back: the store
    works again.  Replaced by an empty one: the old objects are misses (never the bytes of the
    files it still holds open) and new ones land in the new directory."""
    store = open_store(tmp_path)
    put_ids(store, range(6))
    d = store.directory
    aside = d.with_name("aside")
    d.rename(aside)
    out = np.empty(MAXLEN, dtype=np.uint8)
    assert store.batch_get([key_of(0)], [out.ctypes.data], [MAXLEN]) == [UNAVAILABLE]
    assert store.exists([key_of(0)]) == [UNAVAILABLE]
    a = payload(6)
    assert store.batch_set([key_of(6)], [a.ctypes.data], [a.nbytes]) == [UNAVAILABLE]
    assert not d.exists()
    aside.rename(d)
    assert read_one(store, 0) > 0
    put_ids(store, [6])
    shutil.rmtree(d)
    d.mkdir(mode=0o700)
    for i in range(7):
        assert read_one(store, i) == NOT_FOUND
    put_ids(store, [7, 8])
    store.close()
    check_all(tmp_path, range(9), must={7, 8})
    assert len(segments(tmp_path)) == 1


def test_a_writer_goes_on_after_another_process_clears_the_directory(tmp_path):
    writer, other = open_store(tmp_path), open_store(tmp_path)
    put_ids(writer, range(4))
    other.clear()
    assert segments(tmp_path) == []
    put_ids(writer, range(10, 14))                       # its segment was removed: it starts a new one
    writer.close()
    other.close()
    hits, _ = check_all(tmp_path, list(range(4)) + list(range(10, 14)), must=set(range(10, 14)))
    assert hits == 4
