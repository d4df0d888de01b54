"""The FileStore's reads (file_store.py has the design): ``exists`` and ``batch_get[_multi]``.

A batch is read with one ``preadv`` per run of adjacent records of one segment (headers into a
scratch buffer, payloads straight into the callers' buffers), then checked: every header must be
byte for byte the one the index expects and every payload's CRC must match, or the key is a miss.
Checksums of large batches are computed on two threads (zlib releases the GIL).
"""
from __future__ import annotations

import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Sequence

from .file_segments import HEADER_SIZE, Entry, Segment, pack_header, parse_header
from .file_store_io import raw_view, read_all_at, valid_ptr, valid_size
from .kvcache_storage import BUFFER_TOO_SMALL, CORRUPT, INVALID, NOT_FOUND, UNAVAILABLE

logger = logging.getLogger("transfer_factory.file_store")

PARALLEL_CRC_BYTES = 1 << 20          # checksums of a batch at least this big are split over two threads
_SPLIT = max(1, min(2, os.cpu_count() or 1))


class _Read(NamedTuple):
    i: int
    d: bytes
    seg: Segment
    offset: int
    length: int
    crc: int
    views: list


class ReadMixin:
    # ------------------------------------------------------------------------------------ checksums
    def _crc_many(self, view_lists: list[list]) -> list[int]:
        """The CRC of each object (its views in order); big batches on two threads."""
        total = sum(len(v) for views in view_lists for v in views)
        if _SPLIT < 2 or total < PARALLEL_CRC_BYTES or len(view_lists) < 2 or self._closed:
            return [_crc(views) for views in view_lists]
        # Split at the object nearest half the bytes: the pool's thread takes the first part.
        acc, cut = 0, 0
        for cut, views in enumerate(view_lists):
            acc += sum(len(v) for v in views)
            if acc * 2 >= total:
                break
        cut = max(1, cut)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-store-crc")
        head = self._pool.submit(lambda: [_crc(views) for views in view_lists[:cut]])
        tail = [_crc(views) for views in view_lists[cut:]]
        return head.result() + tail

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
    def _get_batch(self, keys: Sequence[str], ptr_lists: list[list[int]], size_lists: list[list[int]]) -> list[int]:
        n = len(keys)
        if not self._usable():
            return [UNAVAILABLE] * n
        out = [NOT_FOUND] * n
        digests = [self._digest(k) if isinstance(k, str) and k else None for k in keys]
        with self._lock:
            missing = any(d is not None and d not in self._index for d in digests)
        if missing:
            self._refresh()                               # maybe another process stored them
        else:
            self._maybe_refresh()
        reads: list[_Read] = []
        with self._lock:
            for i, (d, ptrs, sizes) in enumerate(zip(digests, ptr_lists, size_lists)):
                if (d is None or not ptrs or len(ptrs) != len(sizes)
                        or not all(map(valid_ptr, ptrs)) or not all(map(valid_size, sizes))):
                    out[i] = INVALID
                    continue
                e = self._index.get(d)
                if e is None:
                    continue
                if e.length > sum(sizes):
                    out[i] = BUFFER_TOO_SMALL
                    continue
                views, left = [], e.length
                for ptr, size in zip(ptrs, sizes):
                    if left == 0:
                        break
                    take = min(size, left)
                    if take:
                        views.append(raw_view(ptr, take))
                    left -= take
                self._pin(e.seg)
                reads.append(_Read(i, d, e.seg, e.offset, e.length, e.crc, views))
        try:
            if reads:
                self._read_records(reads, out)
        finally:
            with self._lock:
                for r in reads:
                    self._unpin(r.seg)
        self._note_blocks(digests, keys, [code > 0 for code in out])
        return out

    def _read_records(self, reads: list[_Read], out: list[int]) -> None:
        reads.sort(key=lambda r: (r.seg.name, r.offset))
        scratch = memoryview(bytearray(HEADER_SIZE * len(reads)))
        whole = [False] * len(reads)
        j = 0
        while j < len(reads):
            seg, start = reads[j].seg, reads[j].offset
            bufs, k, end = [], j, start
            while k < len(reads) and reads[k].seg is seg and reads[k].offset == end:
                bufs.append(scratch[k * HEADER_SIZE:(k + 1) * HEADER_SIZE])
                bufs.extend(reads[k].views)
                end += HEADER_SIZE + reads[k].length
                k += 1
            try:
                got = read_all_at(seg.fd, bufs, start)
            except OSError as exc:
                logger.warning("file store %s: cannot read %s: %s", self.directory, seg.name, exc)
                for m in range(j, k):
                    out[reads[m].i] = UNAVAILABLE
                j = k
                continue
            for m in range(j, k):
                whole[m] = got >= reads[m].offset + HEADER_SIZE + reads[m].length - start
            j = k
        checked = [m for m in range(len(reads)) if whole[m]]
        crcs = dict(zip(checked, self._crc_many([reads[m].views for m in checked])))
        hits, gone, corrupt = [], [], []
        for m, r in enumerate(reads):
            if out[r.i] == UNAVAILABLE:
                continue
            if not whole[m]:                              # cut short by its writer's failed batch
                gone.append(r)
                continue
            raw = scratch[m * HEADER_SIZE:(m + 1) * HEADER_SIZE]
            if raw == pack_header(r.length, r.crc, r.d):
                if crcs[m] == r.crc:
                    out[r.i] = r.length
                    hits.append(r)
                else:
                    corrupt.append((r, "payload checksum mismatch", True))
                continue
            header = parse_header(raw)
            if header is None:
                corrupt.append((r, "damaged header", False))
            else:
                gone.append(r)                            # deleted or replaced by another process
        with self._lock:
            for r in hits:
                if self._index.get(r.d) is not None:
                    self._index.move_to_end(r.d)
            for r in gone + [c[0] for c in corrupt]:
                e = self._index.get(r.d)
                if e is not None and e.seg is r.seg and e.offset == r.offset:
                    self._drop_entry_locked(r.d)
        for r, reason, mark in corrupt:
            out[r.i] = CORRUPT
            logger.warning("file store %s: object at %s+%d is corrupt (%s); %s", self.directory, r.seg.name,
                           r.offset, reason, "marked dead" if mark else "forgotten")
            if mark:
                self._mark_dead(r.d, Entry(r.seg, r.offset, r.length, r.crc))


def _crc(views) -> int:
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc
