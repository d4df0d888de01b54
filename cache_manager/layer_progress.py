"""Per-layer progress of layer-wise tasks, in shared memory the engine and every rank map.

A layer-wise task (DESIGN §3.8) names a *slot* of the board and a *sequence number* that the engine
drew for it.  Each word of the board is ``seq << 24 | value``, written with one aligned 8-byte store,
so a reader never sees half of an update, and a word left by an earlier task in the same slot
(another seq) reads as "nothing yet".  Every word is written with a release store and read with an
acquire load (``ops._shm_atomic``, C11 atomics): what a writer did before publishing (a
layer's bytes) is visible to a reader that sees the word, on aarch64 (Ascend hosts) as on x86, where
plain stores and loads would happen to be enough.  Per slot there are:

* ``landed[rank]``: how many leading layers of the task are complete on that rank, or ``FAILED``.
  A rank publishes layer ``l`` only after every byte of layer ``l`` of every block it reports is in
  place (the copy returned, the stream synchronised), so a layer is ready exactly when every rank's
  word for the task's seq is above it.
* ``blocks[rank]``: how many leading blocks of the task the rank loads (a storage read may find only
  a prefix).  Written before the first layer, and never changed afterwards.
* ``computed``: written by the engine for a layer-wise *store*: how many leading layers the model has
  computed, so that the rank may copy them out while later layers are still being computed.
* ``pushed[writer]``: for a push from another instance (DESIGN §3.11), how many leading layers prefill
  rank ``writer`` has written into this instance's reserved blocks (0 once it started), or
  ``FAILED``.  The writers are the *prefill* instance's ranks, whose TP size may differ from ours,
  so they have their own ``PUSH_WRITERS`` columns.
* ``ticket``: for a push, the reservation the decode engine made (``reservation_word``: a digest of
  the task's seq and the destination blocks, never 0) while it accepts writes, ``FENCED`` (0) once
  it cancelled or closed it.  A writer stores its ``pushed`` word "started", then reads the ticket
  word and writes nothing unless it equals the digest of the ticket it was handed, before each
  layer: so the decode side, not the ticket, decides which blocks are written, and a ticket that
  was cancelled, closed, pushed twice, altered or swapped for another writes no byte.  The decode
  side stores the fence, then reads the ``pushed`` words (each side's store is followed by a full
  fence before its load, ``_shm_atomic.store_fenced``): a cancel that sees no writer started knows
  none will start.

The engine (``engine_hooks.core.layerwise``) creates the board, hands out slots and frees a slot only once
every rank has released the task, so no late rank writes into a slot another task uses.  It is a
plain ``int64`` IPCSignal named ``layer_progress``; a CTM attaches on its first layer-wise task.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ops import _shm_atomic
from cache_manager.ipc_signal import IPCSignal

LAYER_PROGRESS_SIGNAL = "layer_progress"
SLOTS = 256
VALUE_BITS = 24
VALUE_MASK = (1 << VALUE_BITS) - 1
FAILED = VALUE_MASK  # a landed word holding this value: the rank gave up on the task
MAX_SEQ = (1 << (63 - VALUE_BITS)) - 1
PUSH_WRITERS = 16  # the largest TP size of a prefill instance that pushes into this one
FENCED = 0  # a ticket word: the decode side accepts no (more) writes into this slot


def board_shape(tp: int) -> tuple[int, int]:
    """Columns: ``landed`` per rank, ``blocks`` per rank, ``computed``, ``pushed`` per writer, ``ticket``."""
    return (SLOTS, 2 * tp + 1 + PUSH_WRITERS + 1)


def ticket_index(tp: int, slot: int) -> int:
    """Where the decode engine publishes the reservation of ``slot`` (the word's index in the board)."""
    if not 0 <= slot < SLOTS:
        raise IndexError(f"ticket word of slot {slot} outside {SLOTS} slots")
    return slot * board_shape(tp)[1] + 2 * tp + 1 + PUSH_WRITERS


def reservation_word(seq: int, dst_block_ids: Sequence[int], salt_tag: str = "") -> int:
    """The ticket word of a push reservation: a 63-bit digest of its seq, destination blocks and the
    tenant's salt tag (``transfer_factory.keys.salt_tag``; none: as before salts existed), never
    ``FENCED``.  Writer and decode compute it alike; one that differs (another tenant's request
    included) writes nothing."""
    h = hashlib.blake2b(digest_size=8, person=b"ctm-push-ticket")
    h.update(int(seq).to_bytes(8, "little"))
    h.update(np.asarray(list(dst_block_ids), dtype="<i8").tobytes())
    if salt_tag:
        h.update(b"salt:" + salt_tag.encode())
    return (int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)) | 1


def pushed_index(tp: int, slot: int, writer: int) -> int:
    """Where prefill rank ``writer`` publishes its push into ``slot`` of the board of an instance of
    TP size ``tp`` (the word's index in the board's int64 array)."""
    if not (0 <= slot < SLOTS and 0 <= writer < PUSH_WRITERS):
        raise IndexError(f"push word (slot {slot}, writer {writer}) outside {SLOTS} x {PUSH_WRITERS}")
    return slot * board_shape(tp)[1] + 2 * tp + 1 + writer


def pack(seq: int, value: int) -> int:
    return (seq << VALUE_BITS) | value


def unpack(word: int, seq: int) -> int | None:
    """The word's value if it belongs to task ``seq``, else None."""
    word = int(word)
    return word & VALUE_MASK if word >> VALUE_BITS == seq else None


@dataclass(frozen=True)
class LayerwiseRef:
    """What a task carries on the wire under ``layerwise``: its slot and seq, and whether the rank
    must wait for the engine's ``computed`` counter before copying a layer out (stores only)."""

    slot: int
    seq: int
    await_compute: bool = False

    def to_wire(self) -> dict:
        return {"slot": self.slot, "seq": self.seq, "await_compute": self.await_compute}

    @classmethod
    def from_wire(cls, value: Any) -> "LayerwiseRef":
        if not isinstance(value, dict):
            raise ValueError(f"task field 'layerwise' must be a map, got {value!r:.80}")
        slot, seq, wait = value.get("slot"), value.get("seq"), value.get("await_compute", False)
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < SLOTS:
            raise ValueError(f"layerwise slot {slot!r} must be an integer in [0, {SLOTS})")
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq <= MAX_SEQ:
            raise ValueError(f"layerwise seq {seq!r} must be an integer in [1, {MAX_SEQ}]")
        if not isinstance(wait, bool):
            raise ValueError(f"layerwise await_compute {wait!r} must be a boolean")
        return cls(slot, seq, wait)


class LayerBoard:
    """The board's shared array and its column arithmetic; the creator (the engine) unlinks it."""

    def __init__(self, tp: int, suffix: object, create: bool = False):
        self.tp = tp
        self.signal = IPCSignal(LAYER_PROGRESS_SIGNAL, np.zeros(board_shape(tp), np.int64), dtype=np.int64,
                                suffix=suffix, create=create)
        self.words = self.signal.value
        self._columns = self.words.shape[1]
        # Every access goes through the atomics below, never through ``words`` directly: a plain
        # numpy store or load has no ordering on aarch64 (see the module docstring).
        self._store, self._load, self._load_row = (_shm_atomic.store_release, _shm_atomic.load_acquire,
                                                   _shm_atomic.load_acquire_row)

    def _at(self, slot: int, column: int) -> int:
        if not (0 <= slot < SLOTS and 0 <= column < self._columns):  # C checks only the whole buffer
            raise IndexError(f"layer board word ({slot}, {column}) is outside {SLOTS} x {self._columns}")
        return slot * self._columns + column

    def landed(self, slot: int, rank: int) -> int:
        return self._load(self.words, self._at(slot, rank))

    def landed_row(self, slot: int) -> list[int]:
        """``landed`` of every rank of ``slot`` at once (one acquire load per rank), in one call."""
        return self._load_row(self.words, self._at(slot, 0), self.tp)

    def blocks(self, slot: int, rank: int) -> int:
        return self._load(self.words, self._at(slot, self.tp + rank))

    def computed(self, slot: int) -> int:
        return self._load(self.words, self._at(slot, 2 * self.tp))

    def pushed(self, slot: int, writer: int) -> int:
        return self._load(self.words, pushed_index(self.tp, slot, writer))

    def ticket(self, slot: int) -> int:
        return self._load(self.words, ticket_index(self.tp, slot))

    def set_ticket(self, slot: int, word: int) -> None:
        """Publish or fence a push reservation: a store, then a full fence (no later load of the
        ``pushed`` words passes it)."""
        _shm_atomic.store_fenced(self.words, ticket_index(self.tp, slot), word)

    def set_landed(self, slot: int, rank: int, word: int) -> None:
        """Publish: a release store, so everything this thread wrote before (the layer's bytes) is
        visible to a reader whose acquire load sees ``word``."""
        self._store(self.words, self._at(slot, rank), word)

    def set_blocks(self, slot: int, rank: int, word: int) -> None:
        self._store(self.words, self._at(slot, self.tp + rank), word)

    def set_computed(self, slot: int, word: int) -> None:
        self._store(self.words, self._at(slot, 2 * self.tp), word)

    def close(self) -> None:
        self.signal.clear()  # unlinks only when this process created it


class LayerPublisher:
    """A rank's side of one layer-wise task: publish blocks and landed layers, or the failure, and
    wait for the engine's computed layers."""

    def __init__(self, board: LayerBoard, rank: int, ref: LayerwiseRef):
        self.board, self.rank, self.ref = board, rank, ref
        self.layers_published = 0
        self.failed = False

    def set_blocks(self, count: int) -> None:
        self.board.set_blocks(self.ref.slot, self.rank, pack(self.ref.seq, min(count, VALUE_MASK - 1)))

    def layers_done(self, count: int) -> None:
        """Layers ``[0, count)`` are complete on this rank.  Only ever grows."""
        if self.failed or count <= self.layers_published:
            return
        self.layers_published = count
        self.board.set_landed(self.ref.slot, self.rank, pack(self.ref.seq, count))

    def fail(self) -> None:
        """The task will not complete: a waiter fails at once instead of waiting for the deadline."""
        self.failed = True
        self.board.set_landed(self.ref.slot, self.rank, pack(self.ref.seq, FAILED))

    def wait_computed(self, layers: int, deadline: float, stop: threading.Event | None = None) -> None:
        """Block until the engine has computed ``layers`` leading layers; ``TimeoutError`` at the
        task's deadline, so a store never waits past it."""
        wait_until(lambda: _computed_at_least(self.board, self.ref, layers), deadline,
                   f"layer {layers - 1} was not computed by the engine before the task's deadline", stop)


def _computed_at_least(board: LayerBoard, ref: LayerwiseRef, layers: int) -> bool:
    value = unpack(board.computed(ref.slot), ref.seq)
    return value is not None and value >= layers


def wait_until(ready: Callable[[], bool], deadline: float, what: str,
               stop: threading.Event | None = None) -> None:
    """Poll ``ready`` until it holds: a tight spin for the first 50 µs, then sleeps growing to 200 µs,
    so a layer that lands within a layer's compute time is seen at once without burning a core on
    a long wait.  Raises ``TimeoutError(what)`` at ``deadline`` (``time.monotonic()``)."""
    start = time.monotonic()
    pause = 0.0
    while not ready():
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(what)
        if stop is not None and stop.is_set():
            raise TimeoutError(f"{what} (stopping)")
        if now - start > 50e-6:
            pause = min(200e-6, max(20e-6, pause * 2))
            time.sleep(min(pause, max(0.0, deadline - now)))
