"""FileStore: the embedded default storage backend, many objects per file on a local disk.

Layout (DESIGN §3.7, §4)
------------------------
Objects live under ``{root}/{namespace}/rank{rank}/`` in append-only **segment files**
``{creation time ns:016x}.{random:08x}.seg``.  A segment is records back to back, one per object:
a 56-byte header (magic ``CTKR`` live or ``CTKD`` dead, version, flags, payload length, payload
checksum (XXH3, low 32 bits), the key's SHA-256, and a CRC32 of the header itself), then the
payload; the byte table,
the scan and the locks between processes are in segments.py.  Objects of a few KiB no longer cost a file each:
a replay that made 122,000 files makes a few dozen segments, and removing a store is a
``shutil.rmtree`` of those.  Components, each owning its state and its lock, composed here:
``SegmentLog`` (log.py: the segment table, appends, dead marks, refresh, removal), ``Index``
(index.py: key -> record, LRU, byte accounting, known blocks), ``SpacePolicy`` (space.py:
eviction, reclaiming, full disks); the paths over them are ``Writer`` (store_write.py: batches,
commit, deletes) and ``Reader`` (store_read.py); checksums.py, store_io.py (options, modes, I/O).

Per-record work is batch-wide: the C helper ``_records`` (csrc/records*.c) hashes every
key of a batch, packs and checks every header of a run, checksums payloads (XXH3 taken from the
xxhash package's own library, the GIL let go), moves a run of records with vectored I/O and makes
the index entries, one call for many records; Python plans and checks per batch or per piece, and
falls back to object-by-object paths only for a batch that is not simple (a duplicate, an invalid
buffer, a stored key, a failed check).  At 16 KiB objects the Python cost per record had been
several times the cost of copying it.

Writes (group commit): a ``batch_set`` appends all its new records to this instance's *active*
segment, one vectored write per chunk of up to 8 MiB (each chunk checksummed with XXH3 just before),
then makes them durable with one ``fdatasync`` (option ``fsync``, default on; plus one
directory fsync when the segment is new), and only then reports OK and enters them in the index.
A failed write (ENOSPC, EIO, a short write) truncates the segment back to where the batch began.
Each process appends only to segments it created and holds shared (flock) while it does; a
segment is sealed once past the segment size (``segments.segment_size``), and the next batch
opens a new one.  A ``batch_set`` of a key already indexed with the same size, whose record on
disk is still live, is a success that writes nothing: the key names the content (the same key is
the same prefix's KV), so the first copy stays; when that copy lies in another process's segment
not yet known durable, that segment is fdatasynced first (that process may be paused between its
write and its sync), and ``exists`` does the same before answering 1 (store_write.Durability).
A ``batch_set`` run under a ``CommitLease`` (the CTM's tasks) appends nothing once the lease is
revoked or its deadline passed, nor once the store is closed: a late call stores nothing.

Reads: the keys of a ``batch_get`` are grouped per segment and sorted by offset; each run of
adjacent records is read with vectored reads into the callers' buffers (headers into a scratch
buffer), each payload checksummed right after its part of the run is read (still in cache); then
every header must equal, byte for byte, the one the index expects and every payload's checksum
must match, or the key is a miss.  A record whose header is valid but whose payload fails its
checksum is ``CORRUPT``: logged, marked dead on disk (so no process, and no restart, serves it again)
and no bytes reported as read; one whose header is damaged is ``CORRUPT`` too and is dropped from
the index; one another process deleted meanwhile is ``NOT_FOUND``.

Why a crash never yields wrong data: (1) a record enters the index only when its header is valid
(its own CRC, a known magic and version), and is served only when the header read back is the one
the index expects (same key digest, length and payload checksum, still live) and the payload's
checksum matches, at every read; so a torn or half-flushed record, whatever the crash left of it, is a
miss; (2) bytes are only ever appended past the end of a segment its own process writes, or
truncated back to a batch's start there, so a crash in a write cannot touch a record written
before it; the only in-place write is the 4-byte dead magic, which lands or not, and a torn one
is neither magic: a miss; (3) a compaction copies records verbatim after checking them and
removes the old segment only once the copies are durable, so a crash between leaves two right
copies; (4) OK (and an ``exists`` 1) is reported only after the fdatasync, whichever process wrote
the record.  The index is rebuilt on open by scanning
every segment's headers (a torn tail or a damaged record in the middle is stepped over,
``segments.scan``); no separate index file can disagree with the segments.  The order of
objects after a restart is their write order (reads are not recorded on disk).

Capacity (index.py, space.py): an in-memory LRU index (key digest -> record) counts header + payload
of every live object (``used_bytes``); a set that would exceed ``capacity_bytes`` first evicts the
least recently used objects (a whole block when its objects are known), never one the running
batch stored or relies on; an object alone larger than the capacity is ``NO_SPACE``.  The disk
is reclaimed by segment (``disk_bytes``): while the segments total more than the capacity
plus one segment, the segment with the most dead bytes is dropped whole when nothing in it is
live, else its live records are copied into the active segment first (compaction).  Evicted
records are marked dead after the batch's commit (a 4-byte write each, not synced): one whose
mark a crash lost comes back after a restart, with its right bytes.

Full disks (DESIGN §4): a write that fails with ENOSPC or EDQUOT, at write or fsync, or that
accepts no bytes, truncates its partial batch, drops whole segments of this store in LRU order
until the batch should fit (per ``statvfs``; nothing when even an empty cache would not make
room) and retries once; if that fails too its keys report ``NO_SPACE``, quickly and with nothing
left behind.  Object groups: keys ``{namespace}/{hash}/{rank}/{k|v|k_scale|v_scale}`` of one block
are stored all or none within a batch; when one fails, the others of its block report the same
code and are removed (marked dead when already on disk).

Processes: each opens the same rank directory with its own index; records other processes append
are picked up (by an incremental scan of new segment bytes) when a key is missing from the index
and at least once a second; a record another process deleted or a segment it reclaimed reads as a
miss.  If the rank directory is removed or replaced while open, calls report ``UNAVAILABLE`` (a
replaced one is re-scanned), never the old bytes.

Modes: segment files are 0600 and every directory the store creates is 0700, whatever the umask;
files and the store's own directories left looser by an older version are tightened on open; the
fan-out directories of the older one-file-per-object format are removed on open.  Trust (DESIGN §4):
a root, namespace or rank directory that is a symlink or another user's is refused at open, naming
it; a segment is opened O_NOFOLLOW|O_NONBLOCK and used only when it is a regular file of this user
(anything else is logged once and never read); modes are set through fds, never by path.

Options: ``root`` (default ``$CTM_FILE_STORE_ROOT``, else FastDeploy's ``$FILE_BACKEND_STORAGE_DIR``, else
``~/.cache/cache-transfer-manager/kv``),
``capacity_bytes`` (default ``$CTM_FILE_STORE_CAPACITY``, else 64 GiB; an int, or a string with an
optional K/M/G/T binary suffix), ``fsync`` (default True).  A bad or unknown option raises
``StorageConfigError`` naming it.  No pickle anywhere: payloads are raw bytes.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from transfer_factory.file.index import Index, key_digest
from transfer_factory.file.log import SegmentLog
from transfer_factory.file.segments import (DEAD, HEADER_SIZE, LIVE, remove_old_layout, remove_segment_files,
                                             try_lock_exclusive)
from transfer_factory.file.space import SpacePolicy
from transfer_factory.file.store_io import (
    DEFAULT_CAPACITY, DEFAULT_ROOT, DIR_MODE, ENV_CAPACITY, ENV_ROOT, OPTIONS, Untrusted, Views, makedirs_private,
    own_directory, resolve_options, valid_ptr, valid_size,
)
from transfer_factory.file.store_read import Reader
from transfer_factory.file.store_write import Writer
from transfer_factory.kvcache_storage import UNAVAILABLE, KVCacheStorage, StorageAccess, StorageConfigError, check_batch

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_ROOT", "ENV_CAPACITY", "ENV_ROOT", "FileStore", "HEADER_SIZE", "LIVE",
           "DEAD", "Location"]


class Location(NamedTuple):
    """Where an object's record lies: ``length`` bytes at ``offset`` of ``path`` (header first)."""
    path: Path
    offset: int
    length: int


class FileStore(KVCacheStorage):
    """Objects as checksummed records in segment files under ``{root}/{namespace}/rank{rank}/``."""

    name = "file"
    access = StorageAccess.HOST_STAGED
    supports_multi_buffer = True
    honours_commit_lease = True   # store_write.Writer._commit asks the lease at its commit point

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

        root, root_source, self.capacity_bytes, self.fsync, self.staged_read_piece_bytes = resolve_options(options)
        self.namespace = namespace
        self.rank = rank
        self.root = Path(root)
        self.directory = self.root / namespace / f"rank{rank}"
        tightened: list[str] = []
        try:
            tightened = self._check_directories(missing_ok=True)    # never create anything through a symlink
            created = makedirs_private(str(self.directory))
        except Untrusted:
            created = []                                    # refused just below, naming it
        except OSError as exc:
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: cannot create "
                                     f"{str(self.directory)!r}: {exc.strerror or exc}") from None
        try:
            tightened += self._check_directories()
        except Untrusted as exc:
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: refusing "
                                     f"{exc.filename!r}: {exc.why} (DESIGN §4: the store's directories must be "
                                     f"its own)") from None
        except OSError as exc:
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: cannot check "
                                     f"{exc.filename or str(self.directory)!r}: {exc.strerror or exc}") from None
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise StorageConfigError(f"file store option root ({root_source}) {str(self.root)!r}: "
                                     f"{str(self.directory)!r} is not writable")
        if created:
            logger.info("file store: created %s (mode %o)", ", ".join(created), DIR_MODE)
        for own in tightened:
            logger.info("file store: %s was open to others; now mode %o", own, DIR_MODE)

        st = os.stat(self.directory)
        self._dir_id = (st.st_dev, st.st_ino)
        self._closed = False
        # The components and their locks.  Lock order (a lock may be taken while holding only
        # those before it; each is reentrant):
        #   1. SegmentLog.append_lock  appends, seals, dead marks, reclaiming, every flock change
        #   2. Index.lock              the index, its byte accounting, known blocks, doomed records
        #   3. SegmentLog table lock   the segment table, sizes, pins, closing (taken inside the
        #                              log's own methods only, never held while calling out)
        # So: never take append_lock while holding Index.lock (call mark_dead, seal, append and
        # the space policy's reclaiming without it), and nothing is called under the table lock.
        self.index = Index(self.capacity_bytes)
        self.segment_log = SegmentLog(str(self.directory), self.index, self.fsync)
        self.space_policy = SpacePolicy(self.index, self.segment_log)
        views = Views()
        self._reader = Reader(self.index, self.segment_log, views)
        self._writer = Writer(self.index, self.segment_log, self.space_policy, views)
        self._open()
        logger.info("file store %s: %d objects in %d segments, %d of %d bytes used (%d on disk), segment size %d, "
                    "fsync %s", self.directory, len(self.index), len(self.segment_log), self.used_bytes,
                    self.capacity_bytes, self.disk_bytes, self.segment_bytes, self.fsync)

    # ----------------------------------------------------------------------------------- state
    @property
    def used_bytes(self) -> int:
        """Bytes of live records (headers included) in the index."""
        return self.index.used_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the segment files this instance knows (live, dead and not yet scanned)."""
        return self.segment_log.disk_bytes

    @property
    def segment_bytes(self) -> int:
        """Bytes after which a segment is sealed."""
        return self.segment_log.segment_bytes

    def __len__(self) -> int:
        return len(self.index)

    def object_location(self, key: str) -> Location | None:
        """Where ``key``'s record is (None when it is not in the index): for tests that damage it."""
        with self.index.lock:
            e = self.index.get(key_digest(key))
            return None if e is None else Location(Path(e.seg.path), e.offset, e.size)

    def _check_directories(self, missing_ok: bool = False) -> list[str]:
        """Refuses (``Untrusted``) a root, namespace or rank directory that is a symlink, not a
        directory, or another user's (the root may be root's: it can read everything anyway), so that
        no other user can rename, plant or read there (DESIGN §4); makes the namespace and rank
        directories 0700 (an older version or a looser umask may have left them open).  Returns
        those it tightened."""
        tightened = []
        for d, mode in ((self.root, None), (self.root / self.namespace, DIR_MODE), (self.directory, DIR_MODE)):
            try:
                # The root existed before (or is a parent the store made): not the store's to chmod.
                if own_directory(str(d), mode, root_ok=mode is None):
                    tightened.append(str(d))
            except FileNotFoundError:
                if not missing_ok:
                    raise
                break
        return tightened

    def _open(self) -> None:
        """Scans the rank directory into the index (oldest segment first), removes leftovers and
        trims to the capacity."""
        log, index, space = self.segment_log, self.index, self.space_policy
        log.size_segments(self.capacity_bytes)
        old = remove_old_layout(str(self.directory))
        stale = remove_segment_files(str(self.directory), new_only=True)
        tightened, skipped = log.refresh(opening=True)
        with log.append_lock:
            empty = 0
            for seg in log.segments():
                # Nothing live, and no one appends to it: a crash leftover, or every record dead.
                if not index.has_members(seg) and not seg.active and try_lock_exclusive(seg.fd):
                    space.drop_segment(seg)
                    empty += 1
            with index.lock:
                victims = max(index.evict(0), 0)
            space.reclaim(self.capacity_bytes)
            space.bury()
        if old or stale or empty or victims or tightened or skipped:
            logger.info("file store %s: removed %d directories of the one-file-per-object format, %d segments "
                        "a dead process was creating and %d segments with nothing live; stepped over %d bytes of "
                        "torn or damaged records; evicted %d objects over capacity; made %d files private",
                        self.directory, old, stale, empty, skipped, victims, tightened)

    def _forget_all(self) -> None:
        """Forgets every segment and object (closing files once reads are done); append_lock held."""
        with self.index.lock:
            self.index.reset()
            self.segment_log.reset()

    def _usable(self) -> bool:
        """False (logged) when the store is closed or its directory is gone; a directory replaced by
        a new one is scanned afresh, since every file this instance holds open was removed."""
        if self._closed:
            return False
        try:
            st = os.stat(self.directory)
        except OSError as exc:
            logger.warning("file store %s: directory unusable: %s", self.directory, exc.strerror or exc)
            return False
        if (st.st_dev, st.st_ino) != self._dir_id:
            try:
                self._check_directories()
            except OSError as exc:
                logger.warning("file store %s: the directory was replaced and is refused: %s", self.directory, exc)
                return False
            logger.warning("file store %s: the directory was replaced; scanning the new one", self.directory)
            with self.segment_log.append_lock:
                self._dir_id = (st.st_dev, st.st_ino)
                self._forget_all()
                self._open()
        return True

    # ------------------------------------------------------------------------------------ interface
    def register_buffer(self, ptr: int, size: int) -> None:
        """Nothing to register for plain file I/O; refuses nonsense so caller bugs surface here."""
        if not valid_ptr(ptr):
            raise ValueError(f"register_buffer: pointer {ptr!r} must be a positive integer")
        if not valid_size(size) or size == 0:
            raise ValueError(f"register_buffer: size {size!r} must be a positive integer")

    def exists(self, keys: Sequence[str]) -> list[int]:
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        out = self._reader.exists(keys)
        if self.fsync and 1 in out:
            self._durable_hits(keys, out)
        return out

    def _durable_hits(self, keys: Sequence[str], out: list[int]) -> None:
        """A 1 of ``exists`` makes the CTM skip writing the block, as good as an OK: a hit on a record
        another process has not synced yet is synced first (``store_write.Durability``), and one
        that cannot be becomes 0 (the caller writes it anew, durably)."""
        durability = self._writer.durability
        hits = []
        with self.index.lock:
            for i, flag in enumerate(out):
                if flag == 1:
                    e = self.index.get(key_digest(keys[i]))
                    if e is not None and durability.needed(e):
                        hits.append((i, e))
        if not hits:
            return
        durability.ensure(e for _, e in hits)
        for i, e in hits:
            if durability.needed(e):
                out[i] = 0

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        return self._reader.get_batch(keys, ptrs, sizes, multi=False)

    def batch_get_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        check_batch(keys, ptr_lists, size_lists)
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        return self._reader.get_batch(keys, [list(p) for p in ptr_lists], [list(s) for s in size_lists], multi=True)

    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        return self._writer.set_batch(keys, ptrs, sizes, multi=False)

    def batch_set_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        check_batch(keys, ptr_lists, size_lists)
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        return self._writer.set_batch(keys, [list(p) for p in ptr_lists], [list(s) for s in size_lists], multi=True)

    def delete(self, keys: Sequence[str]) -> list[int]:
        """Per key: 0 removed (its record marked dead on disk), ``NOT_FOUND`` when there was none."""
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        return self._writer.delete(keys)

    def clear(self) -> None:
        """Removes every object of this namespace and rank: every segment file, whoever wrote it."""
        if self._closed:
            raise RuntimeError("file store is closed")
        with self.segment_log.append_lock:
            self._forget_all()
            removed = remove_segment_files(str(self.directory))
        logger.info("file store %s: cleared %d segment files", self.directory, removed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.closed = True      # a batch_set still running (a late call) commits nothing now
        with self.segment_log.append_lock:
            self.space_policy.bury()
            self._forget_all()
