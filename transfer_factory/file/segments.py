"""The FileStore's segment files: the record format, scanning, and the locks between processes.

A segment file holds many objects, one **record** each, appended back to back from offset 0 with
no padding.  A record is a 56-byte header, then the payload (all integers little-endian; the
offsets are defined once, in csrc/records.h, and this module checks its structs against them;
tests/transfer_factory/file/test_file_formats.py holds both sides to fixed bytes)::

    offset size field
    0      4    magic          b"CTKR" a live record; b"CTKD" a dead one (deleted, or found corrupt)
    4      2    version        2
    6      2    flags          0 (anything else is refused)
    8      8    payload_len    bytes of payload that follow the header
    16     4    payload_sum    the low 32 bits of XXH3-64 of the payload (``payload_checksum``)
    20     32   key_sha256     SHA-256 of the key (UTF-8, lone surrogates passed through)
    52     4    header_crc32   zlib.crc32 of bytes 4..51: every field but the magic
    56     n    payload        the object; for multi-buffer objects the buffers concatenated in order

The header checksum leaves the magic out so that deleting a record is one 4-byte write of the dead
magic that keeps the header valid: a scan still knows the record's length and steps over it.  A
header is *valid* when its magic is one of the two, its checksum matches, version and flags are
known and the payload is not empty (no store writes an empty object: a zero length is damage that
the CRC happened to cover, and the readers refuse zero-length records); a record is *whole* when, moreover, its payload lies inside the file.  A scan walks the
records from an offset; at an invalid header (a torn write, damage) it looks for the next valid
header further on (``resync``), so one bad record costs only itself.  A reader trusts a record only
when the header it reads back is byte for byte the one its index expects (live, same key, length
and checksum) and the payload's CRC matches: a valid header found by a resync can at worst be a
record whose checks pass, that is a right object for its key.

Segment names are ``{creation time ns:016x}.{random:08x}.seg`` (so sorting names sorts them by
age); a segment is created as ``{name}.new``, locked, then renamed, so no other process ever sees
an unlocked segment that a writer is about to use.

Locks (``flock``, released by the kernel when a process dies, so never stale):

* the process appending to a segment holds it **shared** while it may still append (its *active*
  segment; each process appends only to segments it created);
* deleting a record (writing the dead magic) holds the segment **shared** for that write;
* reclaiming a segment (compacting its live records into the active segment, or dropping it
  whole) needs it **exclusive**, taken without waiting: a segment someone appends to or deletes
  from is skipped, so a reclaim never removes a segment under a writer, and a delete never marks a
  copy that a compaction is moving: the deleter takes its shared lock without waiting and, when
  it cannot, defers the mark (the object is a miss meanwhile) to its next write or delete, where a
  copy that compaction made is deleted too (log.py).
"""
from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import struct
import time
import zlib
from typing import NamedTuple

import xxhash

from transfer_factory.file import _records
from transfer_factory.file.store_io import create_private, open_owned

# The layout is defined once, in csrc/records.h; these are the C module's constants, and the
# structs below must lay the fields out exactly as its HEADER_LAYOUT says (checked on import).
LIVE: bytes = _records.LIVE                    # b"CTKR"
DEAD: bytes = _records.DEAD                    # b"CTKD"
FORMAT_VERSION: int = _records.FORMAT_VERSION  # 2: XXH3 payload checksums (1 had CRC32)
HEADER_SIZE: int = _records.HEADER_SIZE        # 56
_FIELDS = ("magic", "version", "flags", "payload_len", "payload_sum", "key_sha256", "header_crc")
_HEADER = struct.Struct("<4sHHQI32sI")         # the whole header, magic first, fields as in _FIELDS
_BODY = struct.Struct("<HHQI32s")              # version .. key_sha256: what the header CRC covers
_CRC = struct.Struct("<I")


def _check_layout() -> None:
    """Refuses to load when this module's structs disagree with the C definition of the header."""
    layout, offset = [], 0
    for code in ("4s", "H", "H", "Q", "I", "32s", "I"):
        size = struct.calcsize("<" + code)
        layout.append((offset, size))
        offset += size
    if (dict(zip(_FIELDS, layout)) != _records.HEADER_LAYOUT or _HEADER.size != HEADER_SIZE
            or _BODY.size != _records.HEADER_LAYOUT["header_crc"][0] - _records.HEADER_LAYOUT["version"][0]):
        raise ImportError(f"segments.py's record header {dict(zip(_FIELDS, layout))} disagrees with "
                          f"csrc/records.h's {_records.HEADER_LAYOUT}: rebuild the extension")


_check_layout()
SEG_SUFFIX = ".seg"
NEW_SUFFIX = ".new"                            # a segment being created: never read
SEG_RE = re.compile(r"^[0-9a-f]{16}\.[0-9a-f]{8}\.seg$")
NEW_RE = re.compile(r"^[0-9a-f]{16}\.[0-9a-f]{8}\.seg\.new$")
_OLD_FANOUT_LEN = 2                  # the one-file-per-object format's {h[0:2]}/ directories
SEGMENT_MIN = 64 << 10
SEGMENT_MAX = 64 << 20
_RESYNC_CHUNK = 1 << 20


def segment_size(capacity: int, fs_total: int) -> int:
    """Bytes after which a segment is sealed (a batch is never split, so one may exceed it): a
    sixteenth of the capacity and of the filesystem, within [64 KiB, 64 MiB].  Reclaiming keeps the
    segments' total within the capacity plus one segment."""
    size = min(SEGMENT_MAX, capacity // 16)
    if fs_total > 0:
        size = min(size, fs_total // 16)
    return max(size, SEGMENT_MIN)


def pack_header(payload_len: int, crc: int, digest: bytes, magic: bytes = LIVE) -> bytes:
    body = _BODY.pack(FORMAT_VERSION, 0, payload_len, crc, digest)
    return magic + body + _CRC.pack(zlib.crc32(body))


class Header(NamedTuple):
    live: bool
    payload_len: int
    crc: int
    digest: bytes
    header_crc: int


def parse_header(raw: bytes | memoryview) -> Header | None:
    """The header in ``raw`` (at least 56 bytes), or None when it is not valid."""
    if len(raw) < HEADER_SIZE:
        return None
    magic = bytes(raw[:4])
    if magic != LIVE and magic != DEAD:
        return None
    if zlib.crc32(raw[4:HEADER_SIZE - 4]) != _CRC.unpack_from(raw, HEADER_SIZE - 4)[0]:
        return None
    version, flags, payload_len, crc, digest = _BODY.unpack_from(raw, 4)
    if version != FORMAT_VERSION or flags != 0 or payload_len == 0:
        return None
    return Header(magic == LIVE, payload_len, crc, digest, _CRC.unpack_from(raw, HEADER_SIZE - 4)[0])


def header_crc_of(digest: bytes, payload_len: int, crc: int) -> int:
    """The header CRC of the live record of ``digest`` with that length and payload checksum."""
    return zlib.crc32(_BODY.pack(FORMAT_VERSION, 0, payload_len, crc, digest))


def header_crc(header: bytes) -> int:
    return _CRC.unpack_from(header, HEADER_SIZE - 4)[0]


def payload_checksum(views) -> int:
    """The payload checksum of a record: the low 32 bits of XXH3-64 over the views in order.

    XXH3 runs at tens of GB/s where zlib's CRC32 runs at 2-4 GB/s; a read checks every byte it
    serves, so with CRC32 the checksum, not the disk or the page cache, bounded reads (format 1).
    Any change of a payload byte changes it with probability 1 - 2**-32, as CRC32 would."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0]) & 0xFFFFFFFF
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest() & 0xFFFFFFFF


class Found(NamedTuple):
    offset: int
    header: Header


def resync(fd: int, start: int, end: int) -> int | None:
    """The offset of the first valid header in [start, end), or None."""
    pos = start
    while pos + HEADER_SIZE <= end:
        chunk = os.pread(fd, min(_RESYNC_CHUNK, end - pos), pos)
        if len(chunk) < HEADER_SIZE:
            return None
        i = chunk.find(b"CTK")
        while i != -1 and i + HEADER_SIZE <= len(chunk):
            if parse_header(memoryview(chunk)[i:i + HEADER_SIZE]) is not None:
                return pos + i
            i = chunk.find(b"CTK", i + 1)
        pos += len(chunk) - HEADER_SIZE + 1          # overlap: a header may straddle two chunks
    return None


def scan(fd: int, start: int, end: int) -> tuple[list[Found], int, int]:
    """The whole records (live and dead) of a segment from ``start`` up to ``end`` (its size).

    Returns (records, where the next scan starts, bytes of invalid data skipped).  A record whose
    header or payload runs past ``end`` stops the scan at its start: its writer may still be
    writing it, and the next scan looks again.  An invalid header is skipped up to the next valid
    one (or the end)."""
    found: list[Found] = []
    off = start
    skipped = 0
    while off + HEADER_SIZE <= end:
        header = parse_header(os.pread(fd, HEADER_SIZE, off))
        if header is None:
            nxt = resync(fd, off + 1, end)
            skipped += (end if nxt is None else nxt) - off
            if nxt is None:
                return found, end, skipped
            off = nxt
            continue
        stop = off + HEADER_SIZE + header.payload_len
        if stop > end:
            break
        found.append(Found(off, header))
        off = stop
    return found, off, skipped


# Where one object's live record is, and its header's fields: the index's value.  Entry(seg,
# offset, length, crc, hcrc) with those attributes (seg and offset change when a compaction moves
# the record), ``size`` (header + payload) and ``fields(digest)`` (the live header's fields as
# ``unpack_header`` returns them: equal means byte for byte the header this record was written, or
# found valid, with).  A C type, as a batch makes one per record (csrc/records.c).
Entry = _records.Entry


def unpack_header(raw, offset: int = 0) -> tuple:
    """(magic, version, flags, payload_len, payload_crc32, key_sha256, header_crc32) at ``offset``."""
    return _HEADER.unpack_from(raw, offset)


def record_state(e: Entry, d: bytes) -> bool | None:
    """True when ``e``'s record on disk is still ``d``'s live record, False when it is dead or
    another record, None when its header is damaged or unreadable."""
    try:
        raw = os.pread(e.seg.fd, HEADER_SIZE, e.offset)
    except OSError:
        return None
    if len(raw) == HEADER_SIZE and unpack_header(raw) == e.fields(d):
        return True
    return False if parse_header(raw) is not None else None


class Segment:
    """One segment file as a store instance knows it.  Only the segment log changes it (through
    these methods, under its table lock); everyone else reads ``name``, ``path``, ``fd``, ``own``,
    ``size``, ``active`` and ``closed``."""
    __slots__ = ("name", "path", "fd", "size", "scanned", "own", "active", "fresh", "pins", "closed")

    def __init__(self, name: str, path: str, fd: int, own: bool, created: bool = False) -> None:
        self.name, self.path, self.fd, self.own = name, path, fd, own
        self.size = 0                  # bytes of the file this instance accounts for
        self.scanned = 0               # records before this offset are known (others' segments)
        self.active = created          # this instance appends to it (and holds it shared)
        self.fresh = created           # created by this instance, its name not yet made durable
        self.pins = 0                  # reads in flight: the fd is closed only once they are done
        self.closed = False

    def resize(self, size: int) -> int:
        """Accounts for the file being ``size`` bytes now; returns the change."""
        grown, self.size = size - self.size, size
        return grown

    def scanned_to(self, offset: int) -> None:
        self.scanned = offset

    def retire(self) -> None:
        """No longer appended to by this instance."""
        self.active = False

    def made_durable(self) -> None:
        """Its name has been synced into the directory."""
        self.fresh = False

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        if self.closed and self.pins == 0:
            self.close()

    def close(self) -> None:
        """Closed for good; the fd (and with it any flock) goes once no read has it pinned."""
        self.closed = True
        if self.pins == 0 and self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


def new_segment(directory: str) -> Segment:
    """Creates an empty segment of this process, locked shared for appending, mode 0600."""
    for _ in range(8):
        name = f"{time.time_ns():016x}.{secrets.token_hex(4)}{SEG_SUFFIX}"
        path = os.path.join(directory, name)
        try:
            fd = create_private(path + NEW_SUFFIX)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(path + NEW_SUFFIX, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path + NEW_SUFFIX)
            except OSError:
                pass
            raise
        return Segment(name, path, fd, own=True, created=True)
    raise FileExistsError(f"cannot find a free segment name in {directory}")


def open_segment(directory: str, name: str) -> Segment:
    """Another instance's segment; ``store_io.Untrusted`` when it is not a regular file of this user."""
    path = os.path.join(directory, name)
    return Segment(name, path, open_owned(path, os.O_RDWR), own=False)


def try_lock_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def lock_shared(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_SH)


def try_lock_shared(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------ removal
def remove_old_layout(directory: str) -> int:
    """Removes the fan-out directories of the one-file-per-object format; how many."""
    removed = 0
    try:
        with os.scandir(directory) as it:
            olds = [e.path for e in it if len(e.name) == _OLD_FANOUT_LEN and e.is_dir(follow_symlinks=False)
                    and all(c in "0123456789abcdef" for c in e.name)]
    except OSError:
        return 0
    for path in olds:
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed

def remove_segment_files(directory: str, new_only: bool = False) -> int:
    """Unlinks the directory's segment files (with ``new_only``, only segments a dead process
    was creating: those no one holds locked)."""
    removed = 0
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        if NEW_RE.match(name):
            try:
                fd = open_owned(path, os.O_RDONLY)
            except OSError:
                continue                               # not ours (never touched) or gone
            try:
                if not try_lock_exclusive(fd):
                    continue                           # its creator is alive and about to rename it
            finally:
                os.close(fd)
        elif new_only or not SEG_RE.match(name):
            continue
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    if not new_only:
        removed += remove_old_layout(directory)
    return removed

