"""Writes file_segment_v2.seg, the FileStore segment that
tests/transfer_factory/file/test_file_formats.py reads.

Run once (``python tests/vectors/make_file_segment.py``) and check the result in; regenerating it
is only right for a deliberate format change, together with the hex literals in the test.  The
records are packed here straight from the format's description (transfer_factory/file/csrc/records.h,
segments.py's docstring), not with the store's own code, so the file pins the format rather than
whatever the code does today:

    offset size field
    0      4    magic          b"CTKR" live, b"CTKD" dead
    4      2    version        2
    6      2    flags          0
    8      8    payload_len
    16     4    payload_sum    low 32 bits of XXH3-64 of the payload
    20     32   key_sha256     SHA-256 of the key's UTF-8 (lone surrogates passed through)
    52     4    header_crc32   zlib.crc32 of bytes 4..51
    56     n    payload

Contents, in order: two live records (a block's K and V), a dead record, 13 bytes of garbage that
a scan must step over, a live record whose key holds non-ASCII text and a lone surrogate, and a
torn tail (a valid header whose payload is cut short) where a scan must stop.
"""
from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from pathlib import Path

import xxhash

NAME = "0000000000000001.00000001.seg"          # a segment name a store accepts
NS = "model-tp2-0123456789abcdef"
RECORDS = [                                      # (key, payload, live)
    (f"{NS}/{'ab' * 32}/0/k", bytes(i * 7 % 256 for i in range(100)), True),
    (f"{NS}/{'ab' * 32}/0/v", b"V" * 37 + bytes(range(20)), True),
    ("dead-key", b"gone", False),
    ("kv/\u043a\u043b\u044e\u0447/\udc80", b"\x00\xff" * 50, True),
]
GARBAGE = b"CTK" + bytes(range(200, 210))        # 13 bytes; begins like a magic so resync must look closer
TORN_KEY, TORN_LEN, TORN_KEPT = "torn-key", 1000, 10


def header(key: str, payload_len: int, payload_sum: int, live: bool = True) -> bytes:
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    body = struct.pack("<HHQI32s", 2, 0, payload_len, payload_sum, digest)
    return (b"CTKR" if live else b"CTKD") + body + struct.pack("<I", zlib.crc32(body))


def payload_sum(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload) & 0xFFFFFFFF


def image() -> bytes:
    parts = []
    for i, (key, payload, live) in enumerate(RECORDS):
        parts += [header(key, len(payload), payload_sum(payload), live), payload]
        if i == 2:
            parts.append(GARBAGE)
    torn = bytes(i % 256 for i in range(TORN_LEN))
    parts += [header(TORN_KEY, TORN_LEN, payload_sum(torn)), torn[:TORN_KEPT]]
    return b"".join(parts)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("file_segment_v2.seg")
    out.write_bytes(image())
    print(f"wrote {out}: {out.stat().st_size} bytes")
