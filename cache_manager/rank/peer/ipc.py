"""The same-host channel: map a peer rank's exported caches and copy with the block kernel.

A rank offers it where its platform exports device memory as named segments (the CPU platform); a
link maps the peer rank's segments (``transfer_factory.peer.ipc.IpcPeer``), read-only for a decode
instance, and every transfer is one block-kernel call per cache kind, whatever the number of peer
ranks a rank exchanges heads with.  Board words are read from the mapped boards with a fenced load
(after the copy's loads); layer words are published with a fenced store.  No port is opened.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ops import _shm_atomic
from ops.layout import CopyPlan, Side, layer_range
from ops.modes import HOST_TO_DEVICE
from ops.platform import Platform
from transfer_factory.peer import PeerDescriptor
from transfer_factory.peer.digests import xxh3_address
from transfer_factory.peer.ipc import IpcPeer, Region, ipc_params
from transfer_factory.peer.te import Inflight

from cache_manager.layer_progress import SLOTS, board_shape
from cache_manager.rank.peer.channel import Boards, InstanceLink, PeerChannel, PeerError, PeerLink, Route, Sides
from cache_manager.rank.resources import RankResources


class IpcChannel(PeerChannel):
    name = "ipc"

    def __init__(self, resources: RankResources, platform: Platform, role: str):
        self._resources, self._platform, self._role = resources, platform, role

    def describe(self, boards: Boards) -> dict | None:
        if not self._platform.exports_device_memory:
            return None
        regions = [Region(g.kind, layer, *self._platform.exported_region(t))
                   for g in self._resources.groups for layer, t in enumerate(g.tensors)]
        return ipc_params(regions, boards.board, boards.layer_board, boards.engine_pid, boards.digests)

    def open(self, peer: PeerDescriptor, kinds: dict[str, int], name: str) -> IpcPeer:
        # A decode instance only reads its peers; others may push into theirs.
        return IpcPeer(peer.transports["ipc"], kinds, self._resources.layer_counts(), name,
                       layer_board_bytes=8 * SLOTS * board_shape(peer.tp)[1], writable=self._role != "decode")

    def close_link(self, link: PeerLink) -> None:
        link.state.close()

    def move(self, link: InstanceLink, routes: list[Route], sides: Sides, pull: bool, local_ids: list[int],
             remote_ids: list[int], layers: range, placement: str, deadline: float) -> tuple[int, Inflight | None]:
        """One kernel call per cache kind: the routes' layers are concatenated into one plan, so a
        rank reading from two peer ranks makes as many calls as one reading from one.  The block
        kernel checks both sides' ids against their capacities."""
        dst_ids, src_ids = (local_ids, remote_ids) if pull else (remote_ids, local_ids)
        moved = 0
        for group in sides:
            kind, rows = group.kind, group.rows
            if not len(rows) or group.first >= len(dst_ids):
                continue
            plans: dict[int, list[CopyPlan]] = {}  # head-range bytes -> one plan per route
            for route in routes:
                peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[kind])
                mine, theirs = _shift(group.side, local_off), _shift(route.peer.state.side(kind), peer_off)
                dst, src = (mine, theirs) if pull else (theirs, mine)
                plans.setdefault(nbytes, []).append(layer_range(CopyPlan(dst, src, nbytes, None), rows.start,
                                                                rows.stop))
            dst, src = dst_ids[group.first:], src_ids[group.first:]
            for nbytes, parts in plans.items():
                self._platform.run_plan(_concat(parts), dst, src, HOST_TO_DEVICE)
                moved += len(dst) * nbytes * len(rows) * len(parts)
        return moved, None

    def move_digested(self, link: InstanceLink, routes: list[Route], sides: Sides, local_ids: list[int],
                      remote_ids: list[int], layers: range, placement: str, deadline: float
                      ) -> tuple[int, Inflight | None, dict[str, Any]]:
        """Where the platform can (``Platform.digests_copies``) and a rank reads whole blocks from one
        peer rank: each kind copied one block at a time, each block hashed right after it landed."""
        if not self._platform.digests_copies or len(routes) != 1:
            return (*self.move(link, routes, sides, True, local_ids, remote_ids, layers, placement, deadline), {})
        route, moved, received = routes[0], 0, {}
        for group in sides:
            kind, rows = group.kind, group.rows
            peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[kind])
            if not len(rows) or group.first >= len(local_ids):
                continue
            if peer_off or local_off or nbytes != route.peer.kind_bytes[kind]:  # a head range: copied, hashed later
                moved += self.move(link, routes, [group], True, local_ids, remote_ids, layers, placement, deadline)[0]
                continue
            plan = layer_range(CopyPlan(group.side, route.peer.state.side(kind), nbytes, None), rows.start, rows.stop)
            dst, src = local_ids[group.first:], remote_ids[group.first:]
            out = np.empty((len(rows), len(dst)), dtype=np.int64)
            self._platform.run_plan_digested(plan, dst, src, HOST_TO_DEVICE, xxh3_address(), out)
            received[kind] = out
            moved += len(dst) * nbytes * len(rows)
        return moved, None, received

    def board_word(self, peer: PeerLink, index: int, deadline: float) -> int:
        return peer.state.board_word(index)

    def layer_board_word(self, peer: PeerLink, index: int, deadline: float) -> int | None:
        return _shm_atomic.load_after_reads(self._layer_board(peer), index)

    def digest_words(self, peer: PeerLink, offset: int, count: int, deadline: float) -> np.ndarray:
        table = peer.state.digests
        if table is None:
            raise PeerError(f"{peer.name}: publishes no digests (its descriptor names no digest table)")
        if offset < 0 or count < 0 or offset + count > len(table):
            raise PeerError(f"{peer.name}: digest region [{offset}, {offset + count}) outside its table")
        return table[offset:offset + count].copy()

    def publish(self, peer: PeerLink, index: int, value: int, deadline: float) -> None:
        # fenced: a load after it (the push ticket, read after "started") cannot pass it
        _shm_atomic.store_fenced(self._layer_board(peer), index, value)

    def writable(self, peer: PeerLink) -> bool:
        return peer.state.layer_board is not None

    def peer_alive(self, peer: PeerLink) -> bool:
        return peer.state.engine_alive()

    @staticmethod
    def _layer_board(peer: PeerLink) -> Any:
        if peer.state.layer_board is None:
            raise PeerError(f"{peer.name}: linked read-only (this instance is a decode instance)")
        return peer.state.layer_board


def _concat(plans: list[CopyPlan]) -> CopyPlan:
    """One plan copying what each of ``plans`` (same block bytes) copies, their layers in turn."""
    if len(plans) == 1:
        return plans[0]

    def join(sides: list[Side]) -> Side:
        if len({s.stride for s in sides}) != 1:
            raise ValueError(f"cannot join sides of strides {[s.stride for s in sides]}")
        return Side(sides[0].name, np.concatenate([s.bases for s in sides]),
                    np.concatenate([s.capacities for s in sides]), sides[0].stride)

    return CopyPlan(join([p.device for p in plans]), join([p.host for p in plans]), plans[0].block_bytes, None)


def _shift(side: Side, offset: int) -> Side:
    """``side`` starting ``offset`` bytes into each block (a head range of a block)."""
    return side if offset == 0 else Side(side.name, side.bases + offset, side.capacities, side.stride)
