"""FileStore: the embedded default storage backend, one file per object on a local disk.

Layout (DESIGN §3.7, §4)
------------------------
Objects live under ``{root}/{namespace}/rank{rank}/``.  An object's file name is the SHA-256 of its
key (UTF-8, lone surrogates passed through), so any key string is safe; files are fanned out by the
first two hex digits::

    {root}/{namespace}/rank{rank}/{h[0:2]}/{h}.kv                 h = sha256(key).hexdigest()
    {root}/{namespace}/rank{rank}/{h[0:2]}/{h}.kv.tmp.{pid}.{rnd}  a write in flight (or a crash's leftover)

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

Writes are atomic: header and payload go to a temp file in the object's directory, which is
fsynced (option ``fsync``, default on) and then moved over the final name with ``os.rename``, so
readers in any thread or process see either no file or a whole one.  A crash leaves at most a temp file; the
next store opened on the directory removes temp files whose writer process is gone (or that are
older than ``TMP_MAX_AGE_S``).  Even without fsync, a file damaged by a crash fails its checks.
A ``batch_set`` of a key whose file already exists with the expected size is a success that
writes nothing (the object is content-addressed by its key); a file of the wrong size is rewritten.

Capacity: an in-memory LRU index (file name -> file size, header included) is updated on every
set and successful get; a set that would exceed ``capacity_bytes`` first evicts the least recently
used files; an object whose file alone exceeds the capacity is ``NO_SPACE``.  On open the index is
rebuilt from the directory ordered by mtime, and successful reads touch the file's mtime, so the
LRU order survives restarts.  The accounting is per store instance: one CTM process per rank owns
one directory, so it is exact in the normal deployment; other processes sharing the directory are
safe (they only ever see whole files, or none) but their files count once this store sees them.

Options: ``root`` (default ``$CTM_FILE_STORE_ROOT``, else ``~/.cache/cache-transfer-manager/kv``),
``capacity_bytes`` (default ``$CTM_FILE_STORE_CAPACITY``, else 64 GiB; an int, or a string with an
optional K/M/G/T binary suffix), ``fsync`` (default True).  A bad or unknown option raises
``StorageConfigError`` naming it.  No pickle anywhere: payloads are raw bytes.
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
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

from ops.procs import pid_alive

from .kvcache_storage import (
    BUFFER_TOO_SMALL, CORRUPT, INVALID, NO_SPACE, NOT_FOUND, OK, UNAVAILABLE, KVCacheStorage, StorageAccess,
    StorageConfigError, check_batch,
)

logger = logging.getLogger(__name__)

MAGIC = b"CTKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHQI32s")          # everything the header checksum covers
_HEADER = struct.Struct("<4sHHQI32sI")
HEADER_SIZE = _HEADER.size                     # 56
assert HEADER_SIZE == _PREFIX.size + 4

ENV_ROOT = "CTM_FILE_STORE_ROOT"
ENV_CAPACITY = "CTM_FILE_STORE_CAPACITY"
DEFAULT_ROOT = "~/.cache/cache-transfer-manager/kv"
DEFAULT_CAPACITY = 64 << 30
TMP_MAX_AGE_S = 3600.0                          # a temp file this old is stale even if its pid is alive
OPTIONS = ("root", "capacity_bytes", "fsync")

_OBJ_SUFFIX = ".kv"
_OBJ_RE = re.compile(r"^[0-9a-f]{64}\.kv$")
_TMP_RE = re.compile(r"^([0-9a-f]{64})\.kv\.tmp\.(-?\d+)\.[0-9a-f]+$")
_FANOUT_RE = re.compile(r"^[0-9a-f]{2}$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_IOV_MAX = 512                                  # well under every platform's IOV_MAX
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _Corrupt(Exception):
    """An object file failed one of its checks (the message says which)."""


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _view(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of raw memory at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _valid_ptr(ptr: Any) -> bool:
    return isinstance(ptr, int) and not isinstance(ptr, bool) and ptr > 0


def _valid_size(size: Any) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


def _pack_header(payload_len: int, crc: int, digest: bytes) -> bytes:
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, payload_len, crc, digest)
    return prefix + struct.pack("<I", zlib.crc32(prefix))


def _check_header(raw: bytes, digest: bytes, file_size: int) -> tuple[int, int]:
    """Validates a header against the key and the file size; returns (payload_len, payload_crc32)."""
    if len(raw) < HEADER_SIZE:
        raise _Corrupt(f"file of {file_size} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, payload_len, crc, file_digest, header_crc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise _Corrupt(f"bad magic {magic!r}")
    if zlib.crc32(raw[:_PREFIX.size]) != header_crc:
        raise _Corrupt("header checksum mismatch")
    if version != FORMAT_VERSION or flags != 0:
        raise _Corrupt(f"unsupported format version {version} flags {flags:#x}")
    if file_digest != digest:
        raise _Corrupt("file belongs to another key")
    if file_size != HEADER_SIZE + payload_len:
        raise _Corrupt(f"file is {file_size} bytes, header says {HEADER_SIZE + payload_len}")
    return payload_len, crc


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """Writes every buffer in order, resuming after short writes."""
    bufs = [b for b in bufs if b.nbytes]
    i = 0
    while i < len(bufs):
        n = os.writev(fd, bufs[i:i + _IOV_MAX])
        while n > 0:
            if n >= bufs[i].nbytes:
                n -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


def _read_all(fd: int, bufs: list[memoryview], offset: int) -> int:
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


def _parse_capacity(value: Any, source: str) -> int:
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


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise StorageConfigError(f"file store option {name} {value!r} must be a boolean")


class FileStore(KVCacheStorage):
    """Objects as checksummed files under ``{root}/{namespace}/rank{rank}/`` with LRU eviction."""

    name = "file"
    access = StorageAccess.HOST_STAGED
    supports_multi_buffer = True

    def __init__(self, namespace: str, rank: int, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise StorageConfigError(f"unknown file store option(s) {', '.join(map(repr, unknown))}; "
                                     f"known: {', '.join(OPTIONS)}")
        if (not isinstance(namespace, str) or not namespace or namespace in (".", "..")
                or "/" in namespace or "\\" in namespace or "\x00" in namespace):
            raise StorageConfigError(f"file store namespace {namespace!r} must be a non-empty name without "
                                     f"path separators")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise StorageConfigError(f"file store rank {rank!r} must be a non-negative integer")

        if "root" in options:
            root, root_source = options["root"], "option root"
        elif os.environ.get(ENV_ROOT):
            root, root_source = os.environ[ENV_ROOT], f"${ENV_ROOT}"
        else:
            root, root_source = DEFAULT_ROOT, "default root"
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise StorageConfigError(f"file store option root ({root_source}) {root!r} must be a non-empty path")
        if "capacity_bytes" in options:
            capacity = _parse_capacity(options["capacity_bytes"], "option")
        elif os.environ.get(ENV_CAPACITY):
            capacity = _parse_capacity(os.environ[ENV_CAPACITY], f"${ENV_CAPACITY}")
        else:
            capacity = DEFAULT_CAPACITY
        self.fsync = _parse_bool("fsync", options.get("fsync", True))
        self.capacity_bytes = capacity
        self.namespace = namespace
        self.rank = rank
        self.root = Path(os.path.expanduser(os.fspath(root)))
        self.directory = self.root / namespace / f"rank{rank}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: cannot create "
                                     f"{str(self.directory)!r}: {exc.strerror or exc}") from None
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: "
                                     f"{str(self.directory)!r} is not writable")

        self._dir = str(self.directory)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()   # file stem (sha256 hex) -> file size
        self._used = 0
        self._closed = False
        self._rebuild_index()
        logger.info("file store %s: %d objects, %d of %d bytes used, fsync %s", self.directory, len(self._index),
                    self._used, self.capacity_bytes, self.fsync)

    # ----------------------------------------------------------------------------------- paths, index
    def _stem(self, key: str) -> str:
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _path(self, stem: str) -> str:
        return f"{self._dir}/{stem[:2]}/{stem}{_OBJ_SUFFIX}"

    def object_path(self, key: str) -> Path:
        """Where ``key``'s file lives (whether or not it exists)."""
        return Path(self._path(self._stem(key)))

    @property
    def used_bytes(self) -> int:
        """Bytes of object files (headers included) in the index."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, int]] = []
        removed_tmp = removed_bad = 0
        now = time.time()
        with os.scandir(self.directory) as top:
            subdirs = [e.path for e in top if _FANOUT_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for entry in entries:
                try:
                    if _OBJ_RE.match(entry.name) and entry.name[:2] == os.path.basename(sub):
                        st = entry.stat(follow_symlinks=False)
                        if st.st_size < HEADER_SIZE:        # cannot even hold a header: garbage
                            os.unlink(entry.path)
                            removed_bad += 1
                        else:
                            found.append((st.st_mtime_ns, entry.name[:-len(_OBJ_SUFFIX)], st.st_size))
                        continue
                    m = _TMP_RE.match(entry.name)
                    if m:
                        st = entry.stat(follow_symlinks=False)
                        if not pid_alive(int(m.group(2))) or now - st.st_mtime > TMP_MAX_AGE_S:
                            os.unlink(entry.path)
                            removed_tmp += 1
                        continue
                    logger.debug("file store %s: ignoring unexpected file %s", self.directory, entry.path)
                except FileNotFoundError:
                    continue                                # removed by another process meanwhile
        found.sort()
        with self._lock:
            self._index.clear()
            self._used = 0
            for _, stem, size in found:
                self._index[stem] = size
                self._used += size
            victims = self._evict_locked(0)
        if removed_tmp or removed_bad or victims:
            logger.info("file store %s: removed %d leftover temp files, %d garbage files, evicted %d objects "
                        "over capacity", self.directory, removed_tmp, removed_bad, victims)

    def _evict_locked(self, need: int) -> int:
        """Evicts LRU files until ``need`` more bytes fit; the caller holds the lock."""
        evicted = 0
        while self._index and self._used + need > self.capacity_bytes:
            stem, size = self._index.popitem(last=False)
            self._used -= size
            try:
                os.unlink(self._path(stem))
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("file store %s: cannot evict %s: %s", self.directory, stem, exc)
            evicted += 1
        return evicted

    def _touch(self, stem: str, size: int) -> None:
        with self._lock:
            old = self._index.get(stem)
            if old is None:
                self._index[stem] = size
                self._used += size
            else:
                self._index.move_to_end(stem)
                if old != size:
                    self._index[stem] = size
                    self._used += size - old

    def _forget(self, stem: str) -> None:
        with self._lock:
            size = self._index.pop(stem, None)
            if size is not None:
                self._used -= size

    # ------------------------------------------------------------------------------------ interface
    def register_buffer(self, ptr: int, size: int) -> None:
        """Nothing to register for plain file I/O; refuses nonsense so caller bugs surface here."""
        if not _valid_ptr(ptr):
            raise ValueError(f"register_buffer: pointer {ptr!r} must be a positive integer")
        if not _valid_size(size) or size == 0:
            raise ValueError(f"register_buffer: size {size!r} must be a positive integer")

    def exists(self, keys: Sequence[str]) -> list[int]:
        out = []
        for key in keys:
            if self._closed:
                out.append(UNAVAILABLE)
                continue
            if not isinstance(key, str) or not key:
                out.append(INVALID)
                continue
            try:
                st = os.stat(self._path(self._stem(key)))
                out.append(1 if st.st_size >= HEADER_SIZE else 0)
            except FileNotFoundError:
                out.append(0)
            except OSError:
                out.append(UNAVAILABLE)
        return out

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        return [self._get_one(key, [ptr], [size]) for key, ptr, size in zip(keys, ptrs, sizes)]

    def batch_get_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        check_batch(keys, ptr_lists, size_lists)
        return [self._get_one(key, list(p), list(s)) for key, p, s in zip(keys, ptr_lists, size_lists)]

    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        return [self._set_one(key, [ptr], [size]) for key, ptr, size in zip(keys, ptrs, sizes)]

    def batch_set_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        check_batch(keys, ptr_lists, size_lists)
        return [self._set_one(key, list(p), list(s)) for key, p, s in zip(keys, ptr_lists, size_lists)]

    def delete(self, keys: Sequence[str]) -> list[int]:
        """Per key: 0 removed, ``NOT_FOUND`` when there was nothing to remove."""
        out = []
        for key in keys:
            if self._closed:
                out.append(UNAVAILABLE)
                continue
            if not isinstance(key, str) or not key:
                out.append(INVALID)
                continue
            stem = self._stem(key)
            self._forget(stem)
            try:
                os.unlink(self._path(stem))
                out.append(OK)
            except FileNotFoundError:
                out.append(NOT_FOUND)
            except OSError as exc:
                logger.warning("file store %s: cannot delete %r: %s", self.directory, key, exc)
                out.append(UNAVAILABLE)
        return out

    def clear(self) -> None:
        """Removes every object of this namespace and rank (and temp files no live writer owns)."""
        if self._closed:
            raise RuntimeError("file store is closed")
        removed = 0
        with self._lock:
            self._index.clear()
            self._used = 0
            with os.scandir(self.directory) as top:
                subdirs = [e.path for e in top if _FANOUT_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
            for sub in subdirs:
                try:
                    entries = list(os.scandir(sub))
                except OSError:
                    continue
                for entry in entries:
                    m = _TMP_RE.match(entry.name)
                    if _OBJ_RE.match(entry.name) or (m and not pid_alive(int(m.group(2)))):
                        try:
                            os.unlink(entry.path)
                            removed += 1
                        except FileNotFoundError:
                            pass
        logger.info("file store %s: cleared %d files", self.directory, removed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._index.clear()
            self._used = 0

    # ------------------------------------------------------------------------------------ one object
    def _get_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        if self._closed:
            return UNAVAILABLE
        if (not isinstance(key, str) or not key or not ptrs or len(ptrs) != len(sizes)
                or not all(map(_valid_ptr, ptrs)) or not all(map(_valid_size, sizes))):
            return INVALID
        stem = self._stem(key)
        path = self._path(stem)
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            self._forget(stem)                              # evicted or deleted, maybe by another process
            return NOT_FOUND
        except OSError as exc:
            logger.warning("file store %s: cannot open %r: %s", self.directory, key, exc)
            return UNAVAILABLE
        try:
            st = os.fstat(fd)
            try:
                payload_len, crc = _check_header(os.pread(fd, HEADER_SIZE, 0), _key_digest(key), st.st_size)
                if payload_len > sum(sizes):
                    return BUFFER_TOO_SMALL
                views, left = [], payload_len
                for ptr, size in zip(ptrs, sizes):
                    if left == 0:
                        break
                    n = min(size, left)
                    views.append(_view(ptr, n))
                    left -= n
                if _read_all(fd, list(views), HEADER_SIZE) != payload_len:
                    raise _Corrupt("payload shorter than its header says")
                got = 0
                for v in views:
                    got = zlib.crc32(v, got)
                if got != crc:
                    raise _Corrupt("payload checksum mismatch")
            except _Corrupt as bad:
                self._discard_corrupt(key, stem, path, fd, str(bad))
                return CORRUPT
            try:
                os.utime(fd)                                # LRU order that survives a restart
            except OSError:
                pass
            self._touch(stem, st.st_size)
            return payload_len
        except OSError as exc:
            logger.warning("file store %s: cannot read %r: %s", self.directory, key, exc)
            return UNAVAILABLE
        finally:
            os.close(fd)

    def _discard_corrupt(self, key: str, stem: str, path: str, fd: int, reason: str) -> None:
        logger.warning("file store %s: object %r is corrupt (%s); deleting %s", self.directory, key, reason, path)
        self._forget(stem)
        try:
            # Only delete the file we judged: a writer may have renamed a good one over it meanwhile.
            mine, now = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(path)
        except OSError:
            pass

    def _set_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        if self._closed:
            return UNAVAILABLE
        if (not isinstance(key, str) or not key or not ptrs or len(ptrs) != len(sizes)
                or not all(map(_valid_ptr, ptrs)) or not all(map(_valid_size, sizes))):
            return INVALID
        payload_len = sum(sizes)
        if payload_len == 0:
            return INVALID
        total = HEADER_SIZE + payload_len
        if total > self.capacity_bytes:
            logger.warning("file store %s: object %r of %d bytes exceeds the capacity of %d bytes",
                           self.directory, key, total, self.capacity_bytes)
            return NO_SPACE
        stem = self._stem(key)
        path = self._path(stem)
        try:
            if os.stat(path).st_size == total:              # already stored: a success
                try:
                    os.utime(path)
                except OSError:
                    pass
                self._touch(stem, total)
                return OK
        except FileNotFoundError:
            pass
        except OSError:
            pass                                            # try to write it anyway

        with self._lock:                                    # reserve the space, evicting LRU objects
            old = self._index.pop(stem, None)
            if old is not None:
                self._used -= old
            self._evict_locked(total)
            self._index[stem] = total
            self._used += total

        code = self._write_file(key, stem, path, ptrs, sizes, payload_len)
        if code != OK:
            self._forget(stem)
            try:
                self._touch(stem, os.stat(path).st_size)    # an older copy may still be there
            except OSError:
                pass
        return code

    def _write_file(self, key: str, stem: str, path: str, ptrs: list[int], sizes: list[int],
                    payload_len: int) -> int:
        views = [_view(ptr, size) for ptr, size in zip(ptrs, sizes) if size]
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        header = _pack_header(payload_len, crc, _key_digest(key))
        tmp = ""
        fd = -1
        try:
            for attempt in range(4):
                tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
                    break
                except FileNotFoundError:                   # fan-out directory not there (yet)
                    if attempt == 3:
                        raise
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                except FileExistsError:                     # a 32-bit random name collided: draw again
                    if attempt == 3:
                        raise
            _write_all(fd, [memoryview(header), *views])
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, path)
            return OK
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
            full = exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
            logger.warning("file store %s: cannot write %r (%d bytes): %s", self.directory, key, payload_len, exc)
            return NO_SPACE if full else UNAVAILABLE
