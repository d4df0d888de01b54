"""FileStore: the embedded default storage backend, one file per object on a local disk.

Layout (DESIGN §3.7, §4)
------------------------
Objects live under ``{root}/{namespace}/rank{rank}/``.  An object's file name is the SHA-256 of its
key (UTF-8, lone surrogates passed through), so any key string is safe; files are fanned out by the
first two hex digits::

    {root}/{namespace}/rank{rank}/{h[0:2]}/{h}.kv                 h = sha256(key).hexdigest()
    {root}/{namespace}/rank{rank}/{h[0:2]}/{h}.kv.tmp.{pid}.{rnd}  a write in flight (or a crash's leftover)

The on-disk format of one ``.kv`` file (a 56-byte header checksummed and bound to the key, then
the payload with its CRC) is in file_store_io.py; a file failing any check is ``CORRUPT`` for its
key: logged, deleted, and no bytes reported as read.

Writes are atomic: header and payload go to a temp file in the object's directory, which is
fsynced (option ``fsync``, default on) and then moved over the final name with ``os.rename``, so
readers in any thread or process see either no file or a whole one.  A crash leaves at most a
temp file; the next store opened on the directory removes temp files whose writer process is gone
(or that are older than ``TMP_MAX_AGE_S``).  Even without fsync, a file damaged by a crash fails
its checks.
A ``batch_set`` of a key whose file already exists with the expected size is a success that
writes nothing and keeps the existing object: the key names the content (the same key is the same
prefix's KV), so the first copy stays; a file of the wrong size is rewritten.

Capacity: an in-memory LRU index (file name -> file size, header included) is updated on every
set and successful get; a set that would exceed ``capacity_bytes`` first evicts the least recently
used files; an object whose file alone exceeds the capacity is ``NO_SPACE``.  On open the index is
rebuilt from the directory ordered by mtime, and successful reads touch the file's mtime, so the
LRU order survives restarts.  The accounting is per store instance: one CTM process per rank owns
one directory, so it is exact in the normal deployment; other processes sharing the directory are
safe (they only ever see whole files, or none) but their files count once this store sees them.

Full disks (DESIGN §4): the filesystem may fill before the capacity does (other files, a smaller
disk, a quota).  A write that fails with ENOSPC or EDQUOT, at write, fsync, close or rename, or a
write that accepts no bytes, removes its temp file, evicts LRU objects of this store until the
object should fit (per ``statvfs``; nothing when even an empty cache would not make room) and
retries once; if that fails too the key reports ``NO_SPACE``, quickly and with nothing left
behind.  Nothing about a full disk is remembered: once space frees, the next write succeeds.
Object groups: keys ``{namespace}/{hash}/{rank}/{k|v|k_scale|v_scale}`` of one block are stored
all or none within a batch; when one fails, the others of its block report the same code and
their files are removed, and neither eviction nor the capacity ever removes an object the running
batch stored.  (Before, a K whose V hit a full disk stayed, each retry of the block refreshed it as
"already stored", and eviction only ran against the capacity, never the disk: the disk stayed full
of orphans and every later write failed.)

Modes: object files are 0600 and every directory the store creates is 0700, whatever the umask;
files and the store's own directories left looser by an older version are tightened on open.

Options: ``root`` (default ``$CTM_FILE_STORE_ROOT``, else FastDeploy's ``$FILE_BACKEND_STORAGE_DIR``, else
``~/.cache/cache-transfer-manager/kv``),
``capacity_bytes`` (default ``$CTM_FILE_STORE_CAPACITY``, else 64 GiB; an int, or a string with an
optional K/M/G/T binary suffix), ``fsync`` (default True).  A bad or unknown option raises
``StorageConfigError`` naming it.  No pickle anywhere: payloads are raw bytes.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ops.procs import pid_alive

from .file_store_io import (
    DEFAULT_CAPACITY, DEFAULT_ROOT, DIR_MODE, ENV_CAPACITY, ENV_ROOT, FANOUT_RE, FULL_ERRNOS, HEADER_SIZE, MAGIC,
    O_CLOEXEC, OBJ_RE, OBJ_SUFFIX, OPTIONS, TMP_MAX_AGE_S, TMP_RE, Corrupt, check_header, fs_space, key_digest,
    makedirs_private, on_disk, raw_view, read_all, resolve_options, scan_directory, tighten, valid_ptr, valid_size,
    write_object,
)
from .keys import KINDS
from .kvcache_storage import (
    BUFFER_TOO_SMALL, CODE_NAMES, CORRUPT, INVALID, NO_SPACE, NOT_FOUND, OK, UNAVAILABLE, KVCacheStorage,
    StorageAccess, StorageConfigError, check_batch,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_ROOT", "ENV_CAPACITY", "ENV_ROOT", "FileStore", "HEADER_SIZE", "MAGIC",
           "TMP_MAX_AGE_S"]


def _group_of(key: Any) -> str | None:
    """The object group a key belongs to: ``{namespace}/{hash}/{rank}`` for a block's K, V and scale
    objects (DESIGN §3.7), which are only useful together; None for keys of any other shape."""
    if not isinstance(key, str):
        return None
    head, sep, kind = key.rpartition("/")
    return head if sep and head and kind in KINDS else None


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

        root, root_source, self.capacity_bytes, self.fsync = resolve_options(options)
        self.namespace = namespace
        self.rank = rank
        self.root = Path(root)
        self.directory = self.root / namespace / f"rank{rank}"
        try:
            created = makedirs_private(str(self.directory))
        except OSError as exc:
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: cannot create "
                                     f"{str(self.directory)!r}: {exc.strerror or exc}") from None
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: "
                                     f"{str(self.directory)!r} is not writable")

        if created:
            logger.info("file store: created %s (mode %o)", ", ".join(created), DIR_MODE)
        for own in (self.root / namespace, self.directory):
            # These two are the store's own even when an older version or a looser umask made them.
            try:
                if tighten(str(own), os.stat(own), DIR_MODE):
                    logger.info("file store: %s was readable by others; now mode %o", own, DIR_MODE)
            except OSError:
                pass

        self._dir = str(self.directory)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()   # file stem (sha256 hex) -> file size
        self._used = 0
        # stem -> the stems of its block's objects, for blocks this instance stored or read whole:
        # eviction removes a block at once rather than leave half of it taking space.
        self._siblings: dict[str, tuple[str, ...]] = {}
        self._closed = False
        self._rebuild_index()
        logger.info("file store %s: %d objects, %d of %d bytes used, fsync %s", self.directory, len(self._index),
                    self._used, self.capacity_bytes, self.fsync)

    # ----------------------------------------------------------------------------------- paths, index
    def _stem(self, key: str) -> str:
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _path(self, stem: str) -> str:
        return f"{self._dir}/{stem[:2]}/{stem}{OBJ_SUFFIX}"

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
        found, removed_tmp, removed_bad, tightened = scan_directory(self._dir)
        with self._lock:
            self._index.clear()
            self._siblings.clear()
            self._used = 0
            for _, stem, size in found:
                self._index[stem] = size
                self._used += size
            victims = max(self._evict_locked(0), 0)
        if removed_tmp or removed_bad or victims or tightened:
            logger.info("file store %s: removed %d leftover temp files, %d garbage files, evicted %d objects "
                        "over capacity, made %d files or directories private", self.directory, removed_tmp,
                        removed_bad, victims, tightened)

    def _evict_locked(self, need: int, keep: set[str] | frozenset[str] = frozenset()) -> int:
        """Evicts LRU files until ``need`` more bytes fit under the capacity; the caller holds the lock.

        Files in ``keep`` (what the running batch stored) are never evicted: evicting a block's K to
        make room for its V would leave the block incomplete.  When the capacity cannot be met
        without them nothing is evicted and -1 is returned; otherwise the number of files evicted."""
        if self._used + need <= self.capacity_bytes:
            return 0
        victims, over = [], self._used + need - self.capacity_bytes
        for unit in self._lru_units_locked(keep):
            if over <= 0:
                break
            victims += unit
            over -= sum(self._index[stem] for stem in unit)
        if over > 0:
            return -1
        for stem in victims:
            self._drop_locked(stem)
            self._unlink(stem)
        return len(victims)

    def _lru_units_locked(self, keep: set[str] | frozenset[str]) -> Iterator[list[str]]:
        """What eviction may take, least recently used first: a whole block when its objects are
        known, else one object; never anything of a block the running batch (``keep``) touched."""
        seen: set[str] = set()
        for stem in self._index:
            if stem in seen:
                continue
            unit = [s for s in self._siblings.get(stem, ()) if s in self._index] or [stem]
            seen.update(unit)
            if not keep.isdisjoint(unit):
                continue
            yield unit

    def _drop_locked(self, stem: str) -> None:
        size = self._index.pop(stem, None)
        if size is not None:
            self._used -= size
        self._siblings.pop(stem, None)

    def _note_blocks(self, keys: Sequence[str], done: Sequence[bool]) -> None:
        """Remembers which objects form one block, for blocks whose every object just succeeded."""
        blocks: dict[str, list[str]] = {}
        failed: set[str] = set()
        for key, ok in zip(keys, done):
            group = _group_of(key)
            if group is not None:
                blocks.setdefault(group, []).append(self._stem(key))
                if not ok:
                    failed.add(group)
        with self._lock:
            for group, stems in blocks.items():
                if group not in failed and len(stems) > 1:
                    members = tuple(stems)
                    for stem in members:
                        if stem in self._index:
                            self._siblings[stem] = members

    def _unlink(self, stem: str) -> int:
        """Removes one object file (already out of the index); returns the bytes it held on disk."""
        path = self._path(stem)
        try:
            st = os.stat(path)
            os.unlink(path)
            return st.st_blocks * 512
        except FileNotFoundError:
            return 0
        except OSError as exc:
            logger.warning("file store %s: cannot remove %s: %s", self.directory, stem, exc)
            return 0

    def _make_room(self, total: int, keep: set[str], err: int) -> bool:
        """After a write failed with a full filesystem or quota (``err``): evicts LRU objects, never
        those in ``keep``, until an object of ``total`` bytes should fit.  False, evicting nothing,
        when even that would not be enough (the disk is full of other files): the cache stays."""
        space = fs_space(self._dir)
        block = space.block if space else 4096
        need = on_disk(total, block) + block            # one block of slack for the directory and metadata
        if space is None or err != errno.ENOSPC:
            target = need                               # a quota (EDQUOT) counts our files: free our size
        elif not space.inodes_left:
            target = 1                                  # out of inodes: any file removed frees one
        else:
            target = max(need - space.free, 1)          # at least one: something must change before a retry
        with self._lock:
            victims, expect = [], 0
            for unit in self._lru_units_locked(keep):
                if expect >= target:
                    break
                victims += unit
                expect += sum(on_disk(self._index[stem], block) for stem in unit)
            if expect < target:
                # Debug only: the write's own warning follows, once per key.
                logger.debug("file store %s: filesystem full (%s), and evicting all %d evictable objects "
                             "(%d bytes) would not make room for %d bytes", self.directory, os.strerror(err),
                             len(victims), expect, total)
                return False
            freed = 0
            for stem in victims:
                self._drop_locked(stem)
                freed += self._unlink(stem)
        logger.info("file store %s: filesystem full (%s); evicted %d LRU objects (%d bytes on disk) to make room "
                    "for %d bytes", self.directory, os.strerror(err), len(victims), freed, total)
        return True

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
            self._drop_locked(stem)

    # ------------------------------------------------------------------------------------ interface
    def register_buffer(self, ptr: int, size: int) -> None:
        """Nothing to register for plain file I/O; refuses nonsense so caller bugs surface here."""
        if not valid_ptr(ptr):
            raise ValueError(f"register_buffer: pointer {ptr!r} must be a positive integer")
        if not valid_size(size) or size == 0:
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
        out = [self._get_one(key, [ptr], [size]) for key, ptr, size in zip(keys, ptrs, sizes)]
        self._note_blocks(keys, [code > 0 for code in out])
        return out

    def batch_get_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        check_batch(keys, ptr_lists, size_lists)
        out = [self._get_one(key, list(p), list(s)) for key, p, s in zip(keys, ptr_lists, size_lists)]
        self._note_blocks(keys, [code > 0 for code in out])
        return out

    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        return self._set_batch(keys, [[ptr] for ptr in ptrs], [[size] for size in sizes])

    def batch_set_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        check_batch(keys, ptr_lists, size_lists)
        return self._set_batch(keys, [list(p) for p in ptr_lists], [list(s) for s in size_lists])

    def _set_batch(self, keys: Sequence[str], ptr_lists: list[list[int]], size_lists: list[list[int]]) -> list[int]:
        """Stores each object; a block's objects (one group) are stored all or none.

        The CTM writes a block's K and V (and scales) in one batch and counts the block only when
        every kind is present.  A group with a failed member is useless, so its members this batch
        reported stored are removed and report the failure too, and its later members are not even
        written.  Left in place such an orphan K would be refreshed by every retry of the block
        ("already stored") and so never evicted, while its V kept failing (issue 8)."""
        out: list[int] = []
        stored: set[str] = set()                      # stems this batch stored: never evicted for its later objects
        failed: dict[str, int] = {}                   # group -> the code of its first failed member
        members: dict[str, list[int]] = {}            # group -> indexes of its members reported stored
        for i, (key, ptrs, sizes) in enumerate(zip(keys, ptr_lists, size_lists)):
            group = _group_of(key)
            if group is not None and group in failed:
                out.append(failed[group])
                continue
            code = self._set_one(key, ptrs, sizes, stored)
            out.append(code)
            if code == OK:
                stored.add(self._stem(key))
                if group is not None:
                    members.setdefault(group, []).append(i)
            elif group is not None:
                failed[group] = code
        orphans = [i for group in failed for i in members.get(group, ())]
        if orphans and not self._closed:
            for i in orphans:
                stem = self._stem(keys[i])
                self._forget(stem)
                self._unlink(stem)
                out[i] = failed[_group_of(keys[i])]
            logger.warning("file store %s: %d blocks not stored (%s); removed the %d objects already stored for "
                           "them so no block is left incomplete", self.directory, len(failed),
                           ", ".join(sorted({CODE_NAMES.get(c, str(c)) for c in failed.values()})), len(orphans))
        self._note_blocks(keys, [code == OK for code in out])
        return out

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
            self._siblings.clear()
            self._used = 0
            with os.scandir(self.directory) as top:
                subdirs = [e.path for e in top if FANOUT_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
            for sub in subdirs:
                try:
                    entries = list(os.scandir(sub))
                except OSError:
                    continue
                for entry in entries:
                    m = TMP_RE.match(entry.name)
                    if OBJ_RE.match(entry.name) or (m and not pid_alive(int(m.group(2)))):
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
            self._siblings.clear()
            self._used = 0

    # ------------------------------------------------------------------------------------ one object
    def _get_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        if self._closed:
            return UNAVAILABLE
        if (not isinstance(key, str) or not key or not ptrs or len(ptrs) != len(sizes)
                or not all(map(valid_ptr, ptrs)) or not all(map(valid_size, sizes))):
            return INVALID
        stem = self._stem(key)
        path = self._path(stem)
        try:
            fd = os.open(path, os.O_RDONLY | O_CLOEXEC)
        except FileNotFoundError:
            self._forget(stem)                              # evicted or deleted, maybe by another process
            return NOT_FOUND
        except OSError as exc:
            logger.warning("file store %s: cannot open %r: %s", self.directory, key, exc)
            return UNAVAILABLE
        try:
            st = os.fstat(fd)
            try:
                payload_len, crc = check_header(os.pread(fd, HEADER_SIZE, 0), key_digest(key), st.st_size)
                if payload_len > sum(sizes):
                    return BUFFER_TOO_SMALL
                views, left = [], payload_len
                for ptr, size in zip(ptrs, sizes):
                    if left == 0:
                        break
                    n = min(size, left)
                    views.append(raw_view(ptr, n))
                    left -= n
                if read_all(fd, list(views), HEADER_SIZE) != payload_len:
                    raise Corrupt("payload shorter than its header says")
                got = 0
                for v in views:
                    got = zlib.crc32(v, got)
                if got != crc:
                    raise Corrupt("payload checksum mismatch")
            except Corrupt as bad:
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

    def _set_one(self, key: str, ptrs: list[int], sizes: list[int], keep: set[str]) -> int:
        if self._closed:
            return UNAVAILABLE
        if (not isinstance(key, str) or not key or not ptrs or len(ptrs) != len(sizes)
                or not all(map(valid_ptr, ptrs)) or not all(map(valid_size, sizes))):
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
            # The key names the content (the same key is the same prefix's KV), so a whole file of
            # the expected size is kept as it is: a success that writes nothing.
            if os.stat(path).st_size == total:
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
            fits = self._evict_locked(total, keep) >= 0
            if fits:
                self._index[stem] = total
                self._used += total
            elif old is not None:
                self._index[stem] = old
                self._used += old
        if not fits:
            logger.warning("file store %s: no room for %r (%d bytes): the capacity of %d bytes is held by "
                           "objects of the same batch", self.directory, key, total, self.capacity_bytes)
            return NO_SPACE

        err = write_object(path, key, ptrs, sizes, payload_len, self.fsync)
        if err is not None and err.errno in FULL_ERRNOS and self._make_room(total, keep | {stem}, err.errno):
            err = write_object(path, key, ptrs, sizes, payload_len, self.fsync)     # once: then fail cleanly
        if err is None:
            return OK
        self._forget(stem)
        try:
            self._touch(stem, os.stat(path).st_size)        # an older copy may still be there
        except OSError:
            pass
        full = err.errno in FULL_ERRNOS
        logger.warning("file store %s: cannot write %r (%d bytes): %s", self.directory, key, payload_len, err)
        return NO_SPACE if full else UNAVAILABLE
