"""Fault in the memory a Mooncake client mounts, once, right after ``setup``.

Why: Mooncake 0.3.13 allocates a client's global segment with ``aligned_alloc`` and never
touches it, so the first write of every 4 KiB page of the segment takes a page fault (the
kernel zeroes the page) in the process that owns the segment: on loopback TCP the owner's
transfer thread ``recv``s a put's bytes straight into the segment and faults on every page,
while a get only ``send``s pages already written.  Measured with 512 KiB objects, 128 MiB per
batch, two segment-owning processes: a put took exactly one minor fault per 4 KiB page in the
owners (``/proc/<pid>/stat`` minflt, 32768 per 128 MiB) and ran at 0.4x the get; with the
segment faulted in beforehand it took none and ran at 0.64-0.90x the get (medians of 5, on a
shared 2-core machine; 2 MiB pages did no better within the noise).

How: the segment's address is not exposed by the client, so ``new_anonymous_ranges`` compares
the process's private anonymous writable mappings before and after ``setup``; every range that
appeared and is at least as large as the segment holds it (glibc maps an allocation that large
by itself; the kernel may merge it with a neighbouring mapping that appeared meanwhile, such as
the client's local buffer).  ``prefault`` then faults every page in (``MADV_POPULATE_WRITE``,
Linux 5.14+), in mode "hugepage" after asking for transparent huge pages (``MADV_HUGEPAGE``;
without effect where THP is off).  Neither changes a byte: populating for write only
does now what the first write would do, so it is safe while peers already write into the
mounted segment.  A kernel without ``MADV_POPULATE_WRITE`` is logged and left as it is (no
touching by hand: that would race with peers' writes).

Cost: the segment becomes resident at once (it is memory lent to the pool, there to be used);
~0.35 s per GiB with 4 KiB pages, 2-3 s per GiB with huge pages (compaction), on the thread
that runs ``setup``, with the GIL released.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from typing import Sequence

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
MODES = ("populate", "hugepage", "off")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def anonymous_ranges(maps_path: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """Private anonymous writable mappings of this process, [start, end), sorted."""
    out = []
    try:
        with open(maps_path, encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                # start-end perms offset dev inode [path]; anonymous: inode 0 and no path
                if len(fields) != 5 or not fields[1].startswith("rw") or fields[1][3] != "p" or fields[4] != "0":
                    continue
                start, _, end = fields[0].partition("-")
                out.append((int(start, 16), int(end, 16)))
    except OSError as e:
        log.warning("cannot read %s (%s): Mooncake's segment is not prefaulted", maps_path, e)
        return []
    return sorted(out)


def new_anonymous_ranges(before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]],
                         min_bytes: int) -> list[tuple[int, int]]:
    """The parts of ``after`` not covered by ``before``, each at least ``min_bytes`` long."""
    out = []
    old = sorted(before)
    for start, end in sorted(after):
        pieces = [(start, end)]
        for ostart, oend in old:
            if oend <= start or ostart >= end:
                continue
            nxt = []
            for a, b in pieces:
                if oend <= a or ostart >= b:
                    nxt.append((a, b))
                    continue
                if a < ostart:
                    nxt.append((a, ostart))
                if oend < b:
                    nxt.append((oend, b))
            pieces = nxt
        out += [(a, b) for a, b in pieces if b - a >= min_bytes]
    return out


def prefault(ranges: Sequence[tuple[int, int]], mode: str = "populate") -> dict[str, float]:
    """Fault the ranges in (page-aligned).  Returns what it did: bytes populated, seconds,
    whether huge pages were asked for; failures are logged, never raised."""
    if mode not in MODES:
        raise ValueError(f"prefault mode {mode!r} must be one of {MODES}")
    done = {"bytes": 0, "seconds": 0.0, "hugepage": 0}
    if mode == "off":
        return done
    page = mmap.PAGESIZE
    start_t = time.monotonic()
    for start, end in ranges:
        start, end = (start + page - 1) // page * page, end // page * page
        if end <= start:
            continue
        if mode == "hugepage":
            if _libc.madvise(start, end - start, MADV_HUGEPAGE) == 0:
                done["hugepage"] = 1
            # EINVAL: a kernel without THP; the pages are faulted in at 4 KiB below
        if _libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            log.warning("madvise(MADV_POPULATE_WRITE) on %#x+%d failed: %s; Mooncake's segment stays lazily "
                        "faulted (puts into it are slower)", start, end - start, _strerror(err))
            continue
        done["bytes"] += end - start
    done["seconds"] = time.monotonic() - start_t
    return done


def _strerror(err: int) -> str:
    return f"{os.strerror(err)} (errno {err})"
