"""The FileStore's reads (store.py has the design): ``exists`` and ``batch_get[_multi]``.

A batch is read with one vectored read per piece of a run of adjacent records of one segment
(headers into a scratch buffer, payloads straight into the callers' buffers), then checked: every
header must be byte for byte the one the index expects and every payload's checksum must match,
or the key is a miss.  The checks are batch-wide (one call checksums a piece, one packs the
headers it must equal); only a piece where something failed is looked at record by record.
"""
from __future__ import annotations

import logging
import operator
from bisect import bisect_left
from itertools import accumulate, islice
from typing import Iterator, NamedTuple, Sequence

from transfer_factory.file._records import key_digests, pack_headers, parse_headers, read_and_sum
from transfer_factory.file.checksums import XXH3_DIRECT, buffers_checksum, checksums_at
from transfer_factory.file.index import Index, key_digest
from transfer_factory.file.log import SegmentLog
from transfer_factory.file.segments import HEADER_SIZE, Entry, Segment, header_crc_of, record_state
from transfer_factory.file.store_io import Views, buffers_length, read_records
from transfer_factory.kvcache_storage import BUFFER_TOO_SMALL, CORRUPT, INVALID, NOT_FOUND, UNAVAILABLE

logger = logging.getLogger("transfer_factory.file.store")

PIECE_BYTES = 8 << 20                 # records read per call at most (one Python call, one scratch buffer)
SUB_PIECE_BYTES = 512 << 10           # read_and_sum checksums records after each of these: still in L2
GONE, BAD_PAYLOAD, BAD_HEADER = "gone", "payload", "header"


def _file_order(seg: Segment, offset: int) -> int:
    return id(seg) << 64 | offset


class Reader:
    """``exists`` and ``batch_get[_multi]`` over one store's index and segment log."""

    def __init__(self, index: Index, log: SegmentLog, views: Views) -> None:
        self._index = index
        self._log = log
        self._views = views
        self.directory = log.directory

    # ------------------------------------------------------------------------------------ exists
    def exists(self, keys: Sequence[str]) -> list[int]:
        index, log = self._index, self._log
        log.maybe_refresh()
        out = []
        refreshed = False
        for key in keys:
            if not isinstance(key, str) or not key:
                out.append(INVALID)
                continue
            d = key_digest(key)
            with index.lock:
                e = index.get(d)
            if e is None and not refreshed:               # maybe another process stored it
                log.refresh()
                refreshed = True
                with index.lock:
                    e = index.get(d)
            if e is None:
                out.append(0)
                continue
            log.pin(e.seg)
            try:
                state = record_state(e, d)                # still live on disk (another process may delete)
            finally:
                log.unpin(e.seg)
            if state is not True:
                with index.lock:
                    index.drop_if(d, e)
            out.append(1 if state else 0)
        return out

    # ------------------------------------------------------------------------------------ batch_get
    def get_batch(self, keys: Sequence[str], ptr_lists: Sequence, size_lists: Sequence, multi: bool) -> list[int]:
        """Reads a batch; with ``multi`` each object has a list of buffers, else one."""
        n = len(keys)
        out = [NOT_FOUND] * n
        digests = key_digests(keys)                       # None: not a key
        index, log = self._index, self._log
        log.maybe_refresh()
        # The records to read, as parallel lists (no tuple per record): batch index, and a snapshot
        # of the entry taken under the lock (a compaction may move it meanwhile), their segments
        # pinned under that same lock.
        with index.lock:
            found = self._select_all(digests, ptr_lists, size_lists, multi)
            missing = found is None and not index.contains_all(digests)
            if not missing:
                sel, segs, offs, lens, crcs, pinned = self._pinned(found, digests, ptr_lists, size_lists, multi, out)
        if missing:
            log.refresh()                                 # maybe another process stored them
            with index.lock:
                found = self._select_all(digests, ptr_lists, size_lists, multi)
                sel, segs, offs, lens, crcs, pinned = self._pinned(found, digests, ptr_lists, size_lists, multi, out)
        try:
            if sel:
                self._read_records(sel, segs, offs, lens, crcs, digests, ptr_lists, size_lists, multi, out,
                                   whole=found is not None)
        finally:
            for seg in pinned:
                log.unpin(seg)
        if not (found and found[5]):                      # else every block was known already
            index.note_blocks(digests, keys, [code > 0 for code in out])
        return out

    def _pinned(self, found, digests, ptr_lists, size_lists, multi, out) -> tuple:
        """The records to read (``_select_all``'s ``found``, else looked up one by one) and their
        segments, each distinct one pinned once (its fd stays this file's until unpinned), under
        the same hold of the lock as the lookup: (sel, segs, offs, lens, crcs, pinned)."""
        sel, segs, offs, lens, crcs = found[:5] if found else self._select(digests, ptr_lists, size_lists, multi, out)
        pinned = set(segs)
        for seg in pinned:
            self._log.pin(seg)
        return sel, segs, offs, lens, crcs, pinned

    def _select_all(self, digests, ptrs, sizes, multi) -> tuple | None:
        """The common batch looked up in bulk: every key stored, one valid buffer each, big
        enough.  (batch indexes, segments, offsets, lengths, checksums, whether every object's
        block is known), or None when the batch is not that simple.  The caller holds the lock."""
        if multi:
            return None
        found = self._index.select_all(digests, ptrs, sizes)   # one C pass over the entries
        return None if found is None else (list(range(len(digests))), *found)

    def _select(self, digests, ptr_lists, size_lists, multi, out) -> tuple:
        """``_select_all`` object by object: codes for invalid, missing or too-small ones go to
        ``out``, the others to the lists returned.  The caller holds the lock."""
        sel: list[int] = []
        segs: list = []
        offs: list[int] = []
        lens: list[int] = []
        crcs: list[int] = []
        get = self._index.get
        for i, d in enumerate(digests):
            room = buffers_length(ptr_lists[i], size_lists[i], multi)
            if d is None or room < 0:
                out[i] = INVALID
                continue
            e = get(d)
            if e is None:
                continue
            if e.length > room:
                out[i] = BUFFER_TOO_SMALL
                continue
            sel.append(i)
            segs.append(e.seg)
            offs.append(e.offset)
            lens.append(e.length)
            crcs.append(e.crc)
        return sel, segs, offs, lens, crcs

    def _read_records(self, sel, segs, offs, lens, crcs, digests, ptr_lists, size_lists, multi, out,
                      whole: bool = False) -> None:
        """One ``read_records`` per piece of a run of adjacent records (headers into a scratch
        buffer, payloads into the callers' buffers), then the piece's checks in bulk.  ``whole``:
        ``sel`` is every index of the batch in order."""
        count = len(sel)
        # File order: by offset within one segment (Segment compares by identity), else by both.
        keys = offs if segs.count(segs[0]) == count else list(map(_file_order, segs, offs))
        if not all(map(operator.lt, keys, islice(keys, 1, None))):
            order = sorted(range(count), key=keys.__getitem__)
            sel, segs, offs, lens, crcs = ([x[j] for j in order] for x in (sel, segs, offs, lens, crcs))
            whole = False
        ds = digests if whole else [digests[i] for i in sel]
        if multi:
            ptrs, sizes, counts, firsts = _split(sel, lens, ptr_lists, size_lists)
        else:
            ptrs, sizes, counts, firsts = ptr_lists if whole else [ptr_lists[i] for i in sel], lens, None, None
        hits: list[bytes] = []
        bad: list[tuple[int, str]] = []                   # (position, GONE / BAD_PAYLOAD / BAD_HEADER)
        for piece in _pieces(segs, offs, lens):
            self._check_piece(piece, sel, ds, lens, crcs, ptrs, sizes, counts, firsts, out, hits, bad, whole)
        index = self._index
        with index.lock:
            index.touch_all(hits)                         # most recently used
            for m, _ in bad:
                index.drop_if_at(ds[m], segs[m], offs[m])
        for m, why in bad:
            if why == GONE:
                continue                                  # deleted, replaced or cut off: a plain miss
            out[sel[m]] = CORRUPT
            mark = why == BAD_PAYLOAD
            logger.warning("file store %s: object at %s+%d is corrupt (%s); %s", self.directory, segs[m].name,
                           offs[m], "payload checksum mismatch" if mark else "damaged header",
                           "marked dead" if mark else "forgotten")
            if mark:                                      # its header is valid: no one may serve it again
                self._log.mark_dead(ds[m], Entry(segs[m], offs[m], lens[m], crcs[m], header_crc_of(ds[m], lens[m],
                                                                                                crcs[m])))

    def _check_piece(self, piece: "_Piece", sel, ds, lens, crcs, ptrs, sizes, counts, firsts, out, hits,
                     bad, whole: bool) -> None:
        """Reads the records of ``piece`` (adjacent in one segment) and checks them: a hit when the
        header read back is byte for byte the one the index expects and the payload's checksum
        matches; else (position, why) goes to ``bad``."""
        j, k, seg, start, end = piece
        scratch = bytearray(HEADER_SIZE * (k - j))
        if firsts is None:
            p, s, c = ptrs[j:k], sizes[j:k], None
        else:
            p, s, c = ptrs[firsts[j]:firsts[k]], sizes[firsts[j]:firsts[k]], counts[j:k]
        fused = c is None and XXH3_DIRECT
        try:
            if fused:                                     # checksummed in C as it is read, still in cache
                nread, sums = read_and_sum(seg.fd, start, scratch, p, s, SUB_PIECE_BYTES)
                got = start + nread
            else:
                got = start + read_records(seg.fd, start, scratch, p, s, c)
        except OSError as exc:
            logger.warning("file store %s: cannot read %s: %s", self.directory, seg.name, exc)
            for m in range(j, k):
                out[sel[m]] = UNAVAILABLE
            return

        def checksum(m: int) -> int:
            if firsts is None:
                return checksums_at([ptrs[m]], [sizes[m]])[0]
            a, b = firsts[m], firsts[m + 1]
            return buffers_checksum(self._views, ptrs[a:b], sizes[a:b])

        want = crcs[j:k]
        if got >= end:
            if not fused:
                sums = checksums_at(p, s) if c is None else [checksum(m) for m in range(j, k)]
            if sums == want and scratch == pack_headers(ds[j:k], lens[j:k], want):
                if whole:                                 # the common case: every record as written
                    out[j:k] = lens[j:k]                  # (sel is the whole batch in order)
                else:
                    for m in range(j, k):
                        out[sel[m]] = lens[m]
                hits += ds[j:k]
                return
        # Something failed: record by record.
        status = parse_headers(scratch, k - j)
        pos = start
        for m in range(j, k):
            at = (m - j) * HEADER_SIZE
            pos += HEADER_SIZE + lens[m]
            if got < pos:
                bad.append((m, GONE))                     # cut short by its writer's failed batch
            elif scratch[at:at + HEADER_SIZE] != pack_headers([ds[m]], [lens[m]], [crcs[m]]):
                bad.append((m, BAD_HEADER if status[m - j] == 0 else GONE))   # damaged, or deleted/replaced
            elif checksum(m) != crcs[m]:
                bad.append((m, BAD_PAYLOAD))
            else:
                out[sel[m]] = lens[m]
                hits.append(ds[m])


class _Piece(NamedTuple):
    first: int                                            # positions [first, end_pos) of the sorted records
    end_pos: int
    seg: Segment
    start: int                                            # their bytes [start, end) of the segment
    end: int


def _pieces(segs: list, offs: list[int], lens: list[int]) -> Iterator[_Piece]:
    """The pieces to read: runs of adjacent records of one segment, cut at PIECE_BYTES."""
    count = len(segs)
    ends = list(accumulate(map(HEADER_SIZE.__add__, lens), initial=offs[0]))   # if all were adjacent
    if segs.count(segs[0]) == count and ends[:-1] == offs:
        j = 0                                             # one run: cut by bytes only
        while j < count:
            k = min(max(bisect_left(ends, ends[j] + PIECE_BYTES, j + 1), j + 1), count)
            yield _Piece(j, k, segs[0], ends[j], ends[k])
            j = k
        return
    j = 0
    while j < count:
        seg, start = segs[j], offs[j]
        k, end = j, start
        while k < count and segs[k] is seg and offs[k] == end and (k == j or end - start < PIECE_BYTES):
            end += HEADER_SIZE + lens[k]
            k += 1
        yield _Piece(j, k, seg, start, end)
        j = k


def _split(sel, lens, ptr_lists, size_lists):
    """Flat (ptrs, sizes, buffers per record, first buffer of each record) for multi-buffer reads:
    each object's payload fills its buffers in order, the last one only as far as it needs."""
    ptrs: list[int] = []
    sizes: list[int] = []
    counts: list[int] = []
    firsts = [0]
    for i, length in zip(sel, lens):
        left, n = length, 0
        for ptr, size in zip(ptr_lists[i], size_lists[i]):
            take = min(size, left)
            if take:
                ptrs.append(ptr)
                sizes.append(take)
                n += 1
            left -= take
        counts.append(n)
        firsts.append(firsts[-1] + n)
    return ptrs, sizes, counts, firsts
