"""The FileStore's on-disk format, options and low-level file I/O (file_store.py has the layout).

Kept apart from the store's logic (index, eviction, batches) so each stays readable: this
module knows bytes, headers, modes and free space; it knows nothing about keys' meaning.

On-disk format of one ``.kv`` file (all integers little-endian, 56-byte header, then the payload)::

    offset size field
    0      4    magic            b"CTKV"
    4      2    version          1
    6      2    flags            0 (anything else is refused)
    8      8    payload_len      bytes of payload that follow the header
    16     4    payload_crc32    zlib.crc32 of the payload
    20     32   key_sha256       SHA-256 of the key: a file never answers for another key
    52     4    header_crc32     zlib.crc32 of bytes 0..51: any flipped header byte is caught
    56     n    payload          the object; for multi-buffer objects the buffers concatenated in order

A file is valid only when magic, version, flags, header checksum and key digest match, its size is
exactly ``56 + payload_len`` (neither truncated nor extended) and the payload checksum matches.
Anything else is ``CORRUPT`` for that key: a warning is logged, the file is deleted and no bytes are
reported as read.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import re
import secrets
import struct
import time
import zlib
from typing import Any, Mapping, NamedTuple

from ops.procs import pid_alive

from .kvcache_storage import StorageConfigError, parse_bool

logger = logging.getLogger(__name__)

MAGIC = b"CTKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHQI32s")          # everything the header checksum covers
_HEADER = struct.Struct("<4sHHQI32sI")
HEADER_SIZE = _HEADER.size                     # 56
assert HEADER_SIZE == _PREFIX.size + 4

# Prompt-derived KV must not be readable by other local users (DESIGN §4), whatever the umask.
FILE_MODE = 0o600
DIR_MODE = 0o700

_IOV_MAX = 512                                  # well under every platform's IOV_MAX
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Errors that mean "the filesystem (or the user's quota) is full", as opposed to a broken disk.
FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
ENV_ROOT = "CTM_FILE_STORE_ROOT"
FASTDEPLOY_ENV_ROOT = "FILE_BACKEND_STORAGE_DIR"  # FastDeploy's file backend reads its root here
ENV_CAPACITY = "CTM_FILE_STORE_CAPACITY"
DEFAULT_ROOT = "~/.cache/cache-transfer-manager/kv"
DEFAULT_CAPACITY = 64 << 30
OPTIONS = ("root", "capacity_bytes", "fsync")
TMP_MAX_AGE_S = 3600.0                          # a temp file this old is stale even if its pid is alive
OBJ_SUFFIX = ".kv"
OBJ_RE = re.compile(r"^[0-9a-f]{64}\.kv$")
TMP_RE = re.compile(r"^([0-9a-f]{64})\.kv\.tmp\.(-?\d+)\.[0-9a-f]+$")
FANOUT_RE = re.compile(r"^[0-9a-f]{2}$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class Corrupt(Exception):
    """An object file failed one of its checks (the message says which)."""


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def raw_view(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of raw memory at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def valid_ptr(ptr: Any) -> bool:
    return isinstance(ptr, int) and not isinstance(ptr, bool) and ptr > 0


def valid_size(size: Any) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


def pack_header(payload_len: int, crc: int, digest: bytes) -> bytes:
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, payload_len, crc, digest)
    return prefix + struct.pack("<I", zlib.crc32(prefix))


def check_header(raw: bytes, digest: bytes, file_size: int) -> tuple[int, int]:
    """Validates a header against the key and the file size; returns (payload_len, payload_crc32)."""
    if len(raw) < HEADER_SIZE:
        raise Corrupt(f"file of {file_size} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, payload_len, crc, file_digest, header_crc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise Corrupt(f"bad magic {magic!r}")
    if zlib.crc32(raw[:_PREFIX.size]) != header_crc:
        raise Corrupt("header checksum mismatch")
    if version != FORMAT_VERSION or flags != 0:
        raise Corrupt(f"unsupported format version {version} flags {flags:#x}")
    if file_digest != digest:
        raise Corrupt("file belongs to another key")
    if file_size != HEADER_SIZE + payload_len:
        raise Corrupt(f"file is {file_size} bytes, header says {HEADER_SIZE + payload_len}")
    return payload_len, crc


def write_all(fd: int, bufs: list[memoryview]) -> None:
    """Writes every buffer in order, resuming after short writes."""
    bufs = [b for b in bufs if b.nbytes]
    i = 0
    while i < len(bufs):
        n = os.writev(fd, bufs[i:i + _IOV_MAX])
        if n <= 0:
            # A regular file that accepts no byte is full; retrying would spin forever.
            raise OSError(errno.ENOSPC, "write accepted no bytes")
        while n > 0:
            if n >= bufs[i].nbytes:
                n -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


def read_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fills the buffers in order from ``offset``; returns the bytes read (short only at EOF)."""
    bufs = [b for b in bufs if b.nbytes]
    i = total = 0
    while i < len(bufs):
        n = os.preadv(fd, bufs[i:i + _IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while n > 0:
            if n >= bufs[i].nbytes:
                n -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0
    return total


def create_private(path: str) -> int:
    """Creates ``path`` exclusively for writing, mode 0600 whatever the umask; returns the fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)                    # a umask can only have removed bits; put back exactly 0600
    except BaseException:
        os.close(fd)
        raise
    return fd


def makedirs_private(path: str) -> list[str]:
    """Creates ``path`` and its missing parents, each one this call creates mode 0700 whatever the
    umask; directories that already exist are left as they are.  Returns the directories created."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue                                # another rank or thread made it meanwhile
        os.chmod(d, DIR_MODE)                       # mkdir's mode is filtered by the umask
        created.append(d)
    return created


def tighten(path: str, st: os.stat_result, mode: int) -> bool:
    """Drops group/other bits from a file or directory this user owns (one left by an older
    version or another umask); True when it changed something."""
    if st.st_uid != os.geteuid() or (st.st_mode & 0o7777) == mode:
        return False
    try:
        os.chmod(path, mode)
        return True
    except OSError:
        return False


class Space(NamedTuple):
    free: int          # bytes an unprivileged writer may still allocate
    block: int         # allocation unit: a file of n bytes takes ceil(n / block) blocks
    inodes_left: bool  # False when the filesystem ran out of inodes rather than blocks


def fs_space(path: str) -> Space | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    block = st.f_frsize or st.f_bsize or 4096
    # f_files == 0 means the filesystem does not count inodes at all.
    return Space(st.f_bavail * block, block, st.f_files == 0 or st.f_favail > 0)


def on_disk(size: int, block: int) -> int:
    return -(-size // block) * block


def parse_capacity(value: Any, source: str) -> int:
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", value, re.IGNORECASE)
        if not m:
            raise StorageConfigError(f"file store option capacity_bytes ({source}) {value!r} is not a byte count "
                                     f"(an integer, optionally with a K/M/G/T suffix)")
        value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if not isinstance(value, int) or isinstance(value, bool):
        raise StorageConfigError(f"file store option capacity_bytes ({source}) {value!r} must be an integer")
    if value <= 0:
        raise StorageConfigError(f"file store option capacity_bytes ({source}) {value} must be positive")
    return value


def resolve_options(options: Mapping[str, Any]) -> tuple[str, str, int, bool]:
    """(root, where the root came from, capacity_bytes, fsync) from the options, then the
    environment, then the defaults; a bad value raises ``StorageConfigError`` naming it."""
    if "root" in options:
        root, root_source = options["root"], "option root"
    elif os.environ.get(ENV_ROOT):
        root, root_source = os.environ[ENV_ROOT], f"${ENV_ROOT}"
    elif os.environ.get(FASTDEPLOY_ENV_ROOT):
        root, root_source = os.environ[FASTDEPLOY_ENV_ROOT], f"${FASTDEPLOY_ENV_ROOT}"
    else:
        root, root_source = DEFAULT_ROOT, "default root"
    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        raise StorageConfigError(f"file store option root ({root_source}) {root!r} must be a non-empty path")
    if "capacity_bytes" in options:
        capacity = parse_capacity(options["capacity_bytes"], "option")
    elif os.environ.get(ENV_CAPACITY):
        capacity = parse_capacity(os.environ[ENV_CAPACITY], f"${ENV_CAPACITY}")
    else:
        capacity = DEFAULT_CAPACITY
    fsync = parse_bool("file store option fsync", options.get("fsync", True))
    return os.path.expanduser(os.fspath(root)), root_source, capacity, fsync


def write_object(path: str, key: str, ptrs: list[int], sizes: list[int], payload_len: int,
                 fsync: bool) -> OSError | None:
    """Writes one object atomically (a private temp file, fsync, rename over ``path``); None on
    success, else the error, with nothing of this attempt left on disk."""
    views = [raw_view(ptr, size) for ptr, size in zip(ptrs, sizes) if size]
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    header = pack_header(payload_len, crc, key_digest(key))
    tmp = ""
    fd = -1
    try:
        for attempt in range(4):
            name = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                fd = create_private(name)
                tmp = name                              # only now ours to remove
                break
            except FileNotFoundError:                   # fan-out directory not there (yet)
                if attempt == 3:
                    raise
                makedirs_private(os.path.dirname(path))
            except FileExistsError:                     # a 32-bit random name collided: draw again
                if attempt == 3:
                    raise
        write_all(fd, [memoryview(header), *views])
        if fsync:
            os.fsync(fd)                                # a full disk may only show here (NFS, delayed allocation)
        closing, fd = fd, -1                            # the fd is gone even if close fails: never close it twice
        os.close(closing)
        os.rename(tmp, path)
        return None
    except OSError as exc:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return exc


class Scan(NamedTuple):
    found: list[tuple[int, str, int]]   # (mtime_ns, stem, size) of each object file, oldest first
    removed_tmp: int                    # temp files of dead writers, or too old, removed
    removed_bad: int                    # object files too short to hold a header, removed
    tightened: int                      # files and fan-out directories made private


def scan_directory(directory: str) -> Scan:
    """Lists a rank directory's objects, removing crash leftovers and garbage on the way."""
    found: list[tuple[int, str, int]] = []
    removed_tmp = removed_bad = tightened = 0
    now = time.time()
    with os.scandir(directory) as top:
        subdirs = [e for e in top if FANOUT_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
    for sub_entry in subdirs:
        sub = sub_entry.path
        try:
            tightened += tighten(sub, sub_entry.stat(follow_symlinks=False), DIR_MODE)
            entries = list(os.scandir(sub))
        except OSError:
            continue
        for entry in entries:
            try:
                if OBJ_RE.match(entry.name) and entry.name[:2] == os.path.basename(sub):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size < HEADER_SIZE:        # cannot even hold a header: garbage
                        os.unlink(entry.path)
                        removed_bad += 1
                    else:
                        # Files an older version wrote 0644 hold prompt-derived KV too.
                        tightened += tighten(entry.path, st, FILE_MODE)
                        found.append((st.st_mtime_ns, entry.name[:-len(OBJ_SUFFIX)], st.st_size))
                    continue
                m = TMP_RE.match(entry.name)
                if m:
                    st = entry.stat(follow_symlinks=False)
                    if not pid_alive(int(m.group(2))) or now - st.st_mtime > TMP_MAX_AGE_S:
                        os.unlink(entry.path)
                        removed_tmp += 1
                    continue
                logger.debug("file store %s: ignoring unexpected file %s", directory, entry.path)
            except FileNotFoundError:
                continue                                # removed by another process meanwhile
    found.sort()
    return Scan(found, removed_tmp, removed_bad, tightened)
