"""Digests of the blocks a prefill instance exposes, so a decode instance can check what it pulled
(DESIGN §3.11, "Digests"; issue 36 item 3).

A prefill rank computes, when the engine exposes a request's blocks, one XXH3-64 digest per block
and cache tensor (each layer's tensor of every block group: K, V, scales, a grouped layout's
tensors) into its *digest table*: a shared-memory segment of 64-bit words its engine created, which
a peer reads over the link's own transport (mapped on one host, registered memory for the Transfer
Engine).  The engine hands out one *region* of the table per handle (``DigestArena``); a region is

    word 0          tag: ``handle_id << 2 | 1`` once the rank wrote the region, 0 before
    word 1          the generation of the caches the digests were computed from
    word 2          n, the number of blocks
    words 3..3+n    the exposed block ids, in exposure order
    then            T x n digests, tensor-major (tensor t of block i at 3 + n + t * n + i)

where T is the rank's tensors per block (``tensor_count``).  The tag is stored last (a release
store with a full fence): a region a rank has not finished reads as unpublished.  A puller reads the
region *after* its bytes and *before* its second look at the exposure board: if the handle is
still LIVE then, the region was not handed to another handle (the engine reuses a region only
once its handle is no longer live), and the tag and generation bind it to that handle and memory,
so a stale region never validates.  A block whose received bytes do not digest to the source's
value is a failed block: never counted.
"""
from __future__ import annotations

import bisect
import threading
from concurrent.futures import Executor
from typing import Iterable, Sequence

import numpy as np

from ops import _shm_atomic
from transfer_factory.file import _records
from transfer_factory.file.checksums import XXH3_DIRECT

HEADER_WORDS = 3
TAG, GENERATION, COUNT = 0, 1, 2
WORD_BYTES = 8


class DigestMismatch(RuntimeError):
    """Received bytes that do not digest to the source's value; the message names peer and block."""


def region_words(blocks: int, tensors: int) -> int:
    """Words of a region of ``blocks`` blocks of ``tensors`` tensors each."""
    return HEADER_WORDS + blocks * (1 + tensors)


def table_words(num_blocks: int, tensors: int, handles: int) -> int:
    """A table with room for every block exposed twice at once (a shared prefix under two handles)
    and ``handles`` headers."""
    return 2 * num_blocks * (1 + tensors) + handles * HEADER_WORDS


def tag(handle_id: int) -> int:
    return (int(handle_id) << 2) | 1


def xxh3_address() -> int:
    """The address of the XXH3 function bound from xxhash (a C kernel that hashes what it copies
    calls it: ``ops/csrc/copy_digest.c``); raises where none is bound."""
    address = _records.xxh3_address()
    if not address:
        raise RuntimeError("P/D digests need XXH3 bound from the xxhash package's extension (xxhash >= 3.0)")
    return address


def digests_at(bases: np.ndarray, capacities: np.ndarray, stride: int, ids: Sequence[int], offset: int,
               nbytes: int) -> np.ndarray:
    """XXH3-64 of ``nbytes`` at ``offset`` into each block ``ids[i]`` of each tensor (``bases[r]``,
    blocks ``stride`` bytes apart): an int64 array of shape (rows, len(ids)).  One C call, the GIL
    let go; ids are checked against ``capacities`` first."""
    if not XXH3_DIRECT:
        raise RuntimeError("P/D digests need XXH3 bound from the xxhash package's extension (xxhash >= 3.0)")
    bases = np.ascontiguousarray(bases, dtype=np.int64)
    caps = np.ascontiguousarray(capacities, dtype=np.int64)
    ids_arr = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty((len(bases), len(ids_arr)), dtype=np.int64)
    _records.block_digests(bases, caps, int(stride), ids_arr, int(offset), int(nbytes), out)
    return out


PARALLEL_MIN_BYTES = 1 << 20  # below this, one call: handing work to a thread costs more than it saves


def digests_split(pool: Executor | None, parts: int, bases: np.ndarray, capacities: np.ndarray, stride: int,
                  ids: Sequence[int], offset: int, nbytes: int) -> np.ndarray:
    """``digests_at``, cut into ``parts`` calls run on ``pool`` (by tensors, or by blocks when there
    are fewer tensors than parts) once there is enough to hash: one core hashes cache memory at well
    under the copy's speed (4 KiB pages, a block at a time), several keep up with it."""
    rows = len(bases)
    if pool is None or parts <= 1 or rows * len(ids) * nbytes < PARALLEL_MIN_BYTES:
        return digests_at(bases, capacities, stride, ids, offset, nbytes)
    if rows >= parts:
        cuts = np.array_split(np.arange(rows), parts)
        futures = [pool.submit(digests_at, bases[c], capacities[c], stride, ids, offset, nbytes) for c in cuts]
        return np.vstack([f.result() for f in futures])
    cuts = [c.tolist() for c in np.array_split(np.asarray(ids, dtype=np.int64), parts) if len(c)]
    futures = [pool.submit(digests_at, bases, capacities, stride, c, offset, nbytes) for c in cuts]
    return np.hstack([f.result() for f in futures])


def write_region(table: np.ndarray, offset: int, handle_id: int, generation: int, ids: Sequence[int],
                 digests: np.ndarray) -> None:
    """Write one region of ``table`` (this rank's int64 words): ids and digests (T x n), then its
    tag, last."""
    n = len(ids)
    tensors = digests.shape[0] if n else 0
    end = offset + region_words(n, tensors)
    if offset < 0 or end > len(table):
        raise ValueError(f"digest region [{offset}, {end}) outside the table of {len(table)} words")
    _shm_atomic.store_fenced(table, offset + TAG, 0)  # unpublished while it is rewritten
    table[offset + GENERATION] = int(generation)
    table[offset + COUNT] = n
    table[offset + HEADER_WORDS:offset + HEADER_WORDS + n] = np.asarray(ids, dtype=np.int64)
    table[offset + HEADER_WORDS + n:end] = digests.reshape(-1)
    _shm_atomic.store_fenced(table, offset + TAG, tag(handle_id))


def read_region(words: np.ndarray, handle_id: int, generation: int, tensors: int, where: str
                ) -> tuple[dict[int, int], np.ndarray]:
    """The exposed blocks' positions (block id -> index) and digests (T x n) of a region read from a
    peer; raises ``DigestMismatch`` naming ``where`` when it is not this handle's, of this
    generation, or not complete."""
    if len(words) < HEADER_WORDS:
        raise DigestMismatch(f"{where}: digest region too short ({len(words)} words)")
    if int(words[TAG]) != tag(handle_id):
        raise DigestMismatch(f"{where}: no digests published for this handle (its region holds tag "
                             f"{int(words[TAG])}, not handle {handle_id}'s)")
    if int(words[GENERATION]) != generation:
        raise DigestMismatch(f"{where}: digests of generation {int(words[GENERATION])}, the link's is {generation}")
    n = int(words[COUNT])
    if len(words) != region_words(n, tensors):
        raise DigestMismatch(f"{where}: digest region of {len(words)} words does not hold {n} blocks of "
                             f"{tensors} tensors")
    ids = words[HEADER_WORDS:HEADER_WORDS + n]
    return {int(b): i for i, b in enumerate(ids)}, words[HEADER_WORDS + n:].reshape(tensors, n)


class DigestArena:
    """The engine's allocator of a table's words to handles (the same offsets on every rank: the
    ranks' tables are alike).  A region is given back once its handle is no longer live
    (``reclaim``), so no puller that still counts can read a region given to another handle."""

    def __init__(self, words: int):
        self.words = int(words)
        self._free: list[tuple[int, int]] = [(0, self.words)]  # (start, length), sorted, merged
        self._used: dict[int, tuple[int, int]] = {}  # handle id -> (start, length)
        self._lock = threading.Lock()

    def allocate(self, handle_id: int, nwords: int) -> int:
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= nwords:
                    if length == nwords:
                        del self._free[i]
                    else:
                        self._free[i] = (start + nwords, length - nwords)
                    self._used[handle_id] = (start, nwords)
                    return start
        raise RuntimeError(f"the digest table ({self.words} words) has no room for {nwords} more: retract "
                           "handles that are done")

    def reclaim(self, live: Iterable[int]) -> int:
        """Give back the regions of every handle not in ``live``; how many."""
        keep = set(live)
        with self._lock:
            gone = [h for h in self._used if h not in keep]
            for handle_id in gone:
                self._release(*self._used.pop(handle_id))
        return len(gone)

    def _release(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, length))
        if i + 1 < len(self._free) and start + length == self._free[i + 1][0]:  # merge with the next
            self._free[i] = (start, length + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the previous
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def used(self) -> int:
        with self._lock:
            return len(self._used)
