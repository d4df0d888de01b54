"""The FileStore's reads (file_store.py has the design): ``exists`` and ``batch_get[_multi]``.

A batch is read with one ``preadv`` per run of adjacent records of one segment (headers into a
scratch buffer, payloads straight into the callers' buffers), then checked: every header must be
byte for byte the one the index expects and every payload's checksum must match, or the key is a miss.
"""
from __future__ import annotations

import logging
from typing import Sequence

from .file_segments import _HEADER, FORMAT_VERSION, HEADER_SIZE, LIVE, Entry, parse_header
from .file_checksums import PARALLEL_BYTES, chunked
from .file_store_io import read_all_at, valid_ptr, valid_size
from .kvcache_storage import BUFFER_TOO_SMALL, CORRUPT, INVALID, NOT_FOUND, UNAVAILABLE

logger = logging.getLogger("transfer_factory.file_store")



class ReadMixin:
    # ------------------------------------------------------------------------------------ exists
    def exists(self, keys: Sequence[str]) -> list[int]:
        if not self._usable():
            return [UNAVAILABLE] * len(keys)
        self._maybe_refresh()
        out = []
        refreshed = False
        for key in keys:
            if not isinstance(key, str) or not key:
                out.append(INVALID)
                continue
            d = self._digest(key)
            with self._lock:
                e = self._index.get(d)
            if e is None and not refreshed:               # maybe another process stored it
                self._refresh()
                refreshed = True
                with self._lock:
                    e = self._index.get(d)
            if e is None:
                out.append(0)
                continue
            with self._lock:
                seg = e.seg
                self._pin(seg)
            try:
                state = self._header_is(e, d)             # still live on disk (another process may delete)
            finally:
                with self._lock:
                    self._unpin(seg)
            if state is not True:
                with self._lock:
                    if self._index.get(d) is e:
                        self._drop_entry_locked(d)
            out.append(1 if state else 0)
        return out

    # ------------------------------------------------------------------------------------ batch_get
    def _get_batch(self, keys: Sequence[str], ptr_lists: list, size_lists: list, multi: bool) -> list[int]:
        """Reads a batch; with ``multi`` each object has a list of buffers, else one."""
        n = len(keys)
        if not self._usable():
            return [UNAVAILABLE] * n
        out = [NOT_FOUND] * n
        digest = self._digest
        digests = [digest(k) if type(k) is str and k else None for k in keys]
        index, raw_view = self._index, self._views
        with self._lock:
            missing = any(d not in index for d in digests if d is not None)
        if missing:
            self._refresh()                               # maybe another process stored them
        else:
            self._maybe_refresh()
        # (segment name, offset, index in the batch, digest, segment, payload_len, crc, views)
        reads: list[tuple] = []
        with self._lock:
            for i, d in enumerate(digests):
                if multi:
                    ptrs, sizes = ptr_lists[i], size_lists[i]
                    ok = (ptrs and len(ptrs) == len(sizes) and all(map(valid_ptr, ptrs))
                          and all(map(valid_size, sizes)))
                    room = sum(sizes) if ok else 0
                else:
                    ptr, room = ptr_lists[i], size_lists[i]
                    ok = type(ptr) is int and ptr > 0 and type(room) is int and room >= 0
                if d is None or not ok:
                    out[i] = INVALID
                    continue
                e = index.get(d)
                if e is None:
                    continue
                if e.length > room:
                    out[i] = BUFFER_TOO_SMALL
                    continue
                if multi:
                    views, left = [], e.length
                    for ptr, size in zip(ptrs, sizes):
                        take = min(size, left)
                        if take:
                            views.append(raw_view(ptr, take))
                        left -= take
                else:
                    views = [raw_view(ptr, e.length)]
                seg = e.seg
                seg.pins += 1                             # its fd stays this file's until unpinned
                reads.append((seg.name, e.offset, i, d, seg, e.length, e.crc, views, e.hcrc))
        try:
            if reads:
                self._read_records(reads, out)
        finally:
            with self._lock:
                for r in reads:
                    self._unpin(r[4])
        self._note_blocks(digests, keys, [code > 0 for code in out])
        return out


    def _read_records(self, reads: list[tuple], out: list[int]) -> None:
        """One preadv per run of adjacent records (headers into a scratch buffer), then the checks."""
        reads.sort()                                      # by segment, then offset (batch indexes are unique)
        count = len(reads)
        scratch = bytearray(HEADER_SIZE * count)
        sv = memoryview(scratch)
        whole = [False] * count
        # Runs of adjacent records, cut into chunks for big batches; the checksums follow once
        # every chunk is read.
        sizes = [HEADER_SIZE + r[5] for r in reads]
        big = sum(sizes) >= PARALLEL_BYTES
        pieces = chunked(sizes) if big else [(0, count)]
        overlap = len(pieces) > 1
        pending = []                                      # (record indexes, CRCs later)
        for lo, hi in pieces:
            j = lo
            while j < hi:
                seg, start = reads[j][4], reads[j][1]
                bufs, k, end = [], j, start
                while k < hi and reads[k][4] is seg and reads[k][1] == end:
                    bufs.append(sv[k * HEADER_SIZE:(k + 1) * HEADER_SIZE])
                    bufs += reads[k][7]
                    end += sizes[k]
                    k += 1
                try:
                    got = start + read_all_at(seg.fd, bufs, start)
                except OSError as exc:
                    logger.warning("file store %s: cannot read %s: %s", self.directory, seg.name, exc)
                    for m in range(j, k):
                        out[reads[m][2]] = UNAVAILABLE
                    j = k
                    continue
                for m in range(j, k):
                    whole[m] = got >= reads[m][1] + sizes[m]
                j = k
            members = [m for m in range(lo, hi) if whole[m]]
            views = [reads[m][7] for m in members]
            pending.append((members, self._checksums.later(views) if overlap else views))
        crcs = {}
        for members, later in pending:
            crcs.update(zip(members, later.get() if overlap else self._checksums.all(later)))
        unpack = _HEADER.unpack_from
        hits, gone, corrupt = [], [], []
        for m, (_, offset, i, d, seg, length, crc, _, hcrc) in enumerate(reads):
            if out[i] == UNAVAILABLE:
                continue
            if not whole[m]:                              # cut short by its writer's failed batch
                gone.append(m)
                continue
            at = m * HEADER_SIZE
            if unpack(scratch, at) == (LIVE, FORMAT_VERSION, 0, length, crc, d, hcrc):   # as written, byte for byte
                if crcs[m] == crc:
                    out[i] = length
                    hits.append(d)
                else:
                    corrupt.append((m, "payload checksum mismatch", True))
            elif parse_header(sv[at:at + HEADER_SIZE]) is None:
                corrupt.append((m, "damaged header", False))
            else:
                gone.append(m)                            # deleted or replaced by another process
        index = self._index
        with self._lock:
            for d in hits:
                if d in index:
                    index.move_to_end(d)
            for m in gone + [c[0] for c in corrupt]:
                _, offset, _, d, seg, _, _, _, _ = reads[m]
                e = index.get(d)
                if e is not None and e.seg is seg and e.offset == offset:
                    self._drop_entry_locked(d)
        for m, reason, mark in corrupt:
            _, offset, i, d, seg, length, crc, _, hcrc = reads[m]
            out[i] = CORRUPT
            logger.warning("file store %s: object at %s+%d is corrupt (%s); %s", self.directory, seg.name, offset,
                           reason, "marked dead" if mark else "forgotten")
            if mark:
                self._mark_dead(d, Entry(seg, offset, length, crc, hcrc))
