"""FileStore faults from issue 24 (transfer_factory/file/): a record header whose CRC is valid
but whose payload length is 0, a segment that fails reads with EIO, and a compacting peer
process paused while it holds a segment exclusive."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import xxhash

from tests.file_store_helpers import NS, get, key, open_store, put, rand_bytes
from transfer_factory.kvcache_storage import CORRUPT, NOT_FOUND, OK

logger = logging.getLogger(__name__)


def packed_record(k: str, payload: bytes, length: int | None = None) -> bytes:
    """One live record packed from the format's description (segments.py, csrc/records.h), not
    with the store's code; ``length`` overrides the header's payload length (the CRC still fits)."""
    digest = hashlib.sha256(k.encode("utf-8", "surrogatepass")).digest()
    crc = xxhash.xxh3_64_intdigest(payload) & 0xFFFFFFFF
    body = struct.pack("<HHQI32s", 2, 0, len(payload) if length is None else length, crc, digest)
    return b"CTKR" + body + struct.pack("<I", zlib.crc32(body)) + payload


def rank_dir(root):
    d = root / NS / "rank0"
    d.mkdir(mode=0o700, parents=True)
    os.chmod(root / NS, 0o700)
    return d


def write_segment(directory, name: str, records: list[bytes]) -> None:
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"".join(records))
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ item 13
def test_a_zero_length_header_with_a_valid_crc_is_a_miss_and_the_rest_of_the_batch_reads(tmp_path):
    """A header whose CRC is right but whose payload length is 0 (no store writes an empty
    object): the C reader refuses zero-length records, so before the fix the whole batch raised
    ``ValueError: record N: bad pointer or size`` while exists() said 1.  Now it is a damaged
    header: stepped over by the scan, a miss, and its neighbours read back bit-exact."""
    root = tmp_path / "kv"
    a, b = rand_bytes(3000, 1).tobytes(), rand_bytes(5000, 2).tobytes()
    ka, kz, kb = key(1), key(2), key(3)
    write_segment(rank_dir(root), "0000000000000001.00000001.seg",
                  [packed_record(ka, a), packed_record(kz, b"", length=0), packed_record(kb, b)])
    with open_store(root) as s:
        assert s.exists([ka, kz, kb]) == [1, 0, 1]
        bufs = [np.full(n, 0xA5, dtype=np.uint8) for n in (3000, 64, 5000)]
        codes = s.batch_get([ka, kz, kb], [x.ctypes.data for x in bufs], [x.nbytes for x in bufs])
        assert codes[0] == 3000 and codes[2] == 5000 and codes[1] in (NOT_FOUND, CORRUPT), codes
        assert bufs[0].tobytes() == a and bufs[2].tobytes() == b
        assert bufs[1].tobytes() == b"\xa5" * 64                  # nothing written for the miss
        assert get(s, kz, 64)[0] in (NOT_FOUND, CORRUPT)
        assert s.exists([kz]) == [0]


def test_both_header_parsers_refuse_a_zero_length_header():
    """The scanner (Python) and the reader's bulk parse (C) agree: valid CRC, length 0 -> invalid."""
    from transfer_factory.file import _records
    from transfer_factory.file.segments import parse_header, scan
    zero = packed_record(key(2), b"", length=0)
    assert parse_header(zero) is None
    assert _records.parse_headers(zero, 1) == b"\x00"
    assert _records.parse_headers(packed_record(key(2), b"x"), 1) == b"\x01"
    fd = os.memfd_create("seg")
    try:
        os.write(fd, zero + packed_record(key(3), b"abc"))
        found, end, skipped = scan(fd, 0, len(zero) + 59)
        assert [(f.offset, f.header.payload_len) for f in found] == [(56, 3)] and (end, skipped) == (115, 56)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ item 6
def fail_reads_of(monkeypatch, paths) -> set:
    """Makes ``os.pread`` (what the segment scanner reads with) fail with EIO for the files in the
    returned set of (st_dev, st_ino), which the caller may grow.

    Device-mapper is not usable in this sandbox (no /dev/mapper/control: ``dmsetup create`` fails
    with "Failure to communicate with kernel device-mapper driver"), so an unreadable sector cannot
    be made under a real filesystem here; the EIO is injected at the OS boundary the scanner uses
    instead, for that one file only, as the kernel would report it."""
    bad = set()
    for p in paths:
        st = os.stat(p)
        bad.add((st.st_dev, st.st_ino))
    real = os.pread

    def pread(fd, n, offset):
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    return bad


def segment_paths(root):
    return sorted((root / NS / "rank0").glob("*.seg"))


def assert_reads(store, ids, data):
    for i in ids:
        code, out = get(store, key(i), data[i].nbytes)
        assert code == data[i].nbytes and out.tobytes() == data[i].tobytes(), i


def assert_misses(store, ids, data):
    assert store.exists([key(i) for i in ids]) == [0] * len(ids)
    for i in ids:
        assert get(store, key(i), data[i].nbytes)[0] == NOT_FOUND, i


def test_an_unreadable_segment_costs_only_its_own_records(tmp_path, monkeypatch, caplog):
    """EIO in one segment, at open and at run time (DESIGN §4): the store opens, the other
    segments' objects read back bit-exact, that segment's objects are misses, and later
    refreshing calls do not raise.  Before the fix the OSError from the scan escaped FileStore()."""
    root = tmp_path / "kv"
    data = {i: rand_bytes(2000 + i, 10 + i) for i in range(16)}
    for ids in (range(0, 4), range(4, 8)):                    # segments A and B, sealed
        with open_store(root) as w:
            assert [put(w, key(i), data[i]) for i in ids] == [OK] * 4
    seg_a, seg_b = segment_paths(root)
    with open_store(root) as peer:                            # another instance, its own segment C
        bad = fail_reads_of(monkeypatch, [seg_b])
        assert [put(peer, key(i), data[i]) for i in range(8, 12)] == [OK] * 4
        (seg_c,) = set(segment_paths(root)) - {seg_a, seg_b}
        with caplog.at_level(logging.WARNING, logger="transfer_factory.file.store"), open_store(root) as s:
            assert f"cannot read segment {seg_b.name}" in caplog.text
            assert_reads(s, range(0, 4), data)
            assert_reads(s, range(8, 12), data)
            assert_misses(s, range(4, 8), data)
            # At run time: C becomes unreadable while the peer appends to it; this instance's
            # refresh finds new bytes there and cannot read them.
            st = os.stat(seg_c)
            bad.add((st.st_dev, st.st_ino))
            assert [put(peer, key(i), data[i]) for i in range(12, 16)] == [OK] * 4
            caplog.clear()
            assert_misses(s, range(12, 16), data)             # a refresh: must not raise
            assert f"cannot read segment {seg_c.name}" in caplog.text
            assert_misses(s, range(8, 12), data)              # C's objects are misses now
            assert_reads(s, range(0, 4), data)
            s.segment_log.refresh()
            assert s.exists([key(i) for i in range(16)]) == [1] * 4 + [0] * 12


# ------------------------------------------------------------------------------------ item 7
# A peer that takes a segment exclusive the way a compaction does (segments.try_lock_exclusive),
# says so, and holds it until its stdin closes.
PEER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("locked", flush=True)
sys.stdin.read()
"""


def magic_at(path, offset) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(4)


def test_a_paused_compacting_peer_does_not_stall_writes_and_the_dead_mark_lands_later(tmp_path):
    """A peer process holds a sealed segment exclusive (as its compaction would) and is
    SIGSTOPped.  Before the fix, delete's dead mark waited for flock(LOCK_SH) while holding the
    append lock, so it and every write of this instance hung until the peer resumed.  Now the mark
    is deferred: delete and batch_set complete (5 s is a hang detector, not a speed bound), the
    key reads as its new bytes, and once the peer lets go the next write lands the dead mark on
    the old record."""
    root = tmp_path / "kv"
    old, new, other = rand_bytes(3000, 1), rand_bytes(5000, 2), rand_bytes(1000, 3)
    with open_store(root) as w:
        assert put(w, key(1), old) == OK
    (seg_a,) = segment_paths(root)
    with open_store(root) as s:
        loc = s.object_location(key(1))
        assert loc.path == seg_a and magic_at(seg_a, loc.offset) == b"CTKR"
        peer = subprocess.Popen([sys.executable, "-c", PEER, str(seg_a)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        done: dict = {}

        def writes():
            done["delete"] = s.delete([key(1)])
            done["set"] = [put(s, key(1), new), put(s, key(2), other)]

        worker = threading.Thread(target=writes, daemon=True)
        try:
            assert select.select([peer.stdout], [], [], 30)[0], "the peer did not lock the segment"
            assert peer.stdout.readline() == "locked\n"
            os.kill(peer.pid, signal.SIGSTOP)
            worker.start()
            worker.join(5)
            assert not worker.is_alive(), "writes stalled behind a paused peer's exclusive flock"
            assert done == {"delete": [OK], "set": [OK, OK]}
            assert magic_at(seg_a, loc.offset) == b"CTKR"        # deferred: the peer still holds it
            code, out = get(s, key(1), 5000)
            assert code == 5000 and out.tobytes() == new.tobytes()
        finally:
            os.kill(peer.pid, signal.SIGCONT)
            peer.stdin.close()
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait(timeout=30)
            peer.stdout.close()
            if worker.is_alive() or worker.ident is not None:
                worker.join(30)
        assert put(s, key(3), other) == OK                      # the next write retries the mark
        assert magic_at(seg_a, loc.offset) == b"CTKD"
        assert s.exists([key(1), key(2), key(3)]) == [1, 1, 1]
    with open_store(root) as again:                             # and a restart agrees
        code, out = get(again, key(1), 5000)
        assert code == 5000 and out.tobytes() == new.tobytes()
        assert not seg_a.exists()                               # nothing live in it: removed on open
