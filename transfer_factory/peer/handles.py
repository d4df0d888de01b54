"""The exposure board: which transfer handles of a prefill instance still hold their request's KV.

A prefill engine exposes a request's blocks under a handle (LLM-DataDist's ``CacheKey(cluster,
req_id)``) before a decode instance pulls them, and retracts it when the puller confirmed or it
gives up.  The board is one shared-memory array of 64-bit words, one per slot, each
``handle_id << 2 | state``, written by the engine with one release store (``ops._shm_atomic``, as
the layer board) and read with an acquire load.  A puller reads its
handle's word *after* its bytes arrived: if the word still names its handle as LIVE, every byte was
read before the retraction, and the engine reuses a block only after it retracted the handle
(``retract`` stores RETRACTED first).  So a block is counted only if all its bytes came from the
source block while it still held the request's KV (DESIGN §3.11), whatever the prefill side did
meanwhile: retract, reuse, crash.  The engine's pin is a matter of throughput, not of correctness.

After the handle slots the board holds its *generation word* (``GENERATION_WORD``): the generation
of the engine's cache memory (DESIGN §3.8), nonzero while the caches a descriptor named are the ones
attached, ``NO_GENERATION`` (0) from the moment the engine starts replacing them (an RL clear, a
sleep) or closes its prefill/decode side.  A peer link records the generation it was made for; a
transfer reads the word before its first byte and again after its last (with the handle word), and
counts nothing unless both equal the link's.  So a link outliving the memory it maps moves no byte
that counts.  The engine retracts every handle before it publishes a new generation: a handle, too,
names the memory of the generation it was exposed in.

**Leases.** A handle expires ``ttl`` seconds after it was exposed or last renewed (``renew``: the
decode side says, through the router, that it still needs it); expiry is a retraction, which is
always safe, so a lost decode instance never pins prefill blocks for good.  ``expire_due`` retracts
every handle past its lease, in lease order whatever order they were exposed or renewed in; the
prefill side's reaper calls it (``engine_hooks.pd``).

Reading "after the bytes" needs a fence on every architecture: ``_shm_atomic.load_after_reads`` (an
acquire fence before the load, so the data loads are done first; x86 keeps loads in order anyway,
aarch64 does not).  The engine's stores are release stores followed by a full fence
(``store_fenced``), so its later reuse of a block cannot pass the retraction.
"""
from __future__ import annotations

import hashlib
import math
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ops import _shm_atomic
from transfer_factory.keys import salt_tag

SLOTS = 4096
WORD_BYTES = 8
GENERATION_WORD = SLOTS  # the word after the handle slots
HEADER_WORDS = 8  # the generation word and room for more
BOARD_WORDS = SLOTS + HEADER_WORDS
BOARD_BYTES = BOARD_WORDS * WORD_BYTES
NO_GENERATION = 0  # the caches are being replaced, or the board is closed: nothing counts
DEFAULT_TTL_S = 30.0  # a handle's lease unless the decode side renews it (vLLM's prefill-block lease)
FREE, LIVE, RETRACTED = 0, 1, 2
MAX_HANDLE_ID = (1 << 61) - 1


@dataclass(frozen=True)
class TransferHandle:
    """What a puller names: the prefill instance, the request, and the board slot and id."""

    instance_id: str
    req_id: str
    slot: int
    handle_id: int
    # Where the prefill ranks published the exposed blocks' digests: (first word of the region in
    # every rank's digest table, blocks, the id of the handle that exposed them, which tags the region
    # whatever salt the puller names); None when they publish none (``transfer_factory.peer.digests``).
    digests: tuple[int, int, int] | None = field(default=None, compare=False)

    def to_wire(self) -> dict:
        out = {"instance_id": self.instance_id, "req_id": self.req_id, "slot": self.slot, "handle_id": self.handle_id}
        if self.digests is not None:
            out["digests"] = list(self.digests)
        return out

    def with_digests(self, offset: int, blocks: int) -> "TransferHandle":
        return replace(self, digests=(int(offset), int(blocks), self.handle_id))

    @classmethod
    def from_wire(cls, d: Any) -> "TransferHandle":
        if not isinstance(d, dict):
            raise ValueError(f"a transfer handle must be a map, got {type(d).__name__}")
        slot, handle_id = d.get("slot"), d.get("handle_id")
        if type(slot) is not int or not 0 <= slot < SLOTS:
            raise ValueError(f"handle slot {slot!r:.40} must be an integer in [0, {SLOTS})")
        if type(handle_id) is not int or not 0 < handle_id <= MAX_HANDLE_ID:
            raise ValueError(f"handle_id {handle_id!r:.40} must be an integer in [1, 2^61)")
        for name in ("instance_id", "req_id"):
            if type(d.get(name)) is not str or not 0 < len(d[name]) <= 256:
                raise ValueError(f"handle {name} {d.get(name)!r:.40} must be a non-empty string")
        digests = d.get("digests")
        if digests is not None:
            if not (isinstance(digests, (list, tuple)) and len(digests) == 3
                    and all(type(v) is int and 0 <= v <= MAX_HANDLE_ID for v in digests)):
                raise ValueError(f"handle digests {digests!r:.60} must be [region offset, blocks, handle id]")
            digests = (digests[0], digests[1], digests[2])
        return cls(d["instance_id"], d["req_id"], slot, handle_id, digests)

    def for_salt(self, cache_salt: str | None) -> "TransferHandle":
        """The handle as a puller whose request has ``cache_salt`` must name it: its id is the word the
        board holds only if the prefill request was exposed with the same salt (``board_id``)."""
        return replace(self, handle_id=board_id(self.handle_id, cache_salt))


def board_id(handle_id: int, cache_salt: str | None) -> int:
    """The id a handle's board word carries: ``handle_id`` itself without a salt (as before salts
    existed), else a 61-bit digest of it and the salt's tag.  A handle travels without it (the router
    carries ``handle_id``); the board holds it, so only a puller of the same tenant names the word."""
    tag = salt_tag(cache_salt)
    if not tag:
        return handle_id
    digest = hashlib.blake2b(f"{tag}:{handle_id}".encode(), digest_size=8, person=b"ctm-handle-salt").digest()
    return (int.from_bytes(digest, "little") & MAX_HANDLE_ID) or 1


def new_generation(previous: int = NO_GENERATION) -> int:
    """A generation no earlier memory had: random at first (two runs of one engine never meet),
    then the next one up, never ``NO_GENERATION``."""
    if previous == NO_GENERATION:
        return secrets.randbelow(1 << 48) + 1
    return previous % ((1 << 62) - 1) + 1


def word(handle_id: int, state: int) -> int:
    return (handle_id << 2) | state


def holds(board_word: int, handle: TransferHandle) -> bool:
    """Whether a word read from the board says ``handle`` is still LIVE."""
    return int(board_word) == word(handle.handle_id, LIVE)


class ExposureBoard:
    """The engine's side: hands out slots, publishes LIVE, retracts.  ``words`` is the board's
    memory (a shared-memory array the engine created); the engine alone writes it."""

    def __init__(self, words: np.ndarray, instance_id: str):
        if words.dtype != np.int64 or words.shape != (BOARD_WORDS,):
            raise ValueError(f"an exposure board is {BOARD_WORDS} int64 words, got {words.dtype} {words.shape}")
        self.words = words
        self.instance_id = instance_id
        self._lock = threading.Lock()
        self._next_id = secrets.randbelow(1 << 40) + 1  # ids of two runs of one engine never meet
        self._free = list(range(SLOTS - 1, -1, -1))
        self._live: dict[str, TransferHandle] = {}  # req_id -> handle
        self._words: dict[str, int] = {}  # req_id -> the id its board word carries (``board_id``)
        self._leases: dict[str, tuple[float | None, float]] = {}  # req_id -> (its ttl, when it expires)

    def expose(self, req_id: str, ttl: float | None = DEFAULT_TTL_S, cache_salt: str | None = None) -> TransferHandle:
        """A LIVE handle for ``req_id`` whose lease runs ``ttl`` seconds (None: until retracted); with
        ``cache_salt`` only a puller naming the same salt (``TransferHandle.for_salt``) finds it live."""
        _check_ttl(ttl)
        salt_tag(cache_salt)  # a bad salt raises before a slot is taken
        with self._lock:
            if req_id in self._live:
                raise ValueError(f"request {req_id!r} already has a live handle")
            if not self._free:
                raise RuntimeError(f"all {SLOTS} handle slots are live: retract handles that are done")
            slot = self._free.pop()
            handle = TransferHandle(self.instance_id, req_id, slot, self._next_id)
            word_id = board_id(handle.handle_id, cache_salt)
            self._next_id = self._next_id % MAX_HANDLE_ID + 1
            _shm_atomic.store_fenced(self.words, slot, word(word_id, LIVE))
            self._live[req_id] = handle
            self._words[req_id] = word_id
            self._leases[req_id] = (ttl, math.inf if ttl is None else time.monotonic() + ttl)
            return handle

    def retract(self, handle: TransferHandle) -> bool:
        """Mark ``handle`` retracted; from now on no puller counts a block it reads under it, so the
        engine may reuse the blocks at once.  False if it was not live."""
        with self._lock:
            return self._retract(handle)

    def _retract(self, handle: TransferHandle) -> bool:
        if self._live.get(handle.req_id) != handle:
            return False
        _shm_atomic.store_fenced(self.words, handle.slot, word(self._words.pop(handle.req_id), RETRACTED))
        del self._live[handle.req_id]
        del self._leases[handle.req_id]
        self._free.insert(0, handle.slot)  # reused last: a late reader sees RETRACTED longest
        return True

    def renew(self, handle: TransferHandle, ttl: float | None = None) -> bool:
        """Extend ``handle``'s lease by ``ttl`` seconds from now (default: the ttl it was exposed
        with).  False if it is no longer live (retracted or expired): then nothing read under it
        counts, and the decode side must not use what it pulled."""
        _check_ttl(ttl)
        with self._lock:
            if self._live.get(handle.req_id) != handle:
                return False
            exposed_ttl, _ = self._leases[handle.req_id]
            ttl = exposed_ttl if ttl is None else ttl
            self._leases[handle.req_id] = (exposed_ttl, math.inf if ttl is None else time.monotonic() + ttl)
            return True

    def expire_due(self, now: float | None = None) -> list[TransferHandle]:
        """Retract every handle whose lease ended by ``now``, soonest first; returns them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = sorted((until, req) for req, (_, until) in self._leases.items() if until <= now)
            expired = [self._live[req] for _, req in due]
            for handle in expired:
                self._retract(handle)
            return expired

    def next_expiry(self) -> float | None:
        """When the soonest lease ends (``time.monotonic()``), or None if none will."""
        with self._lock:
            soonest = min((until for _, until in self._leases.values()), default=math.inf)
        return None if soonest == math.inf else soonest

    @property
    def generation(self) -> int:
        return _shm_atomic.load_acquire(self.words, GENERATION_WORD)

    def publish_generation(self, generation: int) -> None:
        """The engine's cache memory is now ``generation`` (``NO_GENERATION``: being replaced, or
        gone).  Moving away from a generation retracts every handle first: they name its blocks."""
        if generation != self.generation:
            self.retract_all()
        _shm_atomic.store_fenced(self.words, GENERATION_WORD, int(generation))

    def live(self) -> list[TransferHandle]:
        with self._lock:
            return list(self._live.values())

    def retract_all(self) -> int:
        count = 0
        for handle in self.live():
            count += self.retract(handle)
        return count


def _check_ttl(ttl: float | None) -> None:
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < 1e7):
        raise ValueError(f"ttl {ttl!r} must be None or a positive number of seconds")
