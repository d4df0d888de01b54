"""Payload checksums of many objects for the FileStore.

The checksum is XXH3 (``file_segments.payload_checksum``), tens of GB/s on one core.  With CRC32
(format 1) a helper thread checksummed the next chunk while this one was read or written, since
zlib lets go of the GIL; XXH3 is faster than the hand-off and keeps the GIL, so the helper is off
(``_HELPERS = 0``) and the pipelining below degrades to computing each range in turn.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

from .file_segments import payload_checksum

PARALLEL_BYTES = 1 << 20
CHUNK_MIN = 1 << 20                   # a pipelined batch is cut into chunks of at least this
CHUNK_MAX = 8 << 20                   # and at most this (or an eighth of the batch)
_HELPERS = 0  # see the module docstring


crc_of = payload_checksum


def crcs_of(view_lists) -> list[int]:
    return [crc_of(views) for views in view_lists]


def nbytes(view_lists) -> int:
    return sum(len(v) for views in view_lists for v in views)


def chunked(sizes: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges cutting objects of ``sizes`` bytes into pipeline chunks."""
    total = sum(sizes)
    target = min(CHUNK_MAX, max(CHUNK_MIN, total // 8))
    out, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= target:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


class Later:
    """CRCs handed to the helper; ``get`` takes them back, computing them itself if the helper
    has not started on them yet."""
    __slots__ = ("view_lists", "future")

    def __init__(self, view_lists, future: Future | None) -> None:
        self.view_lists, self.future = view_lists, future

    def get(self) -> list[int]:
        if self.future is None or self.future.cancel():
            return crcs_of(self.view_lists)
        return self.future.result()


class Checksummer:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _helper(self) -> ThreadPoolExecutor | None:
        if not _HELPERS or self._closed:
            return None
        with self._lock:
            if self._pool is None and not self._closed:
                self._pool = ThreadPoolExecutor(max_workers=_HELPERS, thread_name_prefix="file-store-crc")
            return self._pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def later(self, view_lists) -> Later:
        """Starts the CRCs of ``view_lists`` on the helper (or leaves them to ``get``)."""
        pool = self._helper() if nbytes(view_lists) >= PARALLEL_BYTES // 8 else None
        try:
            return Later(view_lists, pool.submit(crcs_of, view_lists) if pool is not None else None)
        except RuntimeError:                                   # shut down meanwhile
            return Later(view_lists, None)

    def all(self, view_lists) -> list[int]:
        """The CRC of each object (its views in order); a big batch split over two threads."""
        total = nbytes(view_lists)
        if total < PARALLEL_BYTES or len(view_lists) < 2:
            return crcs_of(view_lists)
        acc, cut = 0, 0
        for cut, views in enumerate(view_lists):
            acc += sum(len(v) for v in views)
            if acc * 2 >= total:
                break
        cut = max(1, cut)
        head = self.later(view_lists[:cut])
        tail = crcs_of(view_lists[cut:])
        return head.get() + tail

    def stream(self, view_lists, ranges: list[tuple[int, int]]) -> Iterator[list[int]]:
        """The CRCs of each range of objects in turn; while the caller works on one range (writes
        it), the helper computes the next."""
        if len(ranges) < 2 or nbytes(view_lists) < PARALLEL_BYTES:
            for a, b in ranges:
                yield crcs_of(view_lists[a:b])
            return
        a, b = ranges[0]
        current = self.all(view_lists[a:b])
        for k in range(len(ranges)):
            nxt = self.later(view_lists[ranges[k + 1][0]:ranges[k + 1][1]]) if k + 1 < len(ranges) else None
            yield current
            if nxt is not None:
                current = nxt.get()
