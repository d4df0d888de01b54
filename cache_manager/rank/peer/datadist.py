"""The Ascend channel: LLM-DataDist (``transfer_factory.peer.datadist``), offered by NPU ranks with
CANN's SDK.  It moves whole blocks only, so it links only ranks of equal TP sizes.

LLM-DataDist registers every cache before any link, once per endpoint.  So the endpoint is opened
for one incarnation of this rank's memory and of its engine's boards: the next descriptor after a
re-attach or a new prefill/decode side opens a new one, and the memory's release closes the endpoint
(every link over it with it) before the memory is freed.  The decode engine's layer board cannot be
read over it (only the PROMPT role may register a keyed cache): ``layer_board_word`` is None.
"""
from __future__ import annotations

import logging
from typing import Any

from ops.platform import Platform
from ops.shm import segment_identity
from transfer_factory.peer import PeerDescriptor
from transfer_factory.peer.datadist_rank import RankDataDist
from transfer_factory.peer.te import Inflight

from cache_manager.rank.peer.channel import Boards, InstanceLink, PeerChannel, PeerLink, Route, Sides
from cache_manager.rank.resources import RankResources


class DataDistChannel(PeerChannel):
    name = "datadist"

    def __init__(self, rank: int, tp: int, role: str, platform: Platform, ip: str, resources: RankResources,
                 cache_dtype: str | None, kinds: Any, log: logging.Logger):
        """``cache_dtype``: FastDeploy's; None for a grouped cache layout, which LLM-DataDist's whole-block
        caches of one shape per kind and every layer cannot describe (not offered then)."""
        self._resources, self._cache_dtype, self._kinds = resources, cache_dtype, kinds
        self.datadist = RankDataDist(rank, tp, role, platform, ip, log)  # opened when offered
        self._opened_for: tuple | None = None  # (instance, memory generation, board file) of the endpoint

    def describe(self, boards: Boards) -> dict | None:
        if self._cache_dtype is None or not self.datadist.capable():
            return None
        key = (boards.instance_id, self._resources.memory_generation, segment_identity(boards.board.segment))
        if self._opened_for is not None and key != self._opened_for:
            self.datadist.close()  # registered for other memory or another board: never served again
        params = self.datadist.open(boards.instance_id, self._resources.groups, self._kinds(), self._cache_dtype,
                                    self._resources.num_layers, boards.board.segment, boards.layer_board.segment)
        self._opened_for = key
        return params

    def memory_released(self) -> None:
        self.datadist.close()
        self._opened_for = None

    def open(self, peer: PeerDescriptor, kinds: dict[str, int], name: str) -> int:
        return self.datadist.link(name, peer.transports["datadist"])  # this rank is the client that moves bytes

    def close_link(self, link: PeerLink) -> None:
        self.datadist.unlink(link.name, link.state)

    def move(self, link: InstanceLink, routes: list[Route], sides: Sides, pull: bool, local_ids: list[int],
             remote_ids: list[int], layers: range, placement: str, deadline: float) -> tuple[int, Inflight | None]:
        """Whole blocks with the one peer rank of this rank's index; synchronous, so every byte has
        landed when it returns."""
        endpoint = self.datadist.endpoint
        if pull:
            moved = sum(endpoint.pull(r.peer.name, remote_ids, local_ids, layers, placement, deadline) for r in routes)
        else:
            moved = sum(endpoint.push(r.peer.name, local_ids, remote_ids, layers, deadline) for r in routes)
        return moved, None

    def board_word(self, peer: PeerLink, index: int, deadline: float) -> int:
        return self.datadist.endpoint.read_board(peer.name, index, deadline)

    def layer_board_word(self, peer: PeerLink, index: int, deadline: float) -> int | None:
        return None

    def publish(self, peer: PeerLink, index: int, value: int, deadline: float) -> None:
        self.datadist.endpoint.write_layer_word(peer.name, index, value, deadline)

    def close(self) -> None:
        self.datadist.close()
