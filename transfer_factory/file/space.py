"""The FileStore's capacity, eviction and disk reclaiming (file_store.py has the design).

* Capacity: LRU eviction from the index (a whole block when its objects are known), never of an
  object the running batch stored or relies on.  The evicted records are marked dead once the
  batch is committed (``_bury``), so a restart does not bring them back.
* Reclaiming: while the segments total more than the capacity plus one segment, the sealed
  segment with the most dead bytes goes: dropped whole when nothing in it is live, else its live
  records are first copied (checked, verbatim) into the active segment (compaction).  A segment is
  only reclaimed under its exclusive flock, so never one another process appends to or deletes from.
* Full disk: whole segments are dropped in LRU order (of their most recently used object) until
  the failed batch should fit; none when even that would not be enough.
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Any, Iterator

from transfer_factory.file.segments import DEAD, HEADER_SIZE, Segment, payload_checksum, try_lock_exclusive, unlock, unpack_header
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


class SpaceMixin:
    # ------------------------------------------------------------------------------------ capacity
    def _evict_locked(self, need: int, keep: set[bytes] | frozenset[bytes] = frozenset()) -> int:
        """Evicts LRU objects until ``need`` more bytes fit under the capacity; the caller holds the
        lock.  Objects in ``keep`` are never evicted: evicting a block's K to make room for its V
        would leave the block incomplete.  When the capacity cannot be met without them nothing is
        evicted and -1 is returned; otherwise the number of objects evicted."""
        if self._used + need <= self.capacity_bytes:
            return 0
        victims, over = [], self._used + need - self.capacity_bytes
        for unit in self._lru_units_locked(keep):
            if over <= 0:
                break
            victims += unit
            over -= sum(self._index[d].size for d in unit)
        if over > 0:
            return -1
        for d in victims:
            self._doomed.append((d, self._drop_entry_locked(d)))
        return len(victims)

    def _lru_units_locked(self, keep: set[bytes] | frozenset[bytes]) -> Iterator[list[bytes]]:
        """What eviction may take, least recently used first: a whole block when its objects are
        known, else one object; never anything of a block the running batch (``keep``) touched."""
        seen: set[bytes] = set()
        for d in self._index:
            if d in seen:
                continue
            unit = [s for s in self._siblings.get(d, ()) if s in self._index] or [d]
            seen.update(unit)
            if not keep.isdisjoint(unit):
                continue
            yield unit

    def _bury(self) -> None:
        """Writes the dead magic over the records eviction forgot, so that neither a restart nor
        another process brings them back.  A mark that is lost (a crash first) only lets a right
        object come back.  One pwrite per record (a pread first where another process appends);
        _wlock held."""
        with self._lock:
            doomed, self._doomed = self._doomed, []
            doomed = [(d, e) for d, e in doomed if not e.seg.closed]
            for _, e in doomed:
                self._pin(e.seg)
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
            with self._lock:
                for _, e in doomed:
                    self._unpin(e.seg)

    # ------------------------------------------------------------------------------------ segments
    def _drop_segment(self, seg: Segment, siblings: bool = False) -> tuple[int, int]:
        """Removes a segment whole: its file and every object in it (with ``siblings``, the rest of
        their blocks too).  The caller holds _wlock and the segment's exclusive lock (or it is this
        instance's sealed segment).  Returns (objects evicted, bytes freed on disk)."""
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
        with self._lock:
            evicted = 0
            for d in list(seg.members):
                for s in (self._siblings.get(d, ()) if siblings else ()):
                    if s != d and s in self._index and self._index[s].seg is not seg:
                        self._doomed.append((s, self._drop_entry_locked(s)))
                        evicted += 1
                if self._drop_entry_locked(d) is not None:
                    evicted += 1
            self._forget_segment_locked(seg)                 # closing the fd lets go of the lock
        return evicted, freed

    def _make_room(self, total: int, keep: set[bytes], err: int) -> bool:
        """After a write failed with a full filesystem or quota (``err``): drops whole segments in
        LRU order, never one holding an object in ``keep``, until ``total`` bytes should fit.  False,
        dropping nothing, when even that would not be enough (the disk is full of other files).
        _wlock held."""
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
            last_use: dict[Segment, int] = {}
            for pos, e in enumerate(self._index.values()):
                last_use[e.seg] = pos
            order = sorted((s for s in self._segments.values() if keep.isdisjoint(s.members)),
                           key=lambda s: (last_use.get(s, -1), s.name))
            for seg in order:
                self._pin(seg)                          # their fds stay theirs while we use them
        try:
            return self._drop_for_room(order, target, total, err)
        finally:
            with self._lock:
                for seg in order:
                    self._unpin(seg)

    def _drop_for_room(self, order: list[Segment], target: int, total: int, err: int) -> bool:
        victims, expect = [], 0
        for seg in order:
            if expect >= target:
                break
            if seg is not self._active and not try_lock_exclusive(seg.fd):
                continue                                # another process appends to it or deletes from it
            victims.append(seg)
            try:
                expect += os.fstat(seg.fd).st_blocks * 512
            except OSError:
                pass
        if expect < target:
            for seg in victims:
                if seg is not self._active:
                    unlock(seg.fd)
            # Debug only: the write's own warning follows.
            logger.debug("file store %s: filesystem full (%s), and dropping all %d droppable segments (%d bytes) "
                         "would not make room for %d bytes", self.directory, os.strerror(err), len(victims),
                         expect, total)
            return False
        evicted = freed = 0
        for seg in victims:
            if seg is self._active:
                self._seal(seg)
                if not try_lock_exclusive(seg.fd):
                    continue
            n, b = self._drop_segment(seg, siblings=True)
            evicted += n
            freed += b
        logger.info("file store %s: filesystem full (%s); dropped %d LRU segments (%d objects, %d bytes on disk) to "
                    "make room for %d bytes", self.directory, os.strerror(err), len(victims), evicted, freed, total)
        return True

    # ------------------------------------------------------------------------------------ reclaiming
    def _reclaim(self) -> None:
        """Keeps the segments' total within the capacity plus one segment; _wlock held."""
        bound = self.capacity_bytes + self.segment_bytes
        skip: set[Segment] = set()
        for _ in range(_RECLAIM_ROUNDS):
            if self._disk <= bound:
                return
            with self._lock:
                cands = [s for s in self._segments.values()
                         if s is not self._active and s not in skip and s.size > s.live]
                pick = max(cands, key=lambda s: s.size - s.live) if cands else None
            if pick is None:
                active = self._active
                if active is not None and active.size > active.live:
                    self._seal(active)                  # its dead bytes become reclaimable
                    continue
                return
            with self._lock:
                if pick.closed:
                    continue
                self._pin(pick)
            try:
                if not try_lock_exclusive(pick.fd):
                    skip.add(pick)                      # in use by another process: another one
                    continue
                if pick.members and not self._compact(pick):
                    unlock(pick.fd)
                    return
                self._drop_segment(pick)
            finally:
                with self._lock:
                    self._unpin(pick)

    def _compact(self, seg: Segment) -> bool:
        """Copies ``seg``'s live records, each checked, into the active segment and points the
        index at the copies; False when the copy could not be written.  _wlock held, ``seg``
        locked exclusive."""
        with self._lock:
            ents = sorted((self._index[d].offset, d, self._index[d]) for d in seg.members)
            self._pin(seg)
        moved = bad = 0
        try:
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
                        with self._lock:
                            if self._index.get(d) is e:
                                self._drop_entry_locked(d)
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
                    dest, offsets = self._append([(b"".join(headers), ptrs, lengths, None, lengths, crcs)],
                                                 HEADER_SIZE * len(lengths) + sum(lengths))
                except OSError as exc:
                    logger.warning("file store %s: cannot compact %s: %s", self.directory, seg.name, exc)
                    return False
                with self._lock:
                    for (d, e), off in zip(good, offsets):
                        if self._index.get(d) is e and e.seg is seg:
                            seg.members.discard(d)
                            seg.live -= e.size
                            e.seg, e.offset = dest, off
                            dest.members.add(d)
                            dest.live += e.size
                            moved += 1
        finally:
            with self._lock:
                self._unpin(seg)
        if bad:
            logger.warning("file store %s: %d records of %s failed their checks while compacting it; dropped",
                           self.directory, bad, seg.name)
        logger.debug("file store %s: compacted %s: %d live records moved", self.directory, seg.name, moved)
        return True
