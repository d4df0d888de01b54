"""The engine's side of the P/D digests (DESIGN §3.11 "Digests"; ``transfer_factory.peer.digests``).

``PrefillDecode(service, digests=True)`` makes a ``DigestTables``: one digest table per rank (a
shared-memory segment this engine creates and removes, named in its descriptors, so a peer reads it
over the link's transport: mapped on one host, registered with the Transfer Engine), and the arena
that gives each exposed handle its region, the same on every rank.  ``publish(handle, blocks)``
asks every rank to write the digests of ``blocks`` there (computed where the bytes are, from the
rank's device caches) and returns the handle that names the region.  A region goes back to the
arena once its handle is no longer live (retracted, expired, or every handle retracted by a new
generation), so no puller that can still count reads a region given to another handle.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ops.shm import SharedMemorySegment
from transfer_factory.peer.digests import DigestArena, region_words, table_words
from transfer_factory.peer.handles import SLOTS, ExposureBoard, TransferHandle

logger = logging.getLogger(__name__)


class DigestTables:
    def __init__(self, service: Any, board: ExposureBoard, control: Callable[..., list],
                 table_bytes: int | None = None):
        self._board = board
        self._control = control
        layout = service.layout
        self.tensors = sum(len(g.layers) for g in layout.block_groups())  # digests per block, every rank
        words = table_bytes // 8 if table_bytes else table_words(layout.num_blocks, self.tensors, SLOTS)
        if words < region_words(1, self.tensors):
            raise ValueError(f"digest table of {table_bytes} bytes cannot hold one block's digests")
        self.arena = DigestArena(words)
        self._segments: list[SharedMemorySegment] = []
        try:
            for rank in range(service.tp):
                self._segments.append(SharedMemorySegment(f"ctm.{service.instance}.pd_digests.{rank}", 8 * words,
                                                          create=True, populate=False))
        except BaseException:
            self.close()
            raise

    def regions(self) -> list[list]:
        """Per rank, [segment, offset, bytes] of its table (for ``pd_describe``)."""
        return [[s.name, 0, s.size] for s in self._segments]

    def publish(self, handle: TransferHandle, blocks: Sequence[int]) -> TransferHandle:
        """Every rank writes the digests of ``blocks`` (this handle's) into the handle's region;
        returns the handle naming it.  Regions of handles no longer live go back first."""
        self.arena.reclaim(h.handle_id for h in self._board.live())
        offset = self.arena.allocate(handle.handle_id, region_words(len(blocks), self.tensors))
        self._control("pd_digest", handle_id=handle.handle_id, generation=self._board.generation, offset=offset,
                      blocks=list(blocks), tensors=self.tensors)
        return handle.with_digests(offset, len(blocks))

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
            segment.unlink()
        self._segments = []


def check_peer_publishes(peer: dict, transport: str) -> str | None:
    """Why a peer instance's descriptor (``link``'s ``peer``) cannot be checked with digests over
    ``transport``, or None: each of its ranks must name a digest table there."""
    for wire in peer.get("ranks", []):
        params = wire.get("transports", {}).get(transport, {}) if isinstance(wire, dict) else {}
        if not isinstance(params, dict) or params.get("digests") is None:
            rank = wire.get("rank") if isinstance(wire, dict) else "?"
            return (f"instance {peer.get('instance_id')!r} rank {rank} publishes no digests over {transport} (start "
                    "its PrefillDecode with digests=True), and this instance checks them")
    return None
