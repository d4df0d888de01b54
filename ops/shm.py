"""POSIX shared-memory segments without ``multiprocessing.resource_tracker``.

``multiprocessing.shared_memory`` registers every segment it opens with the
resource tracker, which unlinks it when *any* attaching process exits: the
engine's caches and signals would vanish when a CTM dies.  Here only the
creator's explicit ``unlink()`` removes a name.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import stat

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

logger = logging.getLogger(__name__)


def shm_path(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"shared-memory name {name!r} must be 1-200 characters of [A-Za-z0-9._-]")
    return os.path.join(SHM_DIR, name)


class SharedMemorySegment:
    """A named, mapped shared-memory segment.

    ``create=True`` makes a new segment (fails if the name exists) of ``size`` bytes,
    zero-filled, mode 0600.  ``create=False`` attaches to an existing one.
    ``populate`` maps every page now, as device memory is committed at allocation:
    copies then never pay first-touch page faults.
    """

    def __init__(self, name: str, size: int = 0, create: bool = False, populate: bool = True):
        self.name = name
        self.path = shm_path(name)
        self.created = create
        if create:
            if size <= 0:
                raise ValueError(f"shared-memory segment {name!r}: size {size} must be positive")
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                raise FileExistsError(errno.EEXIST, _exists_message(name, self.path), self.path) from None
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
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
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self.size = size

    @property
    def buf(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"shared-memory segment {self.name!r} is closed")
        return self._mmap

    def close(self) -> None:
        """Unmap, unless tensors still view it: then the mapping goes with the last of them."""
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError:
            logger.debug("segment %s still has live views; it is unmapped when they are released", self.name)
        self._mmap = None

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
        return True
    except FileNotFoundError:
        return False


def unlink_segments(prefix: str) -> list[str]:
    """Unlink every segment of ours (``owned_by_us``) whose name starts with ``prefix``; the names removed."""
    return [name for name in list_segments(prefix) if _unlink_ours(os.path.join(SHM_DIR, name))]
