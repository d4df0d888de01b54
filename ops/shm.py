"""POSIX shared-memory segments without ``multiprocessing.resource_tracker``.

``multiprocessing.shared_memory`` registers every segment it opens with the
resource tracker, which unlinks it when *any* attaching process exits: the
engine's caches and signals would vanish when a CTM dies.  Here only the
creator's explicit ``unlink()`` removes a name.

Clean-up goes by identity, never by name alone: a segment knows the file it opened
(``identity``, device and inode), ``unlink_if_same`` removes a name only while it is still
that file, and every process lists what it creates in its creator record (``shm_ledger``), so
``sweep_orphans`` removes what a process killed outright left, once that process is provably gone,
and a create under a name such a process left removes that one file first (an engine restarted on
its port while the dead engine's CTMs linger).

A mapping holds no descriptor: the file is mapped with mmap(2) directly and closed at once.
Python's ``mmap.mmap`` keeps a dup() of the descriptor for the mapping's whole life (before
3.13's ``trackfd=False``), so an engine of 61 layers at TP 8 held over 1,024 descriptors, past
``select()``'s FD_SETSIZE.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import stat
import weakref
from typing import Iterator

from .shm_ledger import CREATOR_PREFIX, MAX_RECORD_BYTES, CreationLedger, Creator, Identity, parse_record

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

logger = logging.getLogger(__name__)
_LEDGER = CreationLedger(SHM_DIR)  # this process's creator record
MAX_SWEPT_RECORDS = 256  # creator records one sweep reads (the rest wait for the next)


def shm_path(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"shared-memory name {name!r} must be 1-200 characters of [A-Za-z0-9._-]")
    return os.path.join(SHM_DIR, name)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _munmap(address: int, size: int, munmap=_libc.munmap, log=logger) -> None:
    """Unmap (bound at import: a mapping may outlive this module's globals at interpreter exit)."""
    if munmap(address, size) != 0:
        log.error("munmap(%#x, %d) failed: errno %d", address, size, ctypes.get_errno())


@functools.lru_cache(maxsize=64)
def _mapping_type(size: int) -> type:
    """A ctypes byte array of ``size`` over a mapping, which unmaps it when the last reference goes:
    the segment's, or a numpy array's or tensor's through the buffer protocol."""
    unmap, addressof = _munmap, ctypes.addressof

    def __del__(self: ctypes.Array) -> None:
        unmap(addressof(self), size)

    return type(f"_Mapping{size}", (ctypes.c_ubyte * size,), {"__del__": __del__, "__slots__": ()})


def map_shared(fd: int, size: int, populate: bool = True) -> ctypes.Array:
    """``size`` bytes of ``fd`` mapped shared, read-write (``MAP_POPULATE`` with ``populate``), as a ctypes
    byte array that owns the mapping and keeps no descriptor: ``fd`` may be closed at once.  ``OSError``
    with mmap(2)'s errno when it fails."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    try:
        return _mapping_type(size).from_address(address)
    except BaseException:
        _munmap(address, size)
        raise


class SharedMemorySegment:
    """A named, mapped shared-memory segment.

    ``create=True`` makes a new segment of ``size`` bytes, zero-filled, mode 0600; a name held
    by what a provably gone process of ours left is removed first (``_remove_orphan``), anything
    else under the name raises ``FileExistsError``.  ``create=False`` attaches to an existing one.
    ``populate`` maps every page now, as device memory is committed at allocation:
    copies then never pay first-touch page faults.  The mapping keeps no descriptor open
    (``map_shared``); ``buf`` is a writable byte ``memoryview`` of it.
    """

    def __init__(self, name: str, size: int = 0, create: bool = False, populate: bool = True):
        self.name = name
        self.path = shm_path(name)
        self.created = create
        if create:
            if size <= 0:
                raise ValueError(f"shared-memory segment {name!r}: size {size} must be positive")
            fd = _create_exclusive(name, self.path)
            try:
                os.ftruncate(fd, size)
                info = os.fstat(fd)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
            _LEDGER.created(name, (info.st_dev, info.st_ino))
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            info = os.fstat(fd)
            size = info.st_size
            if info.st_uid != os.getuid():
                # Another user's segment under our name would feed (or read) the KV cache.
                os.close(fd)
                raise PermissionError(f"shared-memory segment {name!r} is owned by uid {info.st_uid}, "
                                      f"not by this process's uid {os.getuid()}: refusing to attach")
            if size == 0:
                os.close(fd)
                raise ValueError(f"shared-memory segment {name!r} is empty (its creator has not sized it yet)")
        try:
            mapping = map_shared(fd, size, populate)
        finally:
            os.close(fd)
        self._buf: memoryview | None = memoryview(mapping).cast("B")
        self.size = size
        self.identity: Identity = (info.st_dev, info.st_ino)  # the file opened, whatever the name holds later

    @property
    def buf(self) -> memoryview:
        """The mapped bytes, writable (``np.frombuffer(segment.buf, ...)``, ``segment.buf[:n] = data``)."""
        if self._buf is None:
            raise ValueError(f"shared-memory segment {self.name!r} is closed")
        return self._buf

    def close(self) -> None:
        """Unmap, unless arrays or tensors still view it: then the mapping goes with the last of them."""
        if self._buf is None:
            return
        mapping = weakref.ref(self._buf.obj)
        try:
            self._buf.release()  # ``buf`` itself is unusable from here on; views made from it are not
        except BufferError:  # a memoryview(buf) is still held
            pass
        self._buf = None
        if mapping() is not None:
            logger.debug("segment %s still has live views; it is unmapped when they are released", self.name)

    def unlink(self) -> None:
        """Remove the name (creator only); existing mappings stay valid."""
        self.unlink_name(self.name)

    @staticmethod
    def unlink_name(name: str) -> bool:
        """Unlink ``name`` if it is ours (see ``owned_by_us``); True if it was removed."""
        return _unlink_ours(shm_path(name))

    def __enter__(self) -> "SharedMemorySegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedMemorySegment({self.name!r}, size={self.size}, created={self.created})"


def _create_exclusive(name: str, path: str) -> int:
    """A new file under ``name`` (``O_EXCL``, 0600).  A name still held by what a provably gone process of
    ours created and left (an engine killed and restarted on its port while its CTMs linger, say) is
    removed first (``_remove_orphan``: by its creator record and identity, only ours); anything else under
    the name (a live process's segment, another user's) raises ``FileExistsError`` naming its owner."""
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        _remove_orphan(name)
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, _exists_message(name, path), path) from None


def _exists_message(name: str, path: str) -> str:
    """Why a create failed, naming the owner: a squatter's name must be told from our own leftover."""
    try:
        owner = f"uid {os.lstat(path).st_uid}"
    except OSError:
        owner = "an unknown uid (gone again)"
    return (f"shared-memory segment {name!r} already exists, owned by {owner} (this process runs as uid "
            f"{os.geteuid()}): left by another engine, or created by another user; refusing to use it")


def list_segments(prefix: str) -> list[str]:
    """Names in /dev/shm that start with ``prefix`` (for leak checks and clean-up)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def owned_by_us(path: str) -> bool:
    """True if ``path`` is a regular file (not a symlink) owned by this process's effective uid.

    Names without an engine token (``cache_manager.ipc_signal``) are predictable, so another user
    may have created one under our prefix (to stop the engine from starting, say); removing it
    would destroy that user's data, which root can do.  The check holds until the unlink: /dev/shm is sticky, so only a name's owner (or root)
    can remove or replace it, and the name stays ours in between."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
        return True
    logger.warning("leaving %s: not a regular file of uid %d (mode %o, uid %d)", path, os.geteuid(),
                   info.st_mode, info.st_uid)
    return False


def _unlink_ours(path: str) -> bool:
    if not owned_by_us(path):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    _LEDGER.removed(os.path.basename(path))
    return True


def unlink_segments(prefix: str) -> list[str]:
    """Unlink every segment of ours (``owned_by_us``) whose name starts with ``prefix``; the names removed."""
    return [name for name in list_segments(prefix) if _unlink_ours(os.path.join(SHM_DIR, name))]


def segment_identity(name: str) -> Identity | None:
    """(device, inode) of the file now under ``name`` in /dev/shm (not following a symlink); None if none."""
    try:
        info = os.lstat(shm_path(name))
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def unlink_if_same(name: str, identity: Identity) -> bool:
    """Unlink ``name`` if it is ours (``owned_by_us``) and still the file ``identity`` names: a segment
    made later under the same name (an engine restarted on its port) stays.  True if it was removed."""
    if segment_identity(name) != identity:
        return False
    return _unlink_ours(shm_path(name))


def _read_record(path: str) -> tuple[Identity, str] | None:
    """The identity and text of a creator record that is a regular file of ours; None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            logger.debug("leaving %s: not a regular file of uid %d (another user's, or not a record)", path,
                         os.geteuid())
            return None
        return (info.st_dev, info.st_ino), os.read(fd, MAX_RECORD_BYTES).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


GoneRecord = tuple[str, Identity, Creator, list[tuple[str, Identity]]]


def _gone_records(limit: int = MAX_SWEPT_RECORDS) -> Iterator[GoneRecord]:
    """(path, identity, creator, listed segments) of each creator record of ours, at most ``limit`` read,
    whose process is provably gone (``Creator.gone``); one of another pid namespace is never."""
    me = Creator.this_process()
    for record in list_segments(CREATOR_PREFIX)[:limit]:
        path = os.path.join(SHM_DIR, record)
        read = _read_record(path)
        parsed = parse_record(read[1]) if read is not None else None
        if parsed is None:
            continue
        creator, entries = parsed
        verdict = creator.gone(me)
        if verdict:
            yield path, read[0], creator, entries
        elif verdict is None:
            logger.debug("leaving %s: process %d is in another pid namespace", record, creator.pid)


def sweep_orphans(limit: int = MAX_SWEPT_RECORDS) -> list[str]:
    """Remove what processes that are provably gone created here and left (a whole engine instance
    SIGKILLed with its CTMs, say); the names removed.

    Reads the creator records (``shm_ledger``) of our uid, at most ``limit`` of them; for each whose
    process is gone (its pid free, a zombie, or held by a later process; another boot) unlinks every
    listed name that is still the file it created and a regular file of ours, then the record.  A live
    process's names, another uid's, symlinks and names that were replaced since are never touched; so is
    anything of a process in another pid namespace, which cannot be told from here."""
    removed: list[str] = []
    gone = 0
    for path, identity, _, entries in _gone_records(limit):
        gone += 1
        removed += [name for name, listed in entries if unlink_if_same(name, listed)]
        if segment_identity(os.path.basename(path)) == identity:
            _unlink_ours(path)
    if removed:
        logger.warning("swept %d segments left by %d processes that are gone: %s%s", len(removed), gone,
                       removed[:8], " ..." if len(removed) > 8 else "")
    return removed


def _remove_orphan(name: str) -> bool:
    """Unlink ``name`` if the file it holds is what a provably gone process of ours created and left (its
    creator record lists it, by identity); True if it was removed.  Nothing else is touched."""
    held = segment_identity(name)
    if held is None:
        return False
    for _, _, creator, entries in _gone_records():
        if (name, held) in entries:
            if unlink_if_same(name, held):
                logger.warning("%s was left by process %d, which is gone: removed, to be created anew", name,
                               creator.pid)
                return True
            return False
    return False
