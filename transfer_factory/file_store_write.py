"""The FileStore's writes and deletes (file_store.py has the design): planning a batch against
the capacity and its object groups, the group commit (one write, one sync), and dead marks.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from .file_segments import DEAD, HEADER_SIZE, Entry, header_crc, lock_shared, pack_header, parse_header, unlock, \
    unpack_header
from .file_checksums import chunked
from .file_space import group_of
from .file_store_io import valid_ptr, valid_size
from .kvcache_storage import CODE_NAMES, INVALID, NO_SPACE, OK, UNAVAILABLE

logger = logging.getLogger("transfer_factory.file_store")


class WriteMixin:
    # ------------------------------------------------------------------------------------ writes
    def _set_batch(self, keys: Sequence[str], ptr_lists: list[list[int]], size_lists: list[list[int]]) -> list[int]:
        """Stores each object; a block's objects (one group) are stored all or none.

        The CTM writes a block's K and V (and scales) in one batch and counts the block only when
        every kind is present.  A group with a failed member is useless, so its other members
        report the failure too and are not written (or are removed when already stored).  Left in
        place such an orphan K would be refreshed by every retry of the block ("already stored")
        and so never evicted, while its V kept failing (issue 8)."""
        n = len(keys)
        if not self._usable():
            return [UNAVAILABLE] * n
        self._maybe_refresh()
        out = [OK] * n
        digests: list[bytes | None] = [self._digest(k) if isinstance(k, str) and k else None for k in keys]
        groups = [group_of(k) for k in keys]
        failed: dict[str, int] = {}                   # group -> the code of its first failed member
        members: dict[str, list[int]] = {}            # group -> indexes of its members reported OK
        plan: dict[bytes, tuple[int, list[memoryview], int]] = {}   # digest -> (index, views, payload_len)
        keep: set[bytes] = set()                      # digests this batch stored or relies on: never evicted
        reserved = 0
        with self._lock:
            for i, key in enumerate(keys):
                group = groups[i]
                if group is not None and group in failed:
                    out[i] = failed[group]
                    continue
                code, size = self._plan_one(key, digests[i], ptr_lists[i], size_lists[i], plan, keep, i)
                out[i] = code
                reserved += size
                if code == OK:
                    keep.add(digests[i])
                    if group is not None:
                        members.setdefault(group, []).append(i)
                elif group is not None:
                    failed[group] = code
            doomed: list[tuple[bytes, Entry]] = []
            reserved -= self._unplan_failed(keys, digests, out, failed, members, plan, doomed)
        if plan:
            err = self._commit(plan, keep, reserved)
            if err is not None:
                code = NO_SPACE if getattr(err, "errno", None) in self.full_errnos else UNAVAILABLE
                for i, _, _ in plan.values():
                    out[i] = code
                    if groups[i] is not None:
                        failed.setdefault(groups[i], code)
                logger.warning("file store %s: cannot write %d objects (%d bytes): %s", self.directory, len(plan),
                               sum(length for _, _, length in plan.values()), err)
                with self._lock:
                    self._unplan_failed(keys, digests, out, failed, members, {}, doomed)
        for d, e in doomed:
            self._mark_dead(d, e)
        self._note_blocks(digests, keys, [code == OK for code in out], groups)
        return out

    def _plan_one(self, key: Any, d: bytes | None, ptrs: list[int], sizes: list[int],
                  plan: dict, keep: set[bytes], i: int) -> tuple[int, int]:
        """(code, bytes reserved) for one object of a batch; the caller holds the lock."""
        if (d is None or not ptrs or len(ptrs) != len(sizes)
                or not all(map(valid_ptr, ptrs)) or not all(map(valid_size, sizes))):
            return INVALID, 0
        length = sum(sizes)
        if length == 0:
            return INVALID, 0
        total = HEADER_SIZE + length
        if total > self.capacity_bytes:
            logger.warning("file store %s: object %r of %d bytes exceeds the capacity of %d bytes",
                           self.directory, key, total, self.capacity_bytes)
            return NO_SPACE, 0
        if d in plan:                                 # the same key twice in one batch: written once
            return OK, 0
        e = self._index.get(d)
        if e is not None and e.length == length and self._header_is(e, d) is True:
            self._index.move_to_end(d)                # already stored: refreshed, nothing written
            return OK, 0
        if e is not None:
            self._drop_entry_locked(d)                # another size, or no longer on disk: write anew
        if self._evict_locked(total, keep) < 0:
            logger.warning("file store %s: no room for %r (%d bytes): the capacity of %d bytes is held by "
                           "objects of the same batch", self.directory, key, total, self.capacity_bytes)
            return NO_SPACE, 0
        self._used += total                           # reserved until the commit enters the record
        plan[d] = (i, [self._views(p, s) for p, s in zip(ptrs, sizes) if s], length)
        return OK, total

    def _unplan_failed(self, keys, digests, out, failed, members, plan, doomed) -> int:
        """Members of failed groups reported OK so far report the group's failure: dropped from the
        plan (returns the bytes no longer reserved) or, when already stored, forgotten and added to
        ``doomed`` to be marked dead once the lock is let go.  The caller holds the lock."""
        released = 0
        for group, code in failed.items():
            for i in members.pop(group, ()):
                out[i] = code
                d = digests[i]
                if d in plan:
                    _, _, length = plan.pop(d)
                    released += HEADER_SIZE + length
                    continue
                e = self._drop_entry_locked(d)
                if e is not None:
                    doomed.append((d, e))
        self._used -= released
        if failed and released:
            logger.warning("file store %s: %d blocks not stored (%s); their other objects are not stored either "
                           "so no block is left incomplete", self.directory, len(failed),
                           ", ".join(sorted({CODE_NAMES.get(c, str(c)) for c in failed.values()})))
        return released

    def _commit(self, plan: dict, keep: set[bytes], reserved: int) -> OSError | None:
        """Appends the planned records with one write and one sync (retrying once after a full
        disk made room), then enters them in the index; the error when the write failed."""
        digests = list(plan)
        views = [plan[d][1] for d in digests]
        lengths = [plan[d][2] for d in digests]
        total = sum(lengths) + HEADER_SIZE * len(lengths)
        ranges = chunked([HEADER_SIZE + n for n in lengths])
        records: list = []

        def chunks():
            # Records chunk by chunk, each checksummed just before it is written.
            for (a, b), crcs in zip(ranges, self._checksums.stream(views, ranges)):
                chunk = [(pack_header(lengths[i], crc, digests[i]), views[i], lengths[i], crc)
                         for i, crc in zip(range(a, b), crcs)]
                records.extend(chunk)
                yield chunk

        with self._wlock:
            try:
                made = chunks()
                try:
                    seg, offsets = self._append(made, total)
                except OSError as exc:
                    if exc.errno not in self.full_errnos or not self._make_room(reserved, keep, exc.errno):
                        raise
                    for _ in made:                                 # the chunks the failed write did not reach
                        pass
                    seg, offsets = self._append([records], total)  # once: then fail cleanly
            except OSError as exc:
                with self._lock:
                    self._used -= reserved
                return exc
            with self._lock:
                self._used -= reserved
                for d, (header, _, length, crc), off in zip(digests, records, offsets):
                    self._add_entry_locked(d, Entry(seg, off, length, crc, header_crc(header)))
            self._reclaim()
            self._bury()
        return None

    # ------------------------------------------------------------------------------------ deletes
    def _mark_dead(self, d: bytes, e: Entry) -> bool | None:
        """Writes the dead magic over ``e``'s record if it is still ``d``'s live record: True when
        marked, False when it was not live any more, None when its segment has been reclaimed.
        Takes _wlock: call it without holding _lock."""
        seg = e.seg
        with self._wlock:
            with self._lock:
                if seg.closed:
                    return None
                self._pin(seg)                            # its fd stays this file's until unpinned
            try:
                if not seg.active:                        # the active one is held shared already
                    lock_shared(seg.fd)                   # waits out a compaction of it elsewhere
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
                with self._lock:
                    self._unpin(seg)

    def _header_is(self, e: Entry, d: bytes) -> bool | None:
        """True when ``e``'s record on disk is still ``d``'s live record, False when it is dead or
        another record, None when its header is damaged or unreadable."""
        try:
            raw = os.pread(e.seg.fd, HEADER_SIZE, e.offset)
        except OSError:
            return None
        if len(raw) == HEADER_SIZE and unpack_header(raw) == e.fields(d):
            return True
        return False if parse_header(raw) is not None else None
