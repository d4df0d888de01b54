"""The FileStore's batch-wide record helpers (transfer_factory/file/csrc/records.c) against the
Python definitions they replace: headers, digests, checksums, vectored I/O and index entries.  The
store's bulk paths end to end are in test_file_store_bulk.py."""
import ctypes
import gc
import hashlib
import importlib
import os
import random
import zlib

import numpy as np
import pytest
import xxhash

from tests.file_store_record_helpers import NS, key
from transfer_factory.file import _records as fr
from transfer_factory.file import checksums as file_checksums
from transfer_factory.file.checksums import XXH3_DIRECT, checksums_at
from transfer_factory.file.segments import (
    DEAD, FORMAT_VERSION, HEADER_SIZE, LIVE, Entry, Segment, pack_header, parse_header, unpack_header,
)
from transfer_factory.file.space import group_of
from transfer_factory.keys import KINDS


def digest(i):
    return hashlib.sha256(str(i).encode()).digest()


# ------------------------------------------------------------------------------------ headers
def test_pack_headers_is_pack_header_for_each_record():
    rng = random.Random(1)
    lens = [rng.choice([1, 56, 16384, 1 << 40]) for _ in range(200)]
    crcs = [rng.getrandbits(32) for _ in range(200)]
    ds = [digest(i) for i in range(200)]
    packed = fr.pack_headers(ds, lens, crcs)
    assert packed == b"".join(pack_header(n, c, d) for d, n, c in zip(ds, lens, crcs))
    assert fr.parse_headers(packed, 200) == b"\x01" * 200
    with pytest.raises(ValueError):
        fr.pack_headers([b"short"], [1], [0])
    with pytest.raises(ValueError):
        fr.pack_headers([digest(0)], [1], [1 << 32])
    with pytest.raises(ValueError):
        fr.pack_headers([digest(0)], [1, 2], [0])


def test_parse_headers_rejects_every_damaged_header_like_parse_header():
    """A flipped bit anywhere in a header (magic, version, flags, length, checksum, digest, header
    CRC) makes it invalid in the bulk parse exactly when parse_header says so; the dead magic
    keeps it valid (status 2)."""
    good = pack_header(16384, 0xDEADBEEF, digest(7))
    n = HEADER_SIZE * 8
    bufs = []
    for bit in range(n):
        b = bytearray(good)
        b[bit // 8] ^= 1 << (bit % 8)
        bufs.append(bytes(b))
    dead = DEAD + good[4:]
    bufs += [good, dead, bytes(HEADER_SIZE)]
    status = fr.parse_headers(b"".join(bufs), len(bufs))
    for raw, st in zip(bufs, status):
        h = parse_header(raw)
        assert st == (0 if h is None else 1 if h.live else 2)
    assert status[-3:] == b"\x01\x02\x00"
    assert status[:n].count(0) == n                        # every single-bit flip is caught
    with pytest.raises(ValueError):
        fr.parse_headers(good, 2)                          # more headers than bytes


def test_unpack_of_a_packed_header_has_every_field():
    raw = fr.pack_headers([digest(3)], [123], [456])
    magic, version, flags, n, crc, d, hcrc = unpack_header(raw)
    assert (magic, version, flags, n, crc, d) == (LIVE, FORMAT_VERSION, 0, 123, 456, digest(3))
    assert hcrc == zlib.crc32(raw[4:52])


# ------------------------------------------------------------------------------------ digests
@pytest.mark.parametrize("portable", [False, True])
def test_sha256_matches_hashlib_at_every_padding_length(portable):
    rng = random.Random(2)
    for n in list(range(0, 200)) + [1000, 4096, 65537]:
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert fr.sha256(data, portable) == hashlib.sha256(data).digest(), n


def test_key_digests_match_the_store_definition():
    keys = [key(i) for i in range(50)] + ["a", "é" * 70, "\ud800lone", "x" * 300, "", 5, None, b"bytes"]
    want = [hashlib.sha256(k.encode("utf-8", "surrogatepass")).digest() if isinstance(k, str) and k else None
            for k in keys]
    assert fr.key_digests(keys) == want
    assert fr.key_digests(tuple(keys)) == want


def test_key_groups_match_group_of():
    keys = [key(1), key(1, "v"), key(2, "k_scale"), key(2, "v_scale"), "a/b/0/x", "k", "/k", "a//v", "a/b/",
            "é/\ud800/v", "", 7, None, f"{NS}/ab/0/kv"]
    assert fr.key_groups(keys, KINDS) == [group_of(k) for k in keys]


# ------------------------------------------------------------------------------------ checksums
def test_checksums_direct_and_through_python_equal_xxh3():
    data = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    base = data.ctypes.data
    sizes = list(range(0, 260)) + [1000, 16384, 100000, (1 << 20) - 7]
    ptrs = [base + (s * 13) % 7 for s in sizes]
    view = memoryview(data)
    want = [xxhash.xxh3_64_intdigest(view[p - base:p - base + s]) & 0xFFFFFFFF for p, s in zip(ptrs, sizes)]
    assert fr.checksums(xxhash.xxh3_64_intdigest, ptrs, sizes, True) == want
    assert checksums_at(ptrs, sizes) == want
    assert XXH3_DIRECT                                     # the wheel exports it; a fallback still passes above
    xxh_lib = ctypes.CDLL(importlib.import_module(xxhash.xxh3_64_intdigest.__module__).__file__)
    if hasattr(xxh_lib, "XXH3_64bits_withSeed_dispatch"):  # AVX2 / AVX-512 picked at run time, not SSE2
        assert file_checksums.XXH3_BOUND == "XXH3_64bits_withSeed_dispatch"
    try:
        assert fr.bind_xxh3(None) is False                 # unbound: every checksum through xxhash's Python call
        assert checksums_at(ptrs, sizes) == want
        with pytest.raises(RuntimeError):
            fr.read_and_sum(0, 0, bytearray(HEADER_SIZE), ptrs[1:2], sizes[1:2], 1 << 20)
        assert fr.bind_xxh3("/nonexistent/lib.so") is False
    finally:
        assert file_checksums._bind_xxh3() == file_checksums.XXH3_BOUND


# ------------------------------------------------------------------------------------ vectored I/O
def test_write_and_read_records_round_trip_with_counts_and_empty_buffers(tmp_path):
    a = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
    hdrs = fr.pack_headers([digest(0), digest(1)], [30, 100], [1, 2])
    sizes = [10, 0, 20, 100]
    ptrs = [a.ctypes.data, a.ctypes.data + 100, a.ctypes.data + 200, a.ctypes.data + 1000]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert fr.write_records(fd, 7, hdrs, ptrs, sizes, [3, 1]) == 2 * HEADER_SIZE + 130
        raw = os.pread(fd, 1000, 7)
        assert raw == hdrs[:56] + a[:10].tobytes() + a[200:220].tobytes() + hdrs[56:] + a[1000:1100].tobytes()
        out = np.zeros(200, dtype=np.uint8)
        scratch = bytearray(2 * HEADER_SIZE)
        got = fr.read_records(fd, 7, scratch, [out.ctypes.data, out.ctypes.data + 30], [30, 100], None)
        assert got == 2 * HEADER_SIZE + 130 and bytes(scratch) == hdrs
        assert out[:30].tobytes() == a[:10].tobytes() + a[200:220].tobytes()
        assert out[30:130].tobytes() == a[1000:1100].tobytes()
        # At the end of the file a read is short, never an error.
        got = fr.read_records(fd, 7 + 100, bytearray(2 * HEADER_SIZE), [out.ctypes.data, out.ctypes.data + 30],
                              [30, 100], None)
        assert got == 2 * HEADER_SIZE + 130 - 100
        with pytest.raises(ValueError):
            fr.write_records(fd, 0, hdrs, ptrs, sizes, [3, 2])   # counts name more buffers than given
        with pytest.raises(OSError):
            fr.write_records(-1, 0, hdrs[:56], ptrs[:1], sizes[:1], None)
    finally:
        os.close(fd)


@pytest.mark.skipif(not XXH3_DIRECT, reason="XXH3 not bound")
def test_read_and_sum_checksums_only_the_records_read_whole(tmp_path):
    n, size = 40, 5000
    src = np.frombuffer(os.urandom(n * size), dtype=np.uint8).copy()
    ptrs = [src.ctypes.data + i * size for i in range(n)]
    crcs = checksums_at(ptrs, [size] * n)
    hdrs = fr.pack_headers([digest(i) for i in range(n)], [size] * n, crcs)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fr.write_records(fd, 0, hdrs, ptrs, [size] * n, None)
        os.ftruncate(fd, 17 * (HEADER_SIZE + size) + 100)           # record 17 torn
        dst = np.zeros_like(src)
        scratch = bytearray(HEADER_SIZE * n)
        got, sums = fr.read_and_sum(fd, 0, scratch, [dst.ctypes.data + i * size for i in range(n)], [size] * n, 3000)
        assert got == 17 * (HEADER_SIZE + size) + 100
        assert sums == crcs[:17]
        assert dst[:17 * size].tobytes() == src[:17 * size].tobytes()
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ index entries
def test_entry_fields_mutation_and_no_gc_tracking(tmp_path):
    seg = Segment("x.seg", str(tmp_path / "x.seg"), -1, own=True)
    e = Entry(seg, 10, 16384, 0xFFFFFFFF, 7)
    assert (e.seg, e.offset, e.length, e.crc, e.hcrc, e.size) == (seg, 10, 16384, 0xFFFFFFFF, 7, HEADER_SIZE + 16384)
    assert e.fields(digest(1)) == (LIVE, FORMAT_VERSION, 0, 16384, 0xFFFFFFFF, digest(1), 7)
    e.seg, e.offset = "other", 99                          # a compaction moves a record
    assert (e.seg, e.offset) == ("other", 99)
    assert not gc.is_tracked(e)
    index = {}
    headers = fr.pack_headers([digest(1), digest(2)], [44, 55], [1, 2])
    fr.new_entries(index, seg, [digest(1), digest(2)], [0, 100], [44, 55], [1, 2], headers)
    assert [(x.seg, x.offset, x.length, x.crc, x.hcrc) for x in index.values()] == [
        (seg, 0, 44, 1, unpack_header(headers)[6]), (seg, 100, 55, 2, unpack_header(headers, 56)[6])]
    with pytest.raises(ValueError):
        fr.new_entries({}, seg, [digest(1)], [0], [44], [1], headers)          # two headers for one record
    with pytest.raises(ValueError):
        Entry(seg, 0, 1, 1 << 32, 0)


def test_select_all_declines_anything_but_the_simple_batch(tmp_path):
    seg = Segment("x.seg", str(tmp_path / "x.seg"), -1, own=True)
    index = {digest(1): Entry(seg, 0, 10, 5, 6), digest(2): Entry(seg, 66, 20, 7, 8)}
    ds = [digest(1), digest(2)]
    assert fr.select_all(index, ds, [1, 2], [10, 20], {}) == ([seg, seg], [0, 66], [10, 20], [5, 7], False)
    assert fr.select_all(index, ds, [1, 2], [10, 20], dict.fromkeys(ds))[4] is True   # every block known
    assert fr.select_all(index, ds, [1, 2], [10, 19], {}) is None       # a buffer too small
    assert fr.select_all(index, ds, [1, 0], [10, 20], {}) is None       # a bad pointer
    assert fr.select_all(index, ds, [1, True], [10, 20], {}) is None    # not an int
    assert fr.select_all(index, [digest(1), digest(3)], [1, 2], [10, 20], {}) is None   # not stored
    assert fr.select_all(index, [digest(1), None], [1, 2], [10, 20], {}) is None        # not a key
