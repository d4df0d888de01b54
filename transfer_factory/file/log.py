"""The FileStore's segment log: the rank directory's segment files as this instance knows them
(segments.py has the record format and the flocks between processes; store.py the design).

``SegmentLog`` owns the segment table, the active segment, the bytes on disk, the pins that keep a
segment's fd open while a read or a write uses it, and two locks: ``append_lock`` (appends, seals,
dead marks and every flock taken or dropped: one at a time) and a table lock (the table, each
segment's size, pins and closing).  store.py has the order they are taken in.  It appends batches
with one write and one sync, truncates a failed batch, marks records dead, picks up what other
processes appended (``refresh``, which enters their records in the index it is given) and removes
files.  It never decides what to evict or reclaim: that is the space policy's.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from itertools import accumulate
from typing import Iterable

from transfer_factory.file.index import Index
from transfer_factory.file.segments import (
    DEAD, HEADER_SIZE, SEG_RE, Entry, Segment, new_segment, open_segment, scan, segment_size,
    try_lock_shared, unlock, unpack_header,
)
from transfer_factory.file.store_io import FILE_MODE, Untrusted, fs_space, fsync_dir, tighten, write_records

logger = logging.getLogger("transfer_factory.file.store")

REFRESH_S = 1.0                      # other processes' records are picked up at least this often

# A run of records to append: (headers back to back, payload buffer pointers, their sizes, buffers
# per record or None for one each, payload lengths, payload checksums).
Chunk = tuple


class SegmentLog:
    """The segment files of one rank directory: appends, dead marks, scans and removal."""

    def __init__(self, directory: str, index: Index, fsync: bool) -> None:
        self.directory = directory
        self.fsync = fsync
        self.segment_bytes = 0            # a segment is sealed past this (``size_segments``)
        self._index = index               # told about records found and segments gone; never written here
        self.append_lock = threading.RLock()
        self._table_lock = threading.RLock()
        self._segments: dict[str, Segment] = {}
        self._active: Segment | None = None
        self._disk = 0                    # bytes of all segments this instance knows
        self._last_refresh = 0.0
        self._refused: set[str] = set()   # segment names refused (not ours: DESIGN §4), logged once

    # ------------------------------------------------------------------------------------ the table
    @property
    def disk_bytes(self) -> int:
        return self._disk

    @property
    def active(self) -> Segment | None:
        return self._active

    def __len__(self) -> int:
        return len(self._segments)

    def segments(self) -> list[Segment]:
        with self._table_lock:
            return list(self._segments.values())

    def pin(self, seg: Segment) -> None:
        """Keeps ``seg``'s fd open (its file's) until ``unpin``; a forgotten segment closes after."""
        with self._table_lock:
            seg.pin()

    def unpin(self, seg: Segment) -> None:
        with self._table_lock:
            seg.unpin()

    def pin_open(self, seg: Segment) -> bool:
        """``pin`` unless ``seg`` is closed already (False)."""
        with self._table_lock:
            if seg.closed:
                return False
            seg.pin()
            return True

    def forget(self, seg: Segment) -> None:
        """Drops ``seg`` from the table and closes it (once unpinned); the index forgets its records
        first (``Index.drop_segment``)."""
        with self._table_lock:
            if self._segments.get(seg.name) is seg:
                del self._segments[seg.name]
                self._disk -= seg.size
            if self._active is seg:
                self._active = None
            seg.retire()
            seg.close()

    def reset(self) -> None:
        """Forgets every segment (closing files once reads are done)."""
        with self._table_lock:
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._active = None
            self._disk = 0

    def size_segments(self, capacity_bytes: int) -> None:
        """Sets the segment size for this capacity and the directory's filesystem."""
        space = fs_space(self.directory)
        self.segment_bytes = segment_size(capacity_bytes, space.total if space else 0)

    # ------------------------------------------------------------------------------------ refresh
    def maybe_refresh(self) -> None:
        if time.monotonic() - self._last_refresh >= REFRESH_S:
            self.refresh()

    def refresh(self, opening: bool = False) -> tuple[int, int]:
        """Brings the table up to date with the directory: segments others removed are forgotten,
        new ones opened, and the records other processes appended since the last look entered in
        the index.  Returns (files made private, bytes of invalid records stepped over)."""
        tightened = skipped = 0
        index = self._index
        with index.lock, self._table_lock:
            try:
                with os.scandir(self.directory) as it:
                    names = sorted(e.name for e in it if SEG_RE.match(e.name))
            except OSError:
                return 0, 0
            self._last_refresh = time.monotonic()
            present = set(names)
            for name, seg in list(self._segments.items()):
                if name not in present:                      # reclaimed (or cleared) by another process
                    index.drop_segment(seg)
                    self.forget(seg)
            self._refused &= present
            for name in names:
                seg = self._segments.get(name)
                if seg is None:
                    if name in self._refused:
                        continue
                    try:
                        seg = open_segment(self.directory, name)
                    except Untrusted as exc:                 # another user's, a symlink, a FIFO...
                        self._refused.add(name)
                        logger.warning("file store %s: refused segment %s: %s; never read", self.directory,
                                       name, exc.why)
                        continue
                    except OSError:
                        continue                             # removed meanwhile
                    self._segments[name] = seg
                    if opening:
                        tightened += tighten(seg.fd, FILE_MODE)
                if not seg.own:
                    skipped += self._scan_new_bytes(seg)
        return tightened, skipped

    def _scan_new_bytes(self, seg: Segment) -> int:
        """Enters the records another process appended to ``seg`` since the last scan; both locks
        held.  Returns the bytes of invalid records stepped over."""
        try:
            size = os.fstat(seg.fd).st_size
        except OSError:
            return 0
        bad = 0
        if size < seg.scanned:                               # its writer truncated a failed batch
            self._index.drop_past(seg, size)
            seg.scanned_to(size)
        if size > seg.scanned:
            try:
                found, end, bad = scan(seg.fd, seg.scanned, size)
            except OSError as exc:
                # DESIGN §4: an unreadable segment (EIO) costs its own records, which become misses,
                # and nothing else: the store opens and serves the rest.  These bytes are not read
                # again (every refresh would fail the same way); what is appended later is.
                logger.warning("file store %s: cannot read segment %s (%s); its objects are misses",
                               self.directory, seg.name, exc)
                self._index.drop_segment(seg)
                seg.scanned_to(size)
                self._disk += seg.resize(size)
                return 0
            seg.scanned_to(end)
            if bad:
                logger.warning("file store %s: segment %s has %d bytes of torn or damaged records; "
                               "stepped over them", self.directory, seg.name, bad)
            for f in found:
                if f.header.live:
                    h = f.header
                    e = Entry(seg, f.offset, h.payload_len, h.crc, h.header_crc)
                    if self._index.is_deferred_copy(h.digest, e):
                        self._index.defer(h.digest, e)       # a deleted record a compaction moved
                    else:
                        self._index.add(h.digest, e)
        self._disk += seg.resize(size)
        return bad

    # ------------------------------------------------------------------------------------ appends
    def append(self, chunks: Iterable[Chunk], total: int) -> tuple[Segment, list[int]]:
        """Appends records given as chunks (``Chunk``; one ``write_records`` each) to the active
        segment, with one sync at the end; returns the segment and each record's offset.  On failure
        the segment is truncated back (removed when it was new and empty) and the error raised."""
        with self.append_lock:
            seg = self._writable(total)
            self.pin(seg)                                    # a refresh may forget it, never close it under us
            try:
                return self._append_to(seg, chunks)
            finally:
                self.unpin(seg)

    def _writable(self, total: int) -> Segment:
        """The active segment, sealed and replaced by a new one when ``total`` more bytes would
        take it past the segment size, or when someone removed it; append_lock held."""
        seg = self._active
        if seg is not None and not seg.closed:
            try:
                gone = os.fstat(seg.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:                                         # cleared by another process
                with self._index.lock:
                    self._index.drop_segment(seg)
                    self.forget(seg)
                seg = None
            elif seg.size and seg.size + total > self.segment_bytes:
                self.seal(seg)
                seg = None
        else:
            seg = None
        if seg is None:
            with self._table_lock:                           # a refresh must not take it for another's
                seg = new_segment(self.directory)
                self._segments[seg.name] = seg
                self._active = seg
        return seg

    def seal(self, seg: Segment) -> None:
        """No more appends to ``seg``: it becomes reclaimable by any process."""
        with self.append_lock, self._table_lock:
            if seg.active and not seg.closed:
                try:
                    unlock(seg.fd)
                except OSError:
                    pass
            seg.retire()
            if self._active is seg:
                self._active = None

    def _append_to(self, seg: Segment, chunks: Iterable[Chunk]) -> tuple[Segment, list[int]]:
        start = off = seg.size
        offsets: list[int] = []
        try:
            for headers, ptrs, sizes, counts, lengths, _ in chunks:
                write_records(seg.fd, off, headers, ptrs, sizes, counts)
                if lengths:
                    offsets += accumulate([HEADER_SIZE + n for n in lengths[:-1]], initial=off)
                    off += HEADER_SIZE * len(lengths) + sum(lengths)
            if self.fsync:
                os.fdatasync(seg.fd)
                if seg.fresh:
                    fsync_dir(self.directory)                # the new segment's name is durable too
            seg.made_durable()
        except OSError:
            self._undo_append(seg, start)
            raise
        with self._table_lock:
            self._disk += seg.resize(off)
        return seg, offsets

    def _undo_append(self, seg: Segment, start: int) -> None:
        try:
            os.ftruncate(seg.fd, start)
        except OSError as exc:
            # The partial batch stays: scans step over it, but nothing is appended after it.
            logger.warning("file store %s: cannot truncate %s after a failed write: %s", self.directory, seg.name, exc)
            self.seal(seg)
            try:
                size = os.fstat(seg.fd).st_size
                with self._table_lock:
                    self._disk += seg.resize(size)
            except OSError:
                pass
            return
        if start == 0:                                       # nothing in it: do not leave an empty file
            try:
                os.unlink(seg.path)
            except OSError:
                pass
            with self._index.lock:
                self._index.drop_segment(seg)
                self.forget(seg)

    # ------------------------------------------------------------------------------------ dead marks
    def mark_dead(self, d: bytes, e: Entry) -> bool | None:
        """Writes the dead magic over ``e``'s record if it is still ``d``'s live record: True when
        marked (or deferred: ``_mark``), False when it was not live any more, None when its segment
        has been reclaimed.  Call it without holding the index lock."""
        with self.append_lock:
            self.retry_deferred()
            return self._mark(d, e)

    def retry_deferred(self) -> None:
        """Writes the dead marks deferred while a peer held their segments; append_lock held.  The
        refresh comes first: a copy the peer's compaction made is deferred too before the mark on
        the reclaimed original is dropped (``Index.is_deferred_copy``), so none is served again."""
        if not self._index.has_deferred():
            return
        self.refresh()
        for d, e in self._index.take_deferred():
            self._mark(d, e)

    def _mark(self, d: bytes, e: Entry) -> bool | None:
        seg = e.seg
        if not self.pin_open(seg):
            return None                                   # its fd stays this file's until unpinned
        try:
            # The active one is held shared already.  Another process compacting this one holds it
            # exclusive, maybe for long (a paused peer): waiting for it here, under append_lock,
            # would stall every write of this instance, so the mark waits in the index instead
            # and is retried by the next write or delete (the object is a miss here meanwhile).
            if not seg.active and not try_lock_shared(seg.fd):
                self._index.defer(d, e)
                return True
            try:
                try:
                    if os.fstat(seg.fd).st_nlink == 0:
                        return None
                    if unpack_header(os.pread(seg.fd, HEADER_SIZE, e.offset)) != e.fields(d):
                        return False
                    os.pwrite(seg.fd, DEAD, e.offset)
                    return True
                finally:
                    if not seg.active:
                        unlock(seg.fd)
            except OSError as exc:
                logger.warning("file store %s: cannot mark a record of %s dead: %s", self.directory, seg.name, exc)
                return False
        finally:
            self.unpin(seg)

    def mark_evicted(self, doomed: list[tuple[bytes, Entry]]) -> None:
        """Writes the dead magic over records eviction forgot, so that neither a restart nor
        another process brings them back.  A mark that is lost (a crash first) only lets a right
        object come back.  One pwrite per record (a pread first where another process appends)."""
        with self.append_lock:
            self.retry_deferred()
            doomed = [(d, e) for d, e in doomed if self.pin_open(e.seg)]
            try:
                for d, e in doomed:
                    seg = e.seg
                    try:
                        if seg.own or unpack_header(os.pread(seg.fd, HEADER_SIZE, e.offset)) == e.fields(d):
                            os.pwrite(seg.fd, DEAD, e.offset)
                    except OSError as exc:
                        logger.debug("file store %s: cannot mark an evicted record of %s dead: %s", self.directory,
                                     seg.name, exc)
            finally:
                for _, e in doomed:
                    self.unpin(e.seg)

    def sync(self, seg: Segment) -> None:
        """Makes dead marks in ``seg`` durable (when the store syncs at all); pinned by the caller."""
        if self.fsync:
            os.fdatasync(seg.fd)

    # ------------------------------------------------------------------------------------ removal
    def unlink(self, seg: Segment) -> int:
        """Removes ``seg``'s file (the caller holds it exclusive, or it is this instance's sealed
        one); the bytes that frees on disk (0 when it could not be removed)."""
        try:
            freed = os.fstat(seg.fd).st_blocks * 512
        except OSError:
            freed = 0
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("file store %s: cannot remove %s: %s", self.directory, seg.name, exc)
            freed = 0
        return freed
