"""The FileStore's options, file modes and low-level I/O (no format, no index).

Kept apart from the segment format (segments.py) and the store's logic (store.py,
space.py) so each stays readable: this module knows options, modes, free space and how to
move many buffers with few system calls; it knows nothing about records or keys.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
from typing import Any, Mapping, NamedTuple

from transfer_factory.file import _records
from transfer_factory.kvcache_storage import StorageConfigError, parse_bool

# Prompt-derived KV must not be readable by other local users (DESIGN §4), whatever the umask.
FILE_MODE = 0o600
DIR_MODE = 0o700

IOV_MAX = 1024                                  # Linux's IOV_MAX: the most buffers one preadv/pwritev takes
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# Errors that mean "the filesystem (or the user's quota) is full", as opposed to a broken disk.
FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
ENV_ROOT = "CTM_FILE_STORE_ROOT"
FASTDEPLOY_ENV_ROOT = "FILE_BACKEND_STORAGE_DIR"  # FastDeploy's file backend reads its root here
ENV_CAPACITY = "CTM_FILE_STORE_CAPACITY"
DEFAULT_ROOT = "~/.cache/cache-transfer-manager/kv"
DEFAULT_CAPACITY = 64 << 30
OPTIONS = ("root", "capacity_bytes", "fsync", "read_piece_bytes")
# A staged read is read and scattered in pieces of this size, each while still in the CPU cache
# (StorageMover); two ranks' pieces fit a shared L3 many times over.
DEFAULT_READ_PIECE_BYTES = 4 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def raw_view(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of raw memory at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


class Views:
    """``raw_view`` remembered per (pointer, size): callers hand the same staging buffers over and
    over.  A view owns nothing; it is used only while its caller passes that pointer again."""

    def __init__(self, limit: int = 1 << 14) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}
        self._limit = limit

    def __call__(self, ptr: int, size: int) -> memoryview:
        key = (ptr, size)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= self._limit:
                self._views.clear()
            v = self._views[key] = raw_view(ptr, size)
        return v


def address_of(buf: bytearray) -> int:
    """The address of a bytearray's bytes (valid while it lives and is not resized)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def valid_ptr(ptr: Any) -> bool:
    return isinstance(ptr, int) and not isinstance(ptr, bool) and ptr > 0


def valid_size(size: Any) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


def buffers_length(ptrs: Any, sizes: Any, multi: bool) -> int:
    """An object's room (a read) or payload length (a write) from its buffers (with ``multi`` lists
    of them, else one pointer and one size): -1 when they are not valid pointers and sizes."""
    if not multi:
        if type(ptrs) is int and ptrs > 0 and type(sizes) is int and sizes >= 0:
            return sizes
        return -1
    if (not ptrs or len(ptrs) != len(sizes) or not all(map(valid_ptr, ptrs)) or not all(map(valid_size, sizes))):
        return -1
    return sum(sizes)


def _advance(bufs: list, i: int, n: int) -> int:
    """Consumes ``n`` bytes of ``bufs`` from index ``i`` (trimming a partly done buffer in place);
    returns the index of the first buffer not done."""
    while n > 0:
        size = len(bufs[i])
        if n >= size:
            n -= size
            i += 1
        else:
            bufs[i] = memoryview(bufs[i])[n:]
            n = 0
    return i


def write_records(fd: int, offset: int, headers: bytes, ptrs: list[int], sizes: list[int],
                  counts: list[int] | None = None) -> int:
    """Writes a run of records at ``offset``: header i (56 bytes of ``headers``), then record i's
    buffers (``counts[i]`` of them, or one each), for every record, with as few pwritev calls as
    IOV_MAX allows and the GIL let go; resumes after short writes, raises OSError (ENOSPC for a
    write that accepts no bytes).  Returns the bytes written."""
    return _records.write_records(fd, offset, headers, ptrs, sizes, counts)


def read_records(fd: int, offset: int, headers: bytearray | memoryview, ptrs: list[int], sizes: list[int],
                 counts: list[int] | None = None) -> int:
    """The read ``write_records`` mirrors: headers into ``headers``, payloads into the buffers;
    returns the bytes read (short only at the end of the file)."""
    return _records.read_records(fd, offset, headers, ptrs, sizes, counts)


def read_all_at(fd: int, bufs: list, offset: int) -> int:
    """Fills the buffers in order from ``offset`` with as few preadv calls as IOV_MAX allows;
    returns the bytes read (short only at the end of the file)."""
    bufs = [b for b in bufs if len(b)]
    i = total = 0
    while i < len(bufs):
        n = os.preadv(fd, bufs[i:i + IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        i = _advance(bufs, i, n)
    return total


class Untrusted(OSError):
    """A path the store refuses to use (DESIGN §4): a symlink, something that is not a regular file
    (or directory), or one another user owns.  Never read, never chmod-ed."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EPERM, why, path)
        self.why = why


def _owner_problem(st: os.stat_result, root_ok: bool = False) -> str | None:
    uid = os.geteuid()
    if st.st_uid == uid or (root_ok and st.st_uid == 0):
        return None
    return f"owned by uid {st.st_uid}, not by this process (uid {uid})"


def open_owned(path: str, flags: int) -> int:
    """Opens ``path`` only when it is a regular file this user owns: never through a symlink
    (O_NOFOLLOW), never waiting on a FIFO (opened O_NONBLOCK, cleared for a regular file).  Raises
    ``Untrusted`` for anything else (nothing is read from it), OSError when it cannot be opened."""
    try:
        fd = os.open(path, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted(path, "a symlink") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):
            raise Untrusted(path, "not a regular file") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise Untrusted(path, f"not accessible ({exc.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else _owner_problem(st)
        if why:
            raise Untrusted(path, why)
        if not flags & O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: str) -> int:
    """Creates ``path`` exclusively for reading and writing, mode 0600 whatever the umask; the fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)                    # a umask can only have removed bits; put back exactly 0600
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: str) -> None:
    """Makes a directory's entries (a file just created or removed) durable."""
    fd = os.open(path, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chmod_dir(path: str, mode: int, st: os.stat_result | None = None) -> bool:
    """Sets a directory's mode through its fd (never through a symlink), only when it is still the
    directory ``st`` describes (when given) and this user's; True when it changed something."""
    fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    try:
        fst = os.fstat(fd)
        if (st is not None and (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino)) or _owner_problem(fst):
            return False
        if (fst.st_mode & 0o7777) == mode:
            return False
        os.fchmod(fd, mode)
        return True
    finally:
        os.close(fd)


def makedirs_private(path: str) -> list[str]:
    """Creates ``path`` and its missing parents, each one this call creates mode 0700 whatever the
    umask; directories that already exist are left as they are (``own_directory`` checks the
    store's).  Returns the directories created."""
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
        _chmod_dir(d, DIR_MODE)                     # mkdir's mode is filtered by the umask
        created.append(d)
    return created


def own_directory(path: str, mode: int | None = DIR_MODE, root_ok: bool = False) -> bool:
    """Refuses (``Untrusted``) ``path`` unless it is a directory, not a symlink, owned by this user
    (or, with ``root_ok``, by root, who can read everything anyway); with ``mode``, sets that mode
    (through the directory's fd) when it has another one.  True when it changed the mode."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(path, "a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(path, "not a directory")
    why = _owner_problem(st, root_ok)
    if why:
        raise Untrusted(path, why)
    if mode is None or (st.st_mode & 0o7777) == mode:
        return False
    return _chmod_dir(path, mode, st)


def tighten(fd: int, mode: int) -> bool:
    """Drops group/other bits from an open file this user owns (one left by an older version or
    another umask), through its fd, never by path; True when it changed something."""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or (st.st_mode & 0o7777) == mode:
            return False
        os.fchmod(fd, mode)
        return True
    except OSError:
        return False


class Space(NamedTuple):
    free: int          # bytes an unprivileged writer may still allocate
    block: int         # allocation unit: a file of n bytes takes ceil(n / block) blocks
    inodes_left: bool  # False when the filesystem ran out of inodes rather than blocks
    total: int         # the filesystem's size in bytes


def fs_space(path: str) -> Space | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    block = st.f_frsize or st.f_bsize or 4096
    # f_files == 0 means the filesystem does not count inodes at all.
    return Space(st.f_bavail * block, block, st.f_files == 0 or st.f_favail > 0, st.f_blocks * block)


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


def resolve_options(options: Mapping[str, Any]) -> tuple[str, str, int, bool, int]:
    """(root, where the root came from, capacity_bytes, fsync, read_piece_bytes) from the options,
    then the environment, then the defaults; a bad value raises ``StorageConfigError`` naming it."""
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
    piece = options.get("read_piece_bytes", DEFAULT_READ_PIECE_BYTES)
    if not valid_size(piece):
        raise StorageConfigError(f"file store option read_piece_bytes {piece!r} must be a non-negative integer "
                                 f"(0: a staged read is one call per chunk)")
    return os.path.expanduser(os.fspath(root)), root_source, capacity, fsync, piece
