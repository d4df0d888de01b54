"""The FileStore's index: key digest -> where its live record is, in LRU order, with the byte
accounting against the capacity, the blocks known for eviction, and the evicted records whose
dead mark is still to be written (store.py has the design).

``Index`` owns all of that and its lock (``Index.lock``); store.py has the lock order.  It knows
segments only as the ``Segment`` objects its entries point at: which digests live in each
(``members``) and how many bytes of each are live, for the space policy's choices.  It does no I/O.
"""
from __future__ import annotations

import functools
import hashlib
import struct
import threading
from collections import OrderedDict, deque
from typing import Any, Iterator, Sequence

from transfer_factory.file._records import key_groups, new_entries, note_blocks, select_all
from transfer_factory.file.segments import HEADER_SIZE, Entry, Segment
from transfer_factory.keys import KINDS

_HCRC = struct.Struct("<52xI")          # the header CRC of each 56-byte header in a run


@functools.lru_cache(maxsize=1 << 16)
def key_digest(key: str) -> bytes:
    """The SHA-256 of a key's UTF-8 (lone surrogates passed through): the index's key and the
    record header's ``key_sha256`` (``_records.key_digests`` is the batch form)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Index:
    """Live records by key digest, least recently used first, and the bytes they take."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.lock = threading.RLock()     # everything below
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._used = 0                    # header + payload of every entry, plus reservations
        # digest -> the digests of its block's objects, for blocks this instance stored or read whole:
        # eviction removes a block at once rather than leave half of it taking space.
        self._siblings: dict[bytes, tuple[bytes, ...]] = {}
        self._doomed: list[tuple[bytes, Entry]] = []   # evicted records whose dead mark is still to write
        # Deleted records whose dead mark waits for a peer's exclusive flock (a compaction), by digest.
        self._deferred: dict[bytes, list[Entry]] = {}
        self._members: dict[Segment, set[bytes]] = {}  # segment -> digests whose entry points there
        self._live: dict[Segment, int] = {}            # segment -> bytes of those records

    # ------------------------------------------------------------------------------------ reading
    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, d: object) -> bool:
        return d in self._entries

    def get(self, d: bytes | None) -> Entry | None:
        return self._entries.get(d)

    def contains_all(self, digests: Sequence[bytes | None]) -> bool:
        """Whether every digest that is not None is indexed."""
        return all(map(self._entries.__contains__, filter(None, digests)))

    def none_of(self, digests: Sequence[bytes]) -> bool:
        return self._entries.keys().isdisjoint(digests)

    def members(self, seg: Segment) -> frozenset[bytes]:
        return frozenset(self._members.get(seg, ()))

    def has_members(self, seg: Segment) -> bool:
        return bool(self._members.get(seg))

    def holds_any(self, seg: Segment, digests: set[bytes]) -> bool:
        return not digests.isdisjoint(self._members.get(seg, ()))

    def live_bytes(self, seg: Segment) -> int:
        return self._live.get(seg, 0)

    def last_use(self) -> dict[Segment, int]:
        """Per segment, the LRU position of its most recently used object (higher: more recent)."""
        out: dict[Segment, int] = {}
        for pos, e in enumerate(self._entries.values()):
            out[e.seg] = pos
        return out

    def known_blocks(self) -> dict[bytes, tuple[bytes, ...]]:
        """A copy of the blocks known (digest -> its block's digests)."""
        with self.lock:
            return dict(self._siblings)

    def blocks_known(self, digests: Sequence[bytes | None]) -> bool:
        return all(map(self._siblings.__contains__, filter(None, digests)))

    def select_all(self, digests: list, ptrs: Sequence, sizes: Sequence) -> tuple | None:
        """``_records.select_all`` over this index: (segments, offsets, lengths, checksums, every
        block known) when every object is stored and has one buffer big enough, else None."""
        return select_all(self._entries, digests, ptrs, sizes, self._siblings)

    # ------------------------------------------------------------------------------------ changing
    def reserve(self, total: int) -> bool:
        """Counts ``total`` bytes of a record about to be written, if they fit under the capacity."""
        if self._used + total > self.capacity_bytes:
            return False
        self._used += total
        return True

    def force_reserve(self, total: int) -> None:
        """Counts bytes the caller already made room for (``evict``)."""
        self._used += total

    def release(self, total: int) -> None:
        """Gives back bytes reserved for records that were not written or are now entered."""
        self._used -= total

    def add(self, d: bytes, e: Entry) -> None:
        """Enters a record as ``d``'s, the most recently used; a copy it had before is forgotten."""
        old = self._entries.pop(d, None)
        if old is not None:
            self._unlink(d, old)
        self._entries[d] = e
        self._link(d, e)

    def add_run(self, seg: Segment, digests: list[bytes], offsets: list[int], lengths: Sequence[int],
                crcs: list[int], headers: bytes) -> None:
        """``add`` for the records of one append to ``seg`` (``headers``: theirs, back to back, for
        the header CRCs), in one pass when none of them is indexed yet (the common case)."""
        if not self._entries.keys().isdisjoint(digests):
            hcrcs = [h for (h,) in _HCRC.iter_unpack(headers)]
            for d, off, n, crc, hcrc in zip(digests, offsets, lengths, crcs, hcrcs):
                self.add(d, Entry(seg, off, n, crc, hcrc))
            return
        new_entries(self._entries, seg, digests, offsets, lengths, crcs, headers)
        self._members.setdefault(seg, set()).update(digests)
        added = HEADER_SIZE * len(lengths) + sum(lengths)
        self._live[seg] = self._live.get(seg, 0) + added
        self._used += added

    def touch(self, d: bytes) -> None:
        """``d`` becomes the most recently used."""
        self._entries.move_to_end(d)

    def touch_all(self, digests: list[bytes]) -> None:
        """``touch`` for each digest still indexed."""
        entries = self._entries
        try:
            deque(map(entries.move_to_end, digests), 0)
        except KeyError:                                  # another thread dropped one meanwhile
            for d in digests:
                if d in entries:
                    entries.move_to_end(d)

    def drop(self, d: bytes) -> Entry | None:
        """Forgets ``d`` (and its block); its entry, or None when it had none."""
        e = self._entries.pop(d, None)
        if e is not None:
            self._unlink(d, e)
        self._siblings.pop(d, None)
        return e

    def drop_if(self, d: bytes, e: Entry) -> bool:
        """Forgets ``d`` only if ``e`` is still its entry."""
        if self._entries.get(d) is e:
            self.drop(d)
            return True
        return False

    def drop_if_at(self, d: bytes, seg: Segment, offset: int) -> None:
        """Forgets ``d`` only if its entry still points at ``offset`` of ``seg``."""
        e = self._entries.get(d)
        if e is not None and e.seg is seg and e.offset == offset:
            self.drop(d)

    def drop_segment(self, seg: Segment, with_blocks: bool = False) -> int:
        """Forgets every record in ``seg``; with ``with_blocks`` also the other objects of their
        blocks (to be marked dead).  Returns the objects forgotten."""
        dropped = 0
        for d in list(self._members.get(seg, ())):
            for s in (self._siblings.get(d, ()) if with_blocks else ()):
                other = self._entries.get(s)
                if s != d and other is not None and other.seg is not seg:
                    self._doomed.append((s, self.drop(s)))
                    dropped += 1
            if self.drop(d) is not None:
                dropped += 1
        self._members.pop(seg, None)
        self._live.pop(seg, None)
        return dropped

    def drop_past(self, seg: Segment, size: int) -> None:
        """Forgets the records of ``seg`` whose header does not lie within its first ``size`` bytes."""
        for d in [d for d in self._members.get(seg, ()) if self._entries[d].offset + HEADER_SIZE > size]:
            self.drop(d)

    def relocate(self, d: bytes, e: Entry, seg: Segment, dest: Segment, offset: int) -> bool:
        """Points ``d`` at its copy at ``offset`` of ``dest`` (a compaction), keeping its LRU place, if
        ``e`` in ``seg`` is still its entry."""
        if self._entries.get(d) is not e or e.seg is not seg:
            return False
        self._unlink(d, e)
        moved = Entry(dest, offset, e.length, e.crc, e.hcrc)
        self._entries[d] = moved                          # an existing key: its position stays
        self._link(d, moved)
        return True

    def evict(self, need: int, keep: set[bytes] | frozenset[bytes] = frozenset()) -> int:
        """Evicts LRU objects until ``need`` more bytes fit under the capacity; the caller holds the
        lock.  Objects in ``keep`` are never evicted: evicting a block's K to make room for its V
        would leave the block incomplete.  When the capacity cannot be met without them nothing is
        evicted and -1 is returned; otherwise the number of objects evicted (kept, with their
        entries, to be marked dead: ``take_doomed``)."""
        if self._used + need <= self.capacity_bytes:
            return 0
        victims, over = [], self._used + need - self.capacity_bytes
        for unit in self._lru_units(keep):
            if over <= 0:
                break
            victims += unit
            over -= sum(self._entries[d].size for d in unit)
        if over > 0:
            return -1
        for d in victims:
            self._doomed.append((d, self.drop(d)))
        return len(victims)

    def doom(self, d: bytes, e: Entry) -> None:
        """Adds a forgotten record to those to be marked dead."""
        self._doomed.append((d, e))

    def take_doomed(self) -> list[tuple[bytes, Entry]]:
        """The records forgotten since the last call, whose dead mark is to be written."""
        with self.lock:
            doomed, self._doomed = self._doomed, []
        return doomed

    def defer(self, d: bytes, e: Entry) -> None:
        """Keeps a deleted record whose dead mark could not be written yet (``take_deferred``)."""
        with self.lock:
            self._deferred.setdefault(d, []).append(e)

    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def take_deferred(self) -> list[tuple[bytes, Entry]]:
        with self.lock:
            deferred, self._deferred = self._deferred, {}
        return [(d, e) for d, es in deferred.items() for e in es]

    def is_deferred_copy(self, d: bytes, e: Entry) -> bool:
        """Whether ``e`` is a copy (the same header: a compaction moved it) of a record of ``d``
        whose dead mark is deferred: such a copy is deleted too, never served.  The lock held."""
        return any(old.fields(d) == e.fields(d) for old in self._deferred.get(d, ()))

    def note_blocks(self, digests: Sequence[bytes | None], keys: Sequence[Any], done: Sequence[bool],
                    groups: Sequence[str | None] | None = None) -> None:
        """Remembers which objects form one block, for blocks whose every object just succeeded."""
        if self.blocks_known(digests):
            return                                        # nothing new (the common read of stored blocks)
        if groups is None:
            groups = key_groups(keys, KINDS)
        with self.lock:                                   # one pass in C: a dict op or two per object
            note_blocks(groups, digests, done, self._entries, self._siblings)

    def reset(self) -> None:
        """Forgets everything."""
        with self.lock:
            self._entries.clear()
            self._siblings.clear()
            self._doomed.clear()
            self._deferred.clear()
            self._members.clear()
            self._live.clear()
            self._used = 0

    # ------------------------------------------------------------------------------------ inside
    def _link(self, d: bytes, e: Entry) -> None:
        self._members.setdefault(e.seg, set()).add(d)
        self._live[e.seg] = self._live.get(e.seg, 0) + e.size
        self._used += e.size

    def _unlink(self, d: bytes, e: Entry) -> None:
        members = self._members.get(e.seg)
        if members is not None:
            members.discard(d)
        if e.seg in self._live:
            self._live[e.seg] -= e.size
        self._used -= e.size

    def _lru_units(self, keep: set[bytes] | frozenset[bytes]) -> Iterator[list[bytes]]:
        """What eviction may take, least recently used first: a whole block when its objects are
        known, else one object; never anything of a block the running batch (``keep``) touched."""
        seen: set[bytes] = set()
        for d in self._entries:
            if d in seen:
                continue
            unit = [s for s in self._siblings.get(d, ()) if s in self._entries] or [d]
            seen.update(unit)
            if not keep.isdisjoint(unit):
                continue
            yield unit
