"""The cross-host channel: the Mooncake Transfer Engine (``transfer_factory.peer.te``).

This rank's endpoint opens at the first descriptor that offers ``mooncake``.  What peers reach
through it is registered then and kept in step with the memory: the caches and swap space as
attached now (re-registered before the next transfer after a re-attach, unregistered *before* the
memory is freed: ``memory_released``), the scratch words board words move through, and the boards
the latest descriptor names (a new prefill/decode side's board replaces the old one, which is
unregistered: a peer still linked to it fails, it is never served the new memory).

Every route's runs of a transfer are in flight together.  Board words move one at a time per peer
address, each through its own scratch word; a word transfer that outlives its deadline keeps its
scratch word for good (``ScratchWords``), so a late word never lands in a newer one's.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numpy as np

from ops.shm import SharedMemorySegment, segment_identity
from transfer_factory.peer import PeerDescriptor
from transfer_factory.peer.handles import GENERATION_WORD
from transfer_factory.peer.te import (Inflight, PeerTransferError, ScratchRegions, ScratchWords,
                                      TransferEngineEndpoint, block_addresses, coalesce)

from cache_manager.rank.peer.channel import Boards, InstanceLink, PeerChannel, PeerError, PeerLink, Route, Sides
from cache_manager.rank.peer.landed import LandedDigests, whole_blocks
from cache_manager.rank.resources import RankResources


class TePeer:
    """A peer rank's memory as its Transfer Engine offers it."""

    def __init__(self, params: dict, kinds: dict[str, int], layer_counts: dict[str, int], name: str):
        """``kinds``: per cache group, its bytes per block; ``layer_counts``: its layer tensors."""
        self.address = str(params["address"])
        bases: dict[str, list[int]] = {}
        capacities: dict[str, int] = {}
        for kind, layer, ptr, nbytes in params["regions"]:
            if kind not in kinds or not 0 <= layer < layer_counts[kind] or nbytes % kinds[kind]:
                raise PeerError(f"{name}: Transfer Engine region {kind!r} layer {layer} does not fit this layout")
            bases.setdefault(kind, [0] * layer_counts[kind])[layer] = int(ptr)
            capacities[kind] = min(capacities.get(kind, nbytes // kinds[kind]), nbytes // kinds[kind])
        if set(bases) != set(kinds) or any(0 in v for v in bases.values()):
            raise PeerError(f"{name}: Transfer Engine regions do not cover every kind and layer")
        self.bases = {k: np.asarray(v, dtype=np.int64) for k, v in bases.items()}
        self.capacities = capacities  # per kind, the fewest blocks (state: slots) of any of the peer's layers
        self.board = int(params["board"])
        self.layer_board = int(params["layer_board"])
        table = params.get("digests")  # [address, bytes] of its digest table, where it publishes digests
        if table is not None and not (isinstance(table, list) and len(table) == 2 and all(type(v) is int and v >= 0
                                                                                          for v in table)):
            raise PeerError(f"{name}: Transfer Engine digest table {table!r:.60} must be [address, bytes]")
        self.digests: tuple[int, int] | None = (table[0], table[1]) if table else None


class TransferEngineChannel(PeerChannel):
    name = "mooncake"

    def __init__(self, resources: RankResources, hostname: str, log: logging.Logger):
        self._resources = resources
        self._log = log
        self.te = TransferEngineEndpoint(hostname, "tcp", log)
        self._scratch = ScratchWords()  # where board words land, one per word in flight
        self._regions = ScratchRegions()  # where peers' digest regions land
        self._boards: dict[tuple, SharedMemorySegment] = {}  # (segment, its file identity) -> our mapping
        self._memory: dict[int, int] = {}  # this rank's caches and swap space registered: address -> bytes
        self._memory_generation = -1  # the ``memory_generation`` they were registered for
        self._lock = threading.Lock()
        self._word_locks: dict[str, threading.Lock] = {}  # per peer address: one word transfer at a time

    # ------------------------------------------------------------------ registration
    def describe(self, boards: Boards) -> dict:
        address = self.te.open()
        with self._lock:
            if not self._boards:
                self.te.register(self._scratch.address, self._scratch.words.nbytes)
            self._sync_memory()
            mapped: dict[tuple, SharedMemorySegment] = {}
            addresses = []
            # the boards, and the digest table where the engine publishes digests
            for region in (boards.board, boards.layer_board) + ((boards.digests,) if boards.digests else ()):
                key = (region.segment, segment_identity(region.segment))  # a new side may reuse the name
                segment = self._boards.get(key) or SharedMemorySegment(region.segment)
                if key not in self._boards:
                    self.te.register(_address(segment), segment.size)
                mapped[key] = segment
                addresses.append(_address(segment))
            for key, segment in self._boards.items():
                if key not in mapped:
                    self.te.unregister(_address(segment))
                    segment.close()
            self._boards = mapped
            regions = [[g.kind, layer, int(t.data_ptr()), int(np.prod(t.shape)) * t.element_size()]
                       for g in self._resources.groups for layer, t in enumerate(g.tensors)]
        out = {"address": address, "regions": regions, "board": addresses[0], "layer_board": addresses[1]}
        if boards.digests is not None:
            out["digests"] = [addresses[2], boards.digests.nbytes]
        return out

    def _sync_memory(self) -> None:
        wanted = {}
        for g in self._resources.groups:
            for t in g.tensors:
                wanted[int(t.data_ptr())] = int(np.prod(t.shape)) * t.element_size()
            for ptr in g.host_ptrs:
                wanted[int(ptr)] = int(g.swap_plan.host.capacities[0]) * g.swap_plan.host.stride
        for address in [a for a in self._memory if self._memory[a] != wanted.get(a)]:
            self.te.unregister(address)
            del self._memory[address]
        for address, nbytes in wanted.items():
            if address not in self._memory:
                self.te.register(address, nbytes)
                self._memory[address] = nbytes
        self._memory_generation = self._resources.memory_generation

    def memory_released(self) -> None:
        if not self.te.is_open:
            return
        with self._lock:
            for address in list(self._memory):
                self.te.unregister(address)
            self._memory.clear()
            self._memory_generation = -1

    # ------------------------------------------------------------------ links and transfers
    def open(self, peer: PeerDescriptor, kinds: dict[str, int], name: str) -> TePeer:
        state = TePeer(peer.transports["mooncake"], kinds, self._resources.layer_counts(), name)
        if not self.te.is_open:
            raise PeerError(f"{name}: this rank's Transfer Engine is not open (describe with mooncake first)")
        return state

    def first_contact(self, link: PeerLink, deadline: float) -> None:
        """Mooncake 0.3.13 makes its handshake with a peer inside the first transfer, holding the
        process's GIL: a peer that accepted the connection but does not answer (a stopped process)
        froze the whole rank for up to a minute at its first pull.  The handshake happens here
        instead, reading the peer engine's generation word, which must still be the descriptor's."""
        try:
            word = self.board_word(link, GENERATION_WORD, deadline)
        except PeerTransferError as exc:
            raise PeerError(f"{link.name} at {link.where}: cannot be reached to link ({exc})") from None
        if word != link.descriptor.generation:
            raise PeerError(f"{link.name} at {link.where}: its engine's caches were replaced since it was "
                            f"described (generation {word}, not {link.descriptor.generation}): describe it again")

    def move(self, link: InstanceLink, routes: list[Route], sides: Sides, pull: bool, local_ids: list[int],
             remote_ids: list[int], layers: range, placement: str, deadline: float) -> tuple[int, Inflight | None]:
        """One transfer with the routes' peer ranks, all at once, of each route's head range of
        every kind's ``layers``, adjacent ranges coalesced."""
        jobs, _ = self._jobs(link, routes, sides, pull, local_ids, remote_ids)
        return sum(sum(job[4]) for job in jobs), self._transfer(jobs, not pull, deadline)

    def move_digested(self, link: InstanceLink, routes: list[Route], sides: Sides, local_ids: list[int],
                      remote_ids: list[int], layers: range, placement: str, deadline: float
                      ) -> tuple[int, Inflight | None, dict[str, Any]]:
        """A pull whose blocks are digested as their runs land, while the others are still in
        flight (a rank reading whole blocks from one peer rank; otherwise after the transfer)."""
        if not whole_blocks(link, routes, sides):
            return super().move_digested(link, routes, sides, local_ids, remote_ids, layers, placement, deadline)
        jobs, runs = self._jobs(link, routes, sides, True, local_ids, remote_ids)
        digests = LandedDigests(sides, local_ids, runs[0], [routes[0].peer.kind_bytes[g.kind] for g in sides], self._log)
        inflight = self._transfer(jobs, False, deadline, digests.landed)
        return sum(sum(job[4]) for job in jobs), inflight, digests.result() if inflight is None else {}

    def _jobs(self, link: InstanceLink, routes: list[Route], sides: Sides, pull: bool, local_ids: list[int],
              remote_ids: list[int]) -> tuple[list[tuple], list[list[tuple[int, int, int]]]]:
        """Per route, its peer's job for ``transfer_many``, and per run of it (group index, first
        item, items): the items of a group are its blocks of its rows, row by row."""
        for group in sides:
            _check_ids(local_ids, int(group.side.capacities.min()), "destination" if pull else "source")
        jobs, items = [], []
        for route in routes:
            peer: TePeer = route.peer.state
            local_addrs: list[int] = []
            remote_addrs: list[int] = []
            lengths: list[int] = []
            route_items: list[tuple[int, int, int]] = []
            for index, group in enumerate(sides):
                kind, local, rows, first = group.kind, group.side, group.rows, group.first
                _check_ids(remote_ids, peer.capacities[kind], "source" if pull else "destination")
                peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[kind])
                runs = coalesce(block_addresses(local.bases + local_off, local.stride, local_ids[first:], rows),
                                block_addresses(peer.bases[kind] + peer_off, route.peer.kind_bytes[kind],
                                                remote_ids[first:], rows), nbytes)
                local_addrs += runs[0]
                remote_addrs += runs[1]
                lengths += runs[2]
                start = 0
                for length in runs[2]:
                    route_items.append((index, start, length // nbytes))
                    start += length // nbytes
            jobs.append((route.peer.name, peer.address, local_addrs, remote_addrs, lengths))
            items.append(route_items)
        return jobs, items

    def _transfer(self, jobs: list[tuple], write: bool, deadline: float,
                  on_landed: Callable[[list[tuple[int, int]]], None] | None = None) -> Inflight | None:
        if self._memory_generation != self._resources.memory_generation:  # re-attached since: register anew
            with self._lock:
                self._sync_memory()
        return self.te.transfer_many(jobs, write, deadline, on_landed)

    def board_word(self, peer: PeerLink, index: int, deadline: float) -> int:
        return self._read(peer, [peer.state.board + 8 * index], deadline)[0]

    def board_words(self, peer: PeerLink, indices: list[int], deadline: float) -> list[int]:
        return self._read(peer, [peer.state.board + 8 * i for i in indices], deadline)  # one round trip

    def layer_board_word(self, peer: PeerLink, index: int, deadline: float) -> int | None:
        return self._read(peer, [peer.state.layer_board + 8 * index], deadline)[0]

    def digest_words(self, peer: PeerLink, offset: int, count: int, deadline: float) -> np.ndarray:
        table = peer.state.digests
        if table is None:
            raise PeerError(f"{peer.name}: publishes no digests (its descriptor names no digest table)")
        if offset < 0 or count < 0 or 8 * (offset + count) > table[1]:
            raise PeerError(f"{peer.name}: digest region [{offset}, {offset + count}) outside its table")
        try:
            return self._regions.read(self.te, peer.name, peer.state.address, table[0] + 8 * offset, count, deadline)
        except PeerTransferError as exc:
            raise PeerError(f"{peer.name} at {peer.where}: its digests could not be read ({exc})") from None

    def publish(self, peer: PeerLink, index: int, value: int, deadline: float) -> None:
        with self._word_lock(peer), self._scratch.take() as scratch:
            self.te.write_word(peer.name, peer.state.address, scratch[0], peer.state.layer_board + 8 * index, value,
                               deadline)

    def _read(self, peer: PeerLink, remotes: list[int], deadline: float) -> list[int]:
        with self._word_lock(peer), self._scratch.take(len(remotes)) as scratch:
            return self.te.read_words(peer.name, peer.state.address, scratch, remotes, deadline)

    def _word_lock(self, peer: PeerLink) -> threading.Lock:
        """Word transfers to one peer go one at a time (a late one cannot land over a newer one);
        a stalled peer holds up only its own."""
        with self._lock:
            return self._word_locks.setdefault(peer.state.address, threading.Lock())

    def close(self) -> None:
        self.te.close()
        for segment in self._boards.values():
            segment.close()
        self._boards = {}


def _check_ids(ids: list[int], capacity: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < capacity]
    if bad:
        raise ValueError(f"{what} block ids {bad[:8]} outside [0, {capacity})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} block ids list a block twice")


def _address(segment: SharedMemorySegment) -> int:
    return int(np.frombuffer(segment.buf, dtype=np.uint8).ctypes.data)
