"""The FileStore's formats against fixed bytes: the record header (Python's pack_header/parse_header
and C's pack_headers/parse_headers), key digests (hashlib and the C SHA-256), payload checksums,
and a scan of a checked-in segment (tests/vectors/file_segment_v2.seg, made by
tests/vectors/make_file_segment.py).  Every expected value is a literal here: a change to either
side's layout fails these tests, and so does a change to the vectors without one to this file."""
from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest

from transfer_factory.file import _records as fr
from transfer_factory.file import segments
from transfer_factory.file.checksums import checksums_at
from transfer_factory.file.index import key_digest
from transfer_factory.file.segments import (
    DEAD, HEADER_SIZE, LIVE, Entry, Segment, header_crc_of, pack_header, parse_header, payload_checksum, scan,
    unpack_header,
)
from transfer_factory.file.store import FileStore
from transfer_factory.kvcache_storage import NOT_FOUND

VECTORS = Path(__file__).resolve().parents[2] / "vectors"
SEGMENT = VECTORS / "file_segment_v2.seg"
SEGMENT_NAME = "0000000000000001.00000001.seg"
NS = "model-tp2-0123456789abcdef"
KEY_K = f"{NS}/{'ab' * 32}/0/k"
KEY_V = f"{NS}/{'ab' * 32}/0/v"
KEY_DEAD = "dead-key"
KEY_ODD = "kv/\u043a\u043b\u044e\u0447/\udc80"          # non-ASCII, and a lone surrogate passed through
PAYLOAD_K = bytes(i * 7 % 256 for i in range(100))
PAYLOAD_V = b"V" * 37 + bytes(range(20))
PAYLOAD_ODD = b"\x00\xff" * 50

DIGESTS = {
    KEY_K: "a6f3cb72a17e5c1549ec65b34d27be7a49d8538fd2ffdc0ddad8d76bb1f7c599",
    KEY_V: "ddfdec162c7342bbda3e352d786554235473d310c279835c339c348213244d07",
    KEY_DEAD: "37d4c984f0f0537a74a19bdafde3a9f078267d2fd22af059f04b28cc2015b680",
    KEY_ODD: "52b68c844d69eba6f310dea6b963ebf7ecbce5b047bce1848626d2f896325ee3",
}
CHECKSUMS = [(PAYLOAD_K, 0xF19D012E), (PAYLOAD_V, 0xA20A224D), (b"gone", 0x7693F438), (PAYLOAD_ODD, 0xA1593DD4)]
# KEY_K's live header (100 payload bytes, checksum 0xf19d012e), and KEY_DEAD's dead one (4 bytes).
HEADER_K = bytes.fromhex(
    "43544b520200000064000000000000002e019df1"
    "a6f3cb72a17e5c1549ec65b34d27be7a49d8538fd2ffdc0ddad8d76bb1f7c599"
    "6f204254")
HEADER_DEAD = bytes.fromhex(
    "43544b4402000000040000000000000038f49376"
    "37d4c984f0f0537a74a19bdafde3a9f078267d2fd22af059f04b28cc2015b680"
    "10e22e39")
# What a scan of the vector segment finds: (offset, live, payload_len, payload_sum, key digest, header crc).
SCANNED = [
    (0, True, 100, 0xF19D012E, DIGESTS[KEY_K], 0x5442206F),
    (156, True, 57, 0xA20A224D, DIGESTS[KEY_V], 0x04CE24BB),
    (269, False, 4, 0x7693F438, DIGESTS[KEY_DEAD], 0x392EE210),
    (342, True, 100, 0xA1593DD4, DIGESTS[KEY_ODD], 0x25803147),
]
SEGMENT_SIZE, GARBAGE_AT, GARBAGE_LEN, TORN_AT = 564, 329, 13, 498


def test_the_c_module_is_the_one_definition_of_the_header_layout():
    assert fr.HEADER_LAYOUT == {"magic": (0, 4), "version": (4, 2), "flags": (6, 2), "payload_len": (8, 8),
                                "payload_sum": (16, 4), "key_sha256": (20, 32), "header_crc": (52, 4)}
    assert (fr.HEADER_SIZE, fr.FORMAT_VERSION, fr.LIVE, fr.DEAD) == (56, 2, b"CTKR", b"CTKD")
    assert (segments.HEADER_SIZE, segments.FORMAT_VERSION, LIVE, DEAD) == (56, 2, b"CTKR", b"CTKD")


def test_python_and_c_pack_the_fixed_header_bytes():
    digest = bytes.fromhex(DIGESTS[KEY_K])
    assert pack_header(100, 0xF19D012E, digest) == HEADER_K
    assert fr.pack_headers([digest], [100], [0xF19D012E]) == HEADER_K
    assert fr.pack_headers([digest, digest], [100, 100], [0xF19D012E] * 2) == HEADER_K * 2
    dead_digest = bytes.fromhex(DIGESTS[KEY_DEAD])
    assert pack_header(4, 0x7693F438, dead_digest, magic=DEAD) == HEADER_DEAD
    assert DEAD + fr.pack_headers([dead_digest], [4], [0x7693F438])[4:] == HEADER_DEAD   # the magic is all that differs
    assert header_crc_of(digest, 100, 0xF19D012E) == 0x5442206F


def test_python_and_c_accept_the_fixed_header_bytes():
    assert tuple(parse_header(HEADER_K)) == (True, 100, 0xF19D012E, bytes.fromhex(DIGESTS[KEY_K]), 0x5442206F)
    assert tuple(parse_header(HEADER_DEAD)) == (False, 4, 0x7693F438, bytes.fromhex(DIGESTS[KEY_DEAD]), 0x392EE210)
    assert fr.parse_headers(HEADER_K + HEADER_DEAD, 2) == b"\x01\x02"
    e = Entry(Segment("x.seg", "x.seg", -1, own=True), 0, 100, 0xF19D012E, 0x5442206F)
    assert e.fields(bytes.fromhex(DIGESTS[KEY_K])) == unpack_header(HEADER_K)
    for at in (0, 4, 6, 8, 16, 20, 52):                  # any damaged field makes the header invalid on both sides
        damaged = bytearray(HEADER_K)
        damaged[at] ^= 0x01
        assert parse_header(bytes(damaged)) is None, at
        assert fr.parse_headers(bytes(damaged), 1) == b"\x00", at


@pytest.mark.parametrize("key", list(DIGESTS))
def test_hashlib_and_c_key_digests_are_the_fixed_digests(key):
    want = bytes.fromhex(DIGESTS[key])
    assert key_digest(key) == want
    assert fr.key_digests([key]) == [want]
    raw = key.encode("utf-8", "surrogatepass")
    assert fr.sha256(raw) == fr.sha256(raw, True) == want


def test_payload_checksums_are_the_fixed_values():
    for payload, want in CHECKSUMS:
        assert payload_checksum([payload]) == want
        assert payload_checksum([payload[:3], payload[3:]]) == want
        buf = ctypes.create_string_buffer(payload, len(payload))
        assert checksums_at([ctypes.addressof(buf)], [len(payload)]) == [want]


def test_a_scan_of_the_fixed_segment_finds_exactly_its_records():
    data = SEGMENT.read_bytes()
    assert len(data) == SEGMENT_SIZE
    fd = os.open(SEGMENT, os.O_RDONLY)
    try:
        found, end, skipped = scan(fd, 0, SEGMENT_SIZE)
    finally:
        os.close(fd)
    got = [(f.offset, f.header.live, f.header.payload_len, f.header.crc, f.header.digest.hex(), f.header.header_crc)
           for f in found]
    assert got == SCANNED
    assert (end, skipped) == (TORN_AT, GARBAGE_LEN)     # the torn tail is left for a later scan
    assert data[:HEADER_SIZE] == HEADER_K and data[269:269 + HEADER_SIZE] == HEADER_DEAD
    headers = b"".join(data[off:off + HEADER_SIZE] for off, *_ in SCANNED)
    assert fr.parse_headers(headers, len(SCANNED)) == b"\x01\x01\x02\x01"
    assert fr.parse_headers(data[GARBAGE_AT:GARBAGE_AT + HEADER_SIZE], 1) == b"\x00"
    assert fr.parse_headers(data[TORN_AT:TORN_AT + HEADER_SIZE], 1) == b"\x01"   # a valid header, payload cut short
    for (off, _, n, crc, *_), payload in zip(SCANNED, [PAYLOAD_K, PAYLOAD_V, b"gone", PAYLOAD_ODD]):
        assert data[off + HEADER_SIZE:off + HEADER_SIZE + n] == payload
        assert payload_checksum([payload]) == crc


def read(store, key, size):
    buf = ctypes.create_string_buffer(size)
    code = store.batch_get([key], [ctypes.addressof(buf)], [size])[0]
    return code, buf.raw[:max(code, 0)]


def test_a_store_serves_the_fixed_segment_and_leaves_it_as_it_was(tmp_path):
    rank = tmp_path / NS / "rank0"
    rank.mkdir(parents=True)
    shutil.copyfile(SEGMENT, rank / SEGMENT_NAME)
    with FileStore(NS, 0, {"root": str(tmp_path), "fsync": False}) as store:
        assert len(store) == 3 and store.used_bytes == 3 * HEADER_SIZE + 100 + 57 + 100
        assert read(store, KEY_K, 100) == (100, PAYLOAD_K)
        assert read(store, KEY_V, 100) == (57, PAYLOAD_V)
        assert read(store, KEY_ODD, 100) == (100, PAYLOAD_ODD)
        assert read(store, KEY_DEAD, 100)[0] == NOT_FOUND
        assert read(store, "torn-key", 1000)[0] == NOT_FOUND
        assert store.exists([KEY_K, KEY_V, KEY_DEAD, KEY_ODD, "torn-key"]) == [1, 1, 0, 1, 0]
    assert (rank / SEGMENT_NAME).read_bytes() == SEGMENT.read_bytes()


def test_a_store_writes_the_fixed_record_bytes(tmp_path):
    """The write path (C headers, XXH3 checksums, vectored write) lays records down exactly as the
    vector segment has them."""
    payloads = [PAYLOAD_K, PAYLOAD_V, PAYLOAD_ODD]
    bufs = [ctypes.create_string_buffer(p, len(p)) for p in payloads]
    with FileStore(NS, 0, {"root": str(tmp_path), "fsync": False}) as store:
        assert store.batch_set([KEY_K, KEY_V, KEY_ODD], [ctypes.addressof(b) for b in bufs],
                               [len(p) for p in payloads]) == [0, 0, 0]
        [seg] = [p for p in (tmp_path / NS / "rank0").iterdir() if p.suffix == ".seg"]
        data = SEGMENT.read_bytes()
        want = b"".join(data[off:off + HEADER_SIZE + n] for off, live, n, *_ in SCANNED if live)
        assert seg.read_bytes() == want
