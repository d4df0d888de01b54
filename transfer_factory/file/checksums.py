"""Payload checksums of many objects for the FileStore, and the chunks a big batch is cut into.

The checksum is XXH3 (``segments.payload_checksum``), tens of GB/s on one core.  With CRC32
(format 1) a helper thread checksummed the next chunk while this one was read or written, since
zlib lets go of the GIL; XXH3 is faster than that hand-off, so every checksum is computed on the
calling thread.  ``checksums_at`` checksums many single-buffer objects in one call: a C loop over
XXH3 bound from xxhash's own library, the GIL let go (``XXH3_DIRECT``), else one call of
``xxh3_64_intdigest`` per object from C (at 16 KiB a Python call per object cost half as much as
hashing it); ``buffers_checksum`` checksums one object of several buffers.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
from bisect import bisect_left
from itertools import accumulate
from typing import Callable, Iterable, Sequence

import xxhash

from transfer_factory.file import _records
from transfer_factory.file.segments import payload_checksum

logger = logging.getLogger("transfer_factory.file.store")

CHUNK_MIN = 1 << 20                   # a batch is cut into chunks of at least this
CHUNK_MAX = 8 << 20                   # and at most this (or an eighth of the batch)

_XXH3 = xxhash.xxh3_64_intdigest


def _bind_xxh3() -> str | None:
    """The xxhash wheel's extension exports XXH3_64bits_withSeed_dispatch, which picks AVX2 or
    AVX-512 at run time (twice the speed of the SSE2 XXH3_64bits_withSeed, its fallback): bound,
    the checksums of a batch are one C loop with the GIL let go (else one Python call each).
    Kept only if it gives xxh3_64_intdigest's answers on a probe, so that another build of
    xxhash can cost speed, never a wrong checksum.  Returns the name of the function bound."""
    try:
        path = importlib.import_module(xxhash.xxh3_64_intdigest.__module__).__file__
    except (ImportError, AttributeError, TypeError):
        return None
    bound = _records.bind_xxh3(path) if path else False
    if not bound:
        return None
    probe = bytes(range(256)) * 5
    buf = ctypes.create_string_buffer(probe, len(probe))
    sizes = [0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, len(probe)]
    ptrs = [ctypes.addressof(buf)] * len(sizes)
    if _records.checksums(_XXH3, ptrs, sizes) != [_XXH3(probe[:n]) & 0xFFFFFFFF for n in sizes]:
        logger.warning("file store: XXH3 from %s disagrees with xxhash; checksums go through Python", path)
        _records.bind_xxh3(None)
        return None
    return bound


XXH3_BOUND = _bind_xxh3()  # the C function the checksums call directly, or None (through Python)
XXH3_DIRECT = XXH3_BOUND is not None


def checksums_at(ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """``payload_checksum`` of each object that is one buffer of ``sizes[i]`` bytes at ``ptrs[i]``."""
    return _records.checksums(_XXH3, ptrs, sizes)


def buffers_checksum(view_of: Callable[[int, int], memoryview], ptrs: Sequence[int], sizes: Sequence[int]) -> int:
    """``payload_checksum`` of one object spread over buffers ``ptrs[i]`` of ``sizes[i]`` bytes
    (``view_of(ptr, size)`` makes their views): the multi-buffer reads and writes."""
    return payload_checksum([view_of(p, s) for p, s in zip(ptrs, sizes) if s])


def chunked(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges cutting objects of ``sizes`` bytes into chunks (a chunk ends with
    the object that takes it to the target size)."""
    ends = list(accumulate(sizes))
    n = len(ends)
    target = min(CHUNK_MAX, max(CHUNK_MIN, (ends[-1] if n else 0) // 8))
    out, start, base = [], 0, 0
    while start < n:
        end = bisect_left(ends, base + target, start) + 1
        if end > n:
            end = n
        out.append((start, end))
        start, base = end, ends[end - 1]
    return out
