"""The FileStore's capacity, eviction and disk reclaiming (store.py has the design).

* Capacity: LRU eviction from the index (a whole block when its objects are known), never of an
  object the running batch stored or relies on.  The evicted records are marked dead once the
  batch is committed (``bury``), so a restart does not bring them back.
* Reclaiming: while the segments total more than the capacity plus one segment, the sealed
  segment with the most dead bytes goes: dropped whole when nothing in it is live, else its live
  records are first copied (checked, verbatim) into the active segment (compaction).  A segment is
  only reclaimed under its exclusive flock, so never one another process appends to or deletes from.
* Full disk: whole segments are dropped in LRU order (of their most recently used object) until
  the failed batch should fit; none when even that would not be enough.

``SpacePolicy`` holds no state of its own: it decides, and changes the index and the segment log
through their methods, holding their locks in the order store.py gives.
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Any

from transfer_factory.file.index import Index
from transfer_factory.file.log import SegmentLog
from transfer_factory.file.segments import HEADER_SIZE, Segment, payload_checksum, try_lock_exclusive, unlock, unpack_header
from transfer_factory.file.store_io import address_of, fs_space, on_disk, read_all_at
from transfer_factory.keys import KINDS

logger = logging.getLogger("transfer_factory.file.store")

_COMPACT_CHUNK = 8 << 20             # bytes of records a compaction copies per write
_RECLAIM_ROUNDS = 64


def group_of(key: Any) -> str | None:
    """The object group a key belongs to: ``{namespace}/{hash}/{rank}`` for a block's K, V and scale
    objects (DESIGN §3.7), which are only useful together; None for keys of any other shape."""
    if not isinstance(key, str):
        return None
    head, sep, kind = key.rpartition("/")
    return head if sep and head and kind in KINDS else None


class SpacePolicy:
    """Eviction, reclaiming and full disks for one store's index and segment log."""

    def __init__(self, index: Index, log: SegmentLog) -> None:
        self._index = index
        self._log = log

    # ------------------------------------------------------------------------------------ capacity
    def bury(self) -> None:
        """Marks dead on disk the records eviction forgot."""
        self._log.mark_evicted(self._index.take_doomed())

    # ------------------------------------------------------------------------------------ segments
    def drop_segment(self, seg: Segment, siblings: bool = False) -> tuple[int, int]:
        """Removes a segment whole: its file and every object in it (with ``siblings``, the rest of
        their blocks too).  The caller holds the append lock and the segment's exclusive lock (or it
        is this instance's sealed segment).  Returns (objects evicted, bytes freed on disk)."""
        freed = self._log.unlink(seg)
        with self._index.lock:
            evicted = self._index.drop_segment(seg, with_blocks=siblings)
            self._log.forget(seg)                       # closing the fd lets go of the lock
        return evicted, freed

    def make_room(self, total: int, keep: set[bytes], err: int) -> bool:
        """After a write failed with a full filesystem or quota (``err``): drops whole segments in
        LRU order, never one holding an object in ``keep``, until ``total`` bytes should fit.  False,
        dropping nothing, when even that would not be enough (the disk is full of other files).
        The append lock held."""
        space = fs_space(self._log.directory)
        block = space.block if space else 4096
        need = on_disk(total, block) + block            # one block of slack for the directory and metadata
        if space is None or err != errno.ENOSPC:
            target = need                               # a quota (EDQUOT) counts our files: free our size
        elif not space.inodes_left:
            target = 1                                  # out of inodes: any file removed frees one
        else:
            target = max(need - space.free, 1)          # at least one: something must change before a retry
        index = self._index
        with index.lock:
            last_use = index.last_use()
            order = sorted((s for s in self._log.segments() if not index.holds_any(s, keep)),
                           key=lambda s: (last_use.get(s, -1), s.name))
            order = [s for s in order if self._log.pin_open(s)]   # their fds stay theirs while we use them
        try:
            return self._drop_for_room(order, target, total, err)
        finally:
            for seg in order:
                self._log.unpin(seg)

    def _drop_for_room(self, order: list[Segment], target: int, total: int, err: int) -> bool:
        victims, expect = [], 0
        active = self._log.active
        for seg in order:
            if expect >= target:
                break
            if seg is not active and not try_lock_exclusive(seg.fd):
                continue                                # another process appends to it or deletes from it
            victims.append(seg)
            try:
                expect += os.fstat(seg.fd).st_blocks * 512
            except OSError:
                pass
        if expect < target:
            for seg in victims:
                if seg is not active:
                    unlock(seg.fd)
            # Debug only: the write's own warning follows.
            logger.debug("file store %s: filesystem full (%s), and dropping all %d droppable segments (%d bytes) "
                         "would not make room for %d bytes", self._log.directory, os.strerror(err), len(victims),
                         expect, total)
            return False
        evicted = freed = 0
        for seg in victims:
            if seg is active:
                self._log.seal(seg)
                if not try_lock_exclusive(seg.fd):
                    continue
            n, b = self.drop_segment(seg, siblings=True)
            evicted += n
            freed += b
        logger.info("file store %s: filesystem full (%s); dropped %d LRU segments (%d objects, %d bytes on disk) to "
                    "make room for %d bytes", self._log.directory, os.strerror(err), len(victims), evicted, freed,
                    total)
        return True

    # ------------------------------------------------------------------------------------ reclaiming
    def reclaim(self, capacity_bytes: int) -> None:
        """Keeps the segments' total within the capacity plus one segment; the append lock held."""
        log, index = self._log, self._index
        bound = capacity_bytes + log.segment_bytes
        skip: set[Segment] = set()
        for _ in range(_RECLAIM_ROUNDS):
            if log.disk_bytes <= bound:
                return
            with index.lock:
                active = log.active
                cands = [s for s in log.segments()
                         if s is not active and s not in skip and s.size > index.live_bytes(s)]
                pick = max(cands, key=lambda s: s.size - index.live_bytes(s)) if cands else None
            if pick is None:
                if active is not None and active.size > index.live_bytes(active):
                    log.seal(active)                    # its dead bytes become reclaimable
                    continue
                return
            if not log.pin_open(pick):
                continue
            try:
                if not try_lock_exclusive(pick.fd):
                    skip.add(pick)                      # in use by another process: another one
                    continue
                if index.has_members(pick) and not self.compact(pick):
                    unlock(pick.fd)
                    return
                self.drop_segment(pick)
            finally:
                log.unpin(pick)

    def compact(self, seg: Segment) -> bool:
        """Copies ``seg``'s live records, each checked, into the active segment and points the
        index at the copies; False when the copy could not be written.  The append lock held,
        ``seg`` locked exclusive and pinned."""
        index = self._index
        with index.lock:
            ents = sorted((index.get(d).offset, d, index.get(d)) for d in index.members(seg))
        moved = bad = 0
        i = 0
        while i < len(ents):
            chunk, size = [], 0
            while i < len(ents) and (not chunk or size + ents[i][2].size <= _COMPACT_CHUNK):
                chunk.append(ents[i])
                size += ents[i][2].size
                i += 1
            raw = bytearray(size)
            buf, base = memoryview(raw), address_of(raw)
            headers, ptrs, lengths, crcs, good, pos = [], [], [], [], [], 0
            for off, d, e in chunk:
                at, rec = pos, buf[pos:pos + e.size]
                pos += e.size
                try:
                    got = read_all_at(seg.fd, [rec], off)
                except OSError:
                    got = 0
                if (got != e.size or unpack_header(rec) != e.fields(d)
                        or payload_checksum([rec[HEADER_SIZE:]]) != e.crc):
                    with index.lock:
                        index.drop_if(d, e)
                    bad += 1
                    continue
                headers.append(bytes(rec[:HEADER_SIZE]))          # verbatim: the copy is the record
                ptrs.append(base + at + HEADER_SIZE)
                lengths.append(e.length)
                crcs.append(e.crc)
                good.append((d, e))
            if not good:
                continue
            try:
                dest, offsets = self._log.append([(b"".join(headers), ptrs, lengths, None, lengths, crcs)],
                                                 HEADER_SIZE * len(lengths) + sum(lengths))
            except OSError as exc:
                logger.warning("file store %s: cannot compact %s: %s", self._log.directory, seg.name, exc)
                return False
            with index.lock:
                moved += sum(index.relocate(d, e, seg, dest, off) for (d, e), off in zip(good, offsets))
        if bad:
            logger.warning("file store %s: %d records of %s failed their checks while compacting it; dropped",
                           self._log.directory, bad, seg.name)
        logger.debug("file store %s: compacted %s: %d live records moved", self._log.directory, seg.name, moved)
        return True
