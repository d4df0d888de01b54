"""The FileStore's segment table and index upkeep (file_store.py has the design).

Opening a rank directory (scan every segment into the index, oldest first, and remove leftovers),
picking up the records other processes append (an incremental scan of the bytes a segment grew by),
appending a batch to this instance's active segment with one write and one sync, sealing, and
closing segment files only once no read is using them.
"""
from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from itertools import accumulate
from typing import Sequence

from transfer_factory.file.segments import (
    HEADER_SIZE, NEW_RE, SEG_RE, Entry, Segment, new_segment, open_segment, scan, segment_size, try_lock_exclusive,
    unlock,
)
from transfer_factory.file._records import new_entries
from transfer_factory.file.store_io import FILE_MODE, FULL_ERRNOS, fs_space, fsync_dir, tighten, write_records

logger = logging.getLogger("transfer_factory.file.store")

_HCRC = struct.Struct("<52xI")          # the header CRC of each 56-byte header in a run
REFRESH_S = 1.0                      # other processes' records are picked up at least this often
_OLD_FANOUT_LEN = 2                  # the one-file-per-object format's {h[0:2]}/ directories


class IndexMixin:
    full_errnos = FULL_ERRNOS

    # ------------------------------------------------------------------------------------ open, reset
    def _open(self) -> None:
        """Scans the rank directory into the index (oldest segment first), removes leftovers and
        trims to the capacity.  Called from __init__, or with both locks held."""
        space = fs_space(self._dir)
        self.segment_bytes = segment_size(self.capacity_bytes, space.total if space else 0)
        old = self._remove_old_layout()
        stale = self._remove_files(new_only=True)
        tightened, skipped = self._refresh(opening=True)
        with self._wlock:
            empty = 0
            for seg in list(self._segments.values()):
                # Nothing live, and no one appends to it: a crash leftover, or every record dead.
                if not seg.members and not seg.active and try_lock_exclusive(seg.fd):
                    self._drop_segment(seg)
                    empty += 1
            with self._lock:
                victims = max(self._evict_locked(0), 0)
            self._reclaim()
            self._bury()
        if old or stale or empty or victims or tightened or skipped:
            logger.info("file store %s: removed %d directories of the one-file-per-object format, %d segments "
                        "a dead process was creating and %d segments with nothing live; stepped over %d bytes of "
                        "torn or damaged records; evicted %d objects over capacity; made %d files private",
                        self.directory, old, stale, empty, skipped, victims, tightened)

    def _remove_old_layout(self) -> int:
        removed = 0
        try:
            with os.scandir(self._dir) as it:
                olds = [e.path for e in it if len(e.name) == _OLD_FANOUT_LEN and e.is_dir(follow_symlinks=False)
                        and all(c in "0123456789abcdef" for c in e.name)]
        except OSError:
            return 0
        for path in olds:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        return removed

    def _remove_files(self, new_only: bool = False) -> int:
        """Unlinks the directory's segment files (with ``new_only``, only segments a dead process
        was creating: those no one holds locked)."""
        removed = 0
        try:
            with os.scandir(self._dir) as it:
                names = [e.name for e in it]
        except OSError:
            return 0
        for name in names:
            path = os.path.join(self._dir, name)
            if NEW_RE.match(name):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
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
            removed += self._remove_old_layout()
        return removed

    def _reset(self) -> None:
        """Forgets every segment and object (closing files once reads are done); both locks held."""
        for seg in list(self._segments.values()):
            self._close_segment(seg)
        self._segments.clear()
        self._doomed.clear()
        self._index.clear()
        self._siblings.clear()
        self._active = None
        self._used = self._disk = 0

    # ------------------------------------------------------------------------------------ refresh
    def _maybe_refresh(self) -> None:
        if time.monotonic() - self._last_refresh >= REFRESH_S:
            self._refresh()

    def _refresh(self, opening: bool = False) -> tuple[int, int]:
        """Brings the segment table up to date with the directory: segments others removed are
        forgotten, new ones opened, and the records other processes appended since the last look
        entered in the index.  Returns (files made private, bytes of invalid records stepped over)."""
        tightened = skipped = 0
        with self._lock:
            try:
                with os.scandir(self._dir) as it:
                    names = sorted(e.name for e in it if SEG_RE.match(e.name))
            except OSError:
                return 0, 0
            self._last_refresh = time.monotonic()
            present = set(names)
            for name, seg in list(self._segments.items()):
                if name not in present:
                    self._forget_segment_locked(seg)         # reclaimed (or cleared) by another process
            for name in names:
                seg = self._segments.get(name)
                if seg is None:
                    try:
                        seg = open_segment(self._dir, name)
                    except OSError:
                        continue                             # removed meanwhile
                    self._segments[name] = seg
                    if opening:
                        try:
                            tightened += tighten(seg.path, os.fstat(seg.fd), FILE_MODE)
                        except OSError:
                            pass
                if seg.own:
                    continue
                try:
                    size = os.fstat(seg.fd).st_size
                except OSError:
                    continue
                if size < seg.scanned:                       # its writer truncated a failed batch
                    for d in [d for d in seg.members if self._index[d].offset + HEADER_SIZE > size]:
                        self._drop_entry_locked(d)
                    seg.scanned = size
                if size > seg.scanned:
                    found, seg.scanned, bad = scan(seg.fd, seg.scanned, size)
                    skipped += bad
                    if bad:
                        logger.warning("file store %s: segment %s has %d bytes of torn or damaged records; "
                                       "stepped over them", self.directory, name, bad)
                    for f in found:
                        if f.header.live:
                            h = f.header
                            self._add_entry_locked(h.digest, Entry(seg, f.offset, h.payload_len, h.crc, h.header_crc))
                self._disk += size - seg.size
                seg.size = size
        return tightened, skipped

    # ------------------------------------------------------------------------------------ entries
    def _add_entry_locked(self, d: bytes, e: Entry) -> None:
        """Enters a record as ``d``'s, the most recently used; a copy it had before is forgotten."""
        old = self._index.pop(d, None)
        if old is not None:
            old.seg.members.discard(d)
            old.seg.live -= old.size
            self._used -= old.size
        self._index[d] = e
        e.seg.members.add(d)
        e.seg.live += e.size
        self._used += e.size

    def _add_entries_locked(self, seg: Segment, digests: list[bytes], offsets: list[int], lengths: Sequence[int],
                            crcs: list[int], headers: bytes) -> None:
        """``_add_entry_locked`` for the records of one append to ``seg`` (``headers``: theirs, back
        to back, for the header CRCs), in one pass."""
        index = self._index
        if index.keys().isdisjoint(digests):             # the common case: all new, entered in one C call
            new_entries(index, seg, digests, offsets, lengths, crcs, headers)
            seg.members.update(digests)
        else:
            hcrcs = [h for (h,) in _HCRC.iter_unpack(headers)]
            for d, off, n, crc, hcrc in zip(digests, offsets, lengths, crcs, hcrcs):
                self._add_entry_locked(d, Entry(seg, off, n, crc, hcrc))
            return
        added = HEADER_SIZE * len(lengths) + sum(lengths)
        seg.live += added
        self._used += added

    def _drop_entry_locked(self, d: bytes) -> Entry | None:
        e = self._index.pop(d, None)
        if e is not None:
            e.seg.members.discard(d)
            e.seg.live -= e.size
            self._used -= e.size
        self._siblings.pop(d, None)
        return e

    def _forget_segment_locked(self, seg: Segment) -> None:
        for d in list(seg.members):
            self._drop_entry_locked(d)
        if self._segments.get(seg.name) is seg:
            del self._segments[seg.name]
            self._disk -= seg.size
        if self._active is seg:
            self._active = None
        seg.active = False
        self._close_segment(seg)

    def _close_segment(self, seg: Segment) -> None:
        seg.closed = True
        if seg.pins == 0 and seg.fd >= 0:
            fd, seg.fd = seg.fd, -1
            try:
                os.close(fd)                                 # also lets go of its flock
            except OSError:
                pass

    def _pin(self, seg: Segment) -> None:
        seg.pins += 1

    def _unpin(self, seg: Segment) -> None:
        seg.pins -= 1
        if seg.closed and seg.pins == 0:
            self._close_segment(seg)

    # ------------------------------------------------------------------------------------ appends
    def _writable(self, total: int) -> Segment:
        """The active segment, sealed and replaced by a new one when ``total`` more bytes would
        take it past the segment size, or when someone removed it; _wlock held."""
        seg = self._active
        if seg is not None and not seg.closed:
            try:
                gone = os.fstat(seg.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:                                         # cleared by another process
                with self._lock:
                    self._forget_segment_locked(seg)
                seg = None
            elif seg.size and seg.size + total > self.segment_bytes:
                self._seal(seg)
                seg = None
        else:
            seg = None
        if seg is None:
            with self._lock:                                 # a refresh must not take it for another's
                seg = new_segment(self._dir)
                self._segments[seg.name] = seg
                self._active = seg
        return seg

    def _seal(self, seg: Segment) -> None:
        """No more appends to ``seg``: it becomes reclaimable by any process; _wlock held."""
        if seg.active and not seg.closed:
            try:
                unlock(seg.fd)
            except OSError:
                pass
        seg.active = False
        if self._active is seg:
            self._active = None

    def _append(self, chunks, total: int) -> tuple[Segment, list[int]]:
        """Appends records given as an iterable of chunks ``(headers, ptrs, sizes, counts, lengths,
        crcs)`` (the records' headers back to back, their payload buffers, buffers per record or None
        for one each, payload lengths; one ``write_records`` per chunk), with one sync at the end;
        returns the segment and each record's offset.  On failure the segment is truncated back
        (removed when it was new and empty) and the error raised.  _wlock held."""
        seg = self._writable(total)
        with self._lock:
            self._pin(seg)                                   # a refresh may forget it, never close it under us
        try:
            return self._append_to(seg, chunks)
        finally:
            with self._lock:
                self._unpin(seg)

    def _append_to(self, seg: Segment, chunks) -> tuple[Segment, list[int]]:
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
                    fsync_dir(self._dir)                     # the new segment's name is durable too
            seg.fresh = False
        except OSError:
            self._undo_append(seg, start)
            raise
        with self._lock:
            seg.size = off
            self._disk += off - start
        return seg, offsets

    def _undo_append(self, seg: Segment, start: int) -> None:
        try:
            os.ftruncate(seg.fd, start)
        except OSError as exc:
            # The partial batch stays: scans step over it, but nothing is appended after it.
            logger.warning("file store %s: cannot truncate %s after a failed write: %s", self.directory, seg.name, exc)
            self._seal(seg)
            try:
                size = os.fstat(seg.fd).st_size
                with self._lock:
                    self._disk += size - seg.size
                    seg.size = size
            except OSError:
                pass
            return
        if start == 0:                                       # nothing in it: do not leave an empty file
            try:
                os.unlink(seg.path)
            except OSError:
                pass
            with self._lock:
                self._forget_segment_locked(seg)
