"""Payload checksums of many objects for the FileStore, and the chunks a big batch is cut into.

The checksum is XXH3 (``file_segments.payload_checksum``), tens of GB/s on one core.  With CRC32
(format 1) a helper thread checksummed the next chunk while this one was read or written, since
zlib lets go of the GIL; XXH3 is faster than that hand-off and keeps the GIL, so every checksum is
computed on the calling thread.  ``Checksummer`` keeps the calls of the readers and writers (a
checksum of a range now, or later, or one range after another) without any thread behind them.
"""
from __future__ import annotations

from typing import Iterator

from .file_segments import payload_checksum

PARALLEL_BYTES = 1 << 20              # a read batch this big is cut into chunks
CHUNK_MIN = 1 << 20                   # a batch is cut into chunks of at least this
CHUNK_MAX = 8 << 20                   # and at most this (or an eighth of the batch)


def crcs_of(view_lists) -> list[int]:
    return [payload_checksum(views) for views in view_lists]


def chunked(sizes: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges cutting objects of ``sizes`` bytes into chunks."""
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
    """The checksums of ``view_lists``, computed when ``get`` asks for them."""
    __slots__ = ("view_lists",)

    def __init__(self, view_lists) -> None:
        self.view_lists = view_lists

    def get(self) -> list[int]:
        return crcs_of(self.view_lists)


class Checksummer:
    def close(self) -> None:
        """Nothing to stop: no thread computes checksums."""

    def later(self, view_lists) -> Later:
        return Later(view_lists)

    def all(self, view_lists) -> list[int]:
        """The checksum of each object (its views in order)."""
        return crcs_of(view_lists)

    def stream(self, view_lists, ranges: list[tuple[int, int]]) -> Iterator[list[int]]:
        """The checksums of each range of objects in turn."""
        for a, b in ranges:
            yield crcs_of(view_lists[a:b])
