"""The FileStore's writes and deletes (store.py has the design): planning a batch against
the capacity and its object groups, the group commit (one write, one sync), and dead marks.

The commit works batch-wide: the checksums, headers and the vectored write of a chunk of records
are one call each into ``_records`` (no per-record memoryview, header or tuple in Python), so
that at 16 KiB objects the Python cost per record stays below the cost of copying it.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from itertools import accumulate
from typing import Any, Iterable, Sequence

from transfer_factory.file import _records
from transfer_factory.file.checksums import buffers_checksum, checksums_at, chunked
from transfer_factory.file.index import Index, key_digest
from transfer_factory.file.log import SegmentLog
from transfer_factory.file.segments import HEADER_SIZE, Entry, Segment, record_state
from transfer_factory.file.space import SpacePolicy
from transfer_factory.file.store_io import FULL_ERRNOS, Views, buffers_length, fsync_dir
from transfer_factory.keys import KINDS
from transfer_factory.log_tags import key_tag
from transfer_factory.kvcache_storage import (CODE_NAMES, INVALID, NOT_FOUND, NO_SPACE, OK, TIMEOUT, UNAVAILABLE,
                                              current_commit_lease)

logger = logging.getLogger("transfer_factory.file.store")


class Durability:
    """Which bytes of other processes' segments this instance knows durable (issue 24 item 12).

    A record another process appended is visible (scanned from the page cache) before its writer's
    fdatasync, and that writer may be paused or die before it: answering OK (``batch_set``) or 1
    (``exists``) for such a record acknowledged bytes a power cut loses.  So before relying on one,
    the store fdatasyncs its segment (fdatasync flushes the file's dirty pages whoever wrote them),
    and the directory the first time (the segment's name may not be durable either).  How far each
    segment is known durable is remembered, so the hot path pays one sync per segment and growth,
    not per key.  This instance's own segments are durable by construction (every append syncs)."""

    def __init__(self, log: SegmentLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._synced: dict[Segment, int] = {}   # another's segment -> bytes from its start known durable

    def needed(self, e: Entry) -> bool:
        """Whether relying on ``e`` needs a sync first."""
        if not self._log.fsync or e.seg.own:
            return False
        return self._synced.get(e.seg, -1) < e.offset + e.size

    def ensure(self, entries: Iterable[Entry]) -> None:
        """Syncs the segments of ``entries`` not yet known durable past them.  A failed sync is logged
        and leaves them not known durable (``needed`` stays True: the callers do not rely on them)."""
        segs = {e.seg for e in entries if self.needed(e)}
        for seg in segs:
            if not self._log.pin_open(seg):
                continue       # forgotten meanwhile (reclaimed or cleared): its entries are misses now
            try:
                first = seg not in self._synced
                size = os.fstat(seg.fd).st_size    # what was written before the sync is durable after it
                os.fdatasync(seg.fd)
                if first:
                    fsync_dir(self._log.directory)
            except OSError as exc:
                logger.warning("file store %s: cannot make segment %s of another process durable: %s; its "
                               "records are not counted as stored", self._log.directory, seg.name, exc)
                continue
            finally:
                self._log.unpin(seg)
            with self._lock:
                self._synced[seg] = max(self._synced.get(seg, 0), size)
        if segs:
            with self._lock:                      # forget segments gone (few: dozens per directory)
                for seg in [s for s in self._synced if s.closed]:
                    del self._synced[seg]


class Writer:
    """``batch_set[_multi]`` and ``delete`` over one store's index, segment log and space policy."""

    def __init__(self, index: Index, log: SegmentLog, space: SpacePolicy, views: Views) -> None:
        self._index = index
        self._log = log
        self._space = space
        self._views = views
        self.directory = log.directory
        self.durability = Durability(log)
        self.closed = False                       # set by FileStore.close: a call still running commits nothing

    # ------------------------------------------------------------------------------------ writes
    def set_batch(self, keys: Sequence[str], ptr_lists: Sequence, size_lists: Sequence, multi: bool) -> list[int]:
        """Stores each object (with ``multi`` each has a list of buffers, else one pointer and one
        size); a block's objects (one group) are stored all or none.

        The CTM writes a block's K and V (and scales) in one batch and counts the block only when
        every kind is present.  A group with a failed member is useless, so its other members
        report the failure too and are not written (or are removed when already stored).  Left in
        place such an orphan K would be refreshed by every retry of the block ("already stored")
        and so never evicted, while its V kept failing (issue 8)."""
        n = len(keys)
        self._log.maybe_refresh()
        out = [OK] * n
        digests: list[bytes | None] = _records.key_digests(keys)   # None: not a key
        self._sync_relied_on(digests)
        groups = _records.key_groups(keys, KINDS)   # object groups: stored all or none
        failed: dict[str, int] = {}                   # group -> the code of its first failed member
        plan: dict[bytes, int] = {}                   # digest -> its index in the batch, in write order
        keep: set[bytes] = set()                      # digests this batch stored or relies on: never evicted
        reserved = 0                                  # bytes the index counts for the plan
        index = self._index
        with index.lock:
            if not multi:
                keep, reserved = self._plan_simple(digests, ptr_lists, size_lists, plan)
            for i, d in enumerate(digests if not plan else ()):
                group = groups[i]
                if group is not None and group in failed:
                    out[i] = failed[group]
                    continue
                length = buffers_length(ptr_lists[i], size_lists[i], multi)
                total = HEADER_SIZE + length
                if (length > 0 and d is not None and d not in index and d not in plan
                        and index.reserve(total)):
                    plan[d] = i                           # the common case: a new key that fits
                    code = OK
                else:
                    code, total = self._plan_one(keys[i], d, length, plan, keep, i)
                out[i] = code
                reserved += total
                if code == OK:
                    keep.add(d)
                elif group is not None:
                    failed[group] = code
            doomed: list[tuple[bytes, Entry]] = []
            reserved -= self._unplan_failed(digests, groups, out, failed, plan, ptr_lists, size_lists, multi, doomed)
        if plan:
            err = self._commit(plan, keep, reserved, ptr_lists, size_lists, multi)
            if err is not None:
                code = (NO_SPACE if getattr(err, "errno", None) in FULL_ERRNOS
                        else TIMEOUT if isinstance(err, TimeoutError) else UNAVAILABLE)
                for i in plan.values():
                    out[i] = code
                    if groups[i] is not None:
                        failed.setdefault(groups[i], code)
                logger.warning("file store %s: cannot write %d objects (%d bytes): %s", self.directory, len(plan),
                               sum(buffers_length(ptr_lists[i], size_lists[i], multi) for i in plan.values()), err)
                with index.lock:
                    self._unplan_failed(digests, groups, out, failed, {}, ptr_lists, size_lists, multi, doomed)
        for d, e in doomed:
            self._log.mark_dead(d, e)
        index.note_blocks(digests, keys, [code == OK for code in out], groups)
        return out

    def _sync_relied_on(self, digests: list) -> None:
        """Makes durable the records of other processes this batch may count as stored (``Durability``),
        before planning and outside the index lock: a sync may take a while.  Nothing to do (one
        set operation) when no key of the batch is indexed, the common write of new blocks."""
        index = self._index
        with index.lock:
            if index.none_of(filter(None, digests)):
                return
            entries = [e for e in map(index.get, digests) if e is not None and self.durability.needed(e)]
        if entries:
            self.durability.ensure(entries)

    def _plan_simple(self, digests: list, ptrs: Sequence, sizes: Sequence, plan: dict) -> tuple[set[bytes], int]:
        """The common batch planned in bulk: every object valid, one buffer each, no key twice,
        none stored yet, all fitting without eviction.  Fills ``plan`` and returns the digests to
        keep and the bytes reserved; leaves ``plan`` empty (and returns (set(), 0)) when the batch
        is not that simple, and the caller plans object by object.  The caller holds the lock."""
        n = len(digests)
        if not n or None in digests:
            return set(), 0
        total = _records.payload_bytes(ptrs, sizes) + HEADER_SIZE * n
        if total <= HEADER_SIZE * n:
            return set(), 0
        keep = set(digests)
        if len(keep) != n or not self._index.none_of(keep) or not self._index.reserve(total):
            return set(), 0                           # reserved, when it fits, until the commit enters them
        plan.update(zip(digests, range(n)))
        return keep, total

    def _plan_one(self, key: Any, d: bytes | None, length: int, plan: dict, keep: set[bytes],
                  i: int) -> tuple[int, int]:
        """(code, bytes reserved) for one object of a batch that is not simply a new key that
        fits (``length`` -1 when its buffers are invalid); the caller holds the lock."""
        if d is None or length <= 0:
            return INVALID, 0
        total = HEADER_SIZE + length
        index = self._index
        if total > index.capacity_bytes:
            logger.warning("file store %s: object %s of %d bytes exceeds the capacity of %d bytes",
                           self.directory, key_tag(key), total, index.capacity_bytes)  # never the key
            return NO_SPACE, 0
        if d in plan:                                 # the same key twice in one batch: written once
            return OK, 0
        e = index.get(d)
        if (e is not None and e.length == length and record_state(e, d) is True
                and not self.durability.needed(e)):  # one that could not be synced is written anew
            index.touch(d)                            # already stored: refreshed, nothing written
            return OK, 0
        if e is not None:
            index.drop(d)                             # another size, or no longer on disk: write anew
        if index.evict(total, keep) < 0:
            logger.warning("file store %s: no room for object %s (%d bytes): the capacity of %d bytes is held "
                           "by objects of the same batch", self.directory, key_tag(key), total, index.capacity_bytes)
            return NO_SPACE, 0
        index.force_reserve(total)                    # reserved until the commit enters the record
        plan[d] = i
        return OK, total

    def _unplan_failed(self, digests, groups, out, failed, plan, ptr_lists, size_lists, multi, doomed) -> int:
        """Members of failed groups reported OK so far report the group's failure: dropped from the
        plan (returns the bytes no longer reserved) or, when already stored, forgotten and added to
        ``doomed`` to be marked dead once the lock is let go.  The caller holds the lock."""
        if not failed:
            return 0
        released = 0
        for i, group in enumerate(groups):
            if group is None or out[i] != OK or group not in failed:
                continue
            out[i] = failed[group]
            d = digests[i]
            if d in plan:
                del plan[d]
                released += HEADER_SIZE + buffers_length(ptr_lists[i], size_lists[i], multi)
                continue
            e = self._index.drop(d)
            if e is not None:
                doomed.append((d, e))
        self._index.release(released)
        if released:
            logger.warning("file store %s: %d blocks not stored (%s); their other objects are not stored either "
                           "so no block is left incomplete", self.directory, len(failed),
                           ", ".join(sorted({CODE_NAMES.get(c, str(c)) for c in failed.values()})))
        return released

    def _commit(self, plan: dict, keep: set[bytes], reserved: int, ptr_lists: Sequence, size_lists: Sequence,
                multi: bool) -> OSError | None:
        """Appends the planned records with one write and one sync (retrying once after a full
        disk made room), then enters them in the index; the error when the write failed."""
        digests = list(plan)
        order = list(plan.values())
        if multi:
            counts = [len(ptr_lists[i]) for i in order]
            ptrs = [p for i in order for p in ptr_lists[i]]
            sizes = [s for i in order for s in size_lists[i]]
            lengths = [sum(size_lists[i]) for i in order]
            firsts = [0, *accumulate(counts)]         # record k's buffers are ptrs[firsts[k]:firsts[k + 1]]
        elif len(order) == len(ptr_lists):                # the whole batch, in order (plan indexes ascend)
            counts = firsts = None
            ptrs, lengths = ptr_lists, size_lists
            sizes = lengths
        else:
            counts = firsts = None
            ptrs = [ptr_lists[i] for i in order]
            lengths = sizes = [size_lists[i] for i in order]
        total = sum(lengths) + HEADER_SIZE * len(lengths)
        ranges = chunked(map(HEADER_SIZE.__add__, lengths))
        made: list[tuple] = []

        def chunks():
            # Records chunk by chunk, each checksummed just before it is written (still in cache).
            for a, b in ranges:
                if firsts is None:
                    p, s, c = ptrs[a:b], sizes[a:b], None
                    crcs = checksums_at(p, s)
                else:
                    p, s, c = ptrs[firsts[a]:firsts[b]], sizes[firsts[a]:firsts[b]], counts[a:b]
                    crcs = [buffers_checksum(self._views, ptr_lists[i], size_lists[i]) for i in order[a:b]]
                chunk = (_records.pack_headers(digests[a:b], lengths[a:b], crcs), p, s, c, lengths[a:b], crcs)
                made.append(chunk)
                yield chunk

        index, log = self._index, self._log
        lease = current_commit_lease()
        with log.append_lock:
            # The commit point (DESIGN §3.8): past the task's deadline, or once the store is closed
            # (an RL clear), a call still running appends nothing, so nothing lands after the answer.
            refused = (OSError(errno.ESHUTDOWN, "the store is closed") if self.closed
                       else TimeoutError(errno.ETIMEDOUT, "past the task's deadline")
                       if lease is not None and not lease.begin() else None)
            if refused is not None:
                with index.lock:
                    index.release(reserved)
                return refused
            try:
                err = self._append_and_enter(chunks(), made, total, reserved, keep, digests, lengths)
            finally:
                if lease is not None:
                    lease.end()
            if err is None:                               # housekeeping, not this task's objects
                self._space.reclaim(index.capacity_bytes)
                self._space.bury()
        return err

    def _append_and_enter(self, gen, made: list, total: int, reserved: int, keep: set[bytes], digests: list,
                          lengths: Sequence[int]) -> OSError | None:
        """``_commit``'s write, one sync and index entries; append_lock held.  The error, if any."""
        index, log = self._index, self._log
        try:
            try:
                seg, offsets = log.append(gen, total)
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS or not self._space.make_room(reserved, keep, exc.errno):
                    raise
                for _ in gen:                                  # the chunks the failed write did not reach
                    pass
                seg, offsets = log.append(made, total)         # once: then fail cleanly
        except OSError as exc:
            with index.lock:
                index.release(reserved)
            return exc
        crcs = [c for chunk in made for c in chunk[5]]
        headers = b"".join(chunk[0] for chunk in made)
        with index.lock:
            index.release(reserved)
            index.add_run(seg, digests, offsets, lengths, crcs, headers)
        return None

    # ------------------------------------------------------------------------------------ deletes
    def delete(self, keys: Sequence[str]) -> list[int]:
        """Per key: 0 removed (its record marked dead on disk), ``NOT_FOUND`` when there was none."""
        index, log = self._index, self._log
        log.refresh()                                     # see the copies other processes stored
        out = []
        touched: set[Segment] = set()
        for key in keys:
            if not isinstance(key, str) or not key:
                out.append(INVALID)
                continue
            d = key_digest(key)
            code = NOT_FOUND
            for _ in range(2):                            # a second look if another process moved it
                with index.lock:
                    e = index.get(d)
                    if e is None:
                        break
                    index.drop(d)
                marked = log.mark_dead(d, e)
                if marked is None:                        # its segment was reclaimed: look again
                    log.refresh()
                    continue
                if marked:
                    code = OK
                    if e.seg not in touched and log.pin_open(e.seg):
                        touched.add(e.seg)
                break
            out.append(code)
        for seg in touched:
            try:
                log.sync(seg)
            except OSError as exc:
                logger.warning("file store %s: cannot sync deletes in %s: %s", self.directory, seg.name, exc)
            finally:
                log.unpin(seg)
        return out
