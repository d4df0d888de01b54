"""A CTM rank's links to the ranks of other engine instances (prefill/decode, DESIGN §3.11).

The engine drives this with control commands, every rank alike (``peer_command``):
``pd_describe`` (this rank's ``PeerDescriptor``: layout, and where a peer finds its memory),
``pd_link`` (check the peer rank's layout against ours, choose the transport both offer and open
it: map its segments, link this rank's LLM-DataDist endpoint to the peer's (NPU ranks), or address
it over this rank's Transfer Engine; endpoints open at the first descriptor that offers them),
``pd_unlink``.  A rank links to every peer rank it exchanges kv heads with: rank ``r`` of the other
instance when both run one TP size, otherwise the ranks ``transfer_factory.peer.heads`` names, each
with the head range of a block it reads (``pull_routes``) or writes (``push_routes``).
``using`` lends a link to one transfer (``peer_transfers``): an unlink refuses new transfers at
once, and unmaps the peer's memory only when the last transfer using it has ended.
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ops import _shm_atomic
from ops.layout import describe_caches
from ops.platform import Platform
from ops.shm import SharedMemorySegment, shm_path
from transfer_factory.peer import PeerDescriptor, choose_transport, compatible_layouts
from transfer_factory.peer.descriptor import CacheLayout
from transfer_factory.peer.datadist_rank import RankDataDist
from transfer_factory.peer.handles import NO_GENERATION
from transfer_factory.peer.heads import HeadSpan, reader_spans, writer_spans
from transfer_factory.peer.ipc import IpcPeer, Region, ipc_params
from transfer_factory.peer.te import ScratchWords, TransferEngineEndpoint

from cache_manager.cache_spec import CacheSpec
from cache_manager.layer_progress import SLOTS, board_shape
from cache_manager.queue.clocks import boot_id
from cache_manager.rank.resources import RankResources


class PeerError(RuntimeError):
    """A pull that cannot count: the message names the peer and why."""


@dataclass
class PeerLink:
    """This rank's link to one rank of the peer instance."""

    descriptor: PeerDescriptor
    transport: str
    kind_bytes: dict[str, int]  # the peer's bytes of one block of one layer, per cache kind
    ipc: IpcPeer | None = None
    te_address: str = ""
    te_bases: dict[str, np.ndarray] | None = None  # kind -> the peer's per-layer addresses
    te_board: int = 0
    te_capacity: int = 0  # the fewest blocks of any of the peer's layers
    te_layer_board: int = 0
    datadist: RankDataDist | None = None  # this rank's endpoint, linked to the peer's under ``name``
    datadist_token: int = 0  # which of its links to that name is this one

    @property
    def name(self) -> str:
        return f"{self.descriptor.instance_id} rank {self.descriptor.rank}"

    def close(self) -> None:
        if self.ipc is not None:
            self.ipc.close()
        if self.datadist is not None:
            self.datadist.unlink(self.name, self.datadist_token)


@dataclass(frozen=True)
class Route:
    """A head range of every block, exchanged with one peer rank."""

    peer: PeerLink
    span: HeadSpan


@dataclass
class InstanceLink:
    """This rank's links to the ranks of one peer instance, and what it exchanges with each."""

    peer_id: str
    peer_tp: int
    transport: str
    pull_routes: list[Route]  # where this rank's heads come from
    push_routes: list[Route]  # where this rank's heads go (empty: this rank writes nothing)
    head_bytes: dict[str, int]  # per cache kind, the bytes of one kv head of one block of one layer

    users: int = 0  # transfers running over it now
    unlinked: bool = False

    @property
    def board(self) -> PeerLink:
        """Any rank of the peer maps its engine's boards; the first route's is used."""
        return (self.pull_routes or self.push_routes)[0].peer

    @property
    def name(self) -> str:
        ranks = sorted({r.peer.descriptor.rank for r in self.pull_routes + self.push_routes})
        return f"{self.peer_id} rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    def close(self) -> None:
        for link in {id(r.peer): r.peer for r in self.pull_routes + self.push_routes}.values():
            link.close()


class PeerLinks:
    def __init__(self, rank: int, tp: int, role: str, spec: CacheSpec, resources: RankResources,
                 platform: Platform, te_hostname: str, log: logging.Logger):
        self._rank, self._tp, self._role = rank, tp, role
        self._spec = spec
        self._resources = resources
        self._platform = platform
        self._log = log
        self.te = TransferEngineEndpoint(te_hostname, "tcp", log)
        self.datadist = RankDataDist(rank, tp, role, platform, te_hostname, log)  # opened when offered
        self._te_scratch = ScratchWords()  # where board words land, one per word in flight
        # our engine's boards as this rank maps them for the TE: (segment name, inode) -> mapping
        self._te_boards: dict[tuple[str, int], SharedMemorySegment] = {}
        self._te_memory: dict[int, int] = {}  # this rank's caches and swap space registered: address -> bytes
        self._te_memory_generation = -1  # the ``memory_generation`` they were registered for
        self._te_reg_lock = threading.Lock()
        self._word_locks: dict[str, threading.Lock] = {}  # per peer address: one word transfer at a time
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        # before this rank's memory goes (an RL clear, a sleep, the end): no peer may reach it
        resources.watch_release(self._memory_released)

    # ------------------------------------------------------------------ describe
    def _kinds(self) -> dict[str, int]:
        """Per cache kind, the bytes of one block of one layer."""
        return {g.kind: describe_caches(g.tensors)[1] for g in self._resources.groups}

    def _layout(self) -> CacheLayout:
        ns = self._resources.namespace()
        spec = self._spec
        return CacheLayout(model_id=ns.model_id, model_version=ns.model_version, cache_dtype=spec.cache_dtype,
                           block_size=spec.block_size, num_layers=self._resources.num_layers, kv_heads=spec.kv_heads,
                           head_dim=spec.head_dim, mla=spec.mla, num_blocks=spec.num_blocks,
                           block_bytes=sum(self._kinds().values()))

    def describe(self, args: dict) -> dict:
        """This rank's descriptor.  ``args``: ``instance_id``, ``board`` ([segment, offset,
        nbytes] of the engine's exposure board), ``engine_pid``, and ``offer`` (transports)."""
        offer = args.get("offer", ["ipc"])
        transports: dict[str, dict] = {}
        board = Region.from_wire(["board", 0, *args["board"]])
        layer_board = Region.from_wire(["layer_board", 0, *args["layer_board"]])
        if "ipc" in offer and self._platform.exports_device_memory:
            regions = [Region(g.kind, layer, *self._platform.exported_region(t))
                       for g in self._resources.groups for layer, t in enumerate(g.tensors)]
            transports["ipc"] = ipc_params(regions, board, layer_board, int(args["engine_pid"]))
        if "datadist" in offer and self.datadist.capable():
            transports["datadist"] = self.datadist.open(args["instance_id"], self._resources.groups, self._kinds(),
                                                        self._spec.cache_dtype, self._resources.num_layers,
                                                        board.segment, layer_board.segment)
        if "mooncake" in offer:
            transports["mooncake"] = self._open_te(board, layer_board)
        return PeerDescriptor(instance_id=args["instance_id"], role=self._role, rank=self._rank, tp=self._tp,
                              layout=self._layout(), boot_id=boot_id(), transports=transports,
                              generation=int(args.get("generation", 0)), pid=os.getpid()).to_wire()

    def _open_te(self, board: Region, layer_board: Region) -> dict:
        """Open the Transfer Engine (once) and register what peers reach through it: the caches and
        swap space attached now, the scratch words, and the engine's boards named now.  What was
        registered for memory since replaced, or for another board (an earlier prefill/decode
        side), is unregistered: a peer linked to it fails, it is never served the new memory."""
        address = self.te.open()
        with self._te_reg_lock:
            if not self._te_boards:
                self.te.register(self._te_scratch.address, self._te_scratch.words.nbytes)
            self._sync_te_memory()
            boards: dict[tuple[str, int], SharedMemorySegment] = {}
            for region in (board, layer_board):
                key = (region.segment, _inode(region.segment))  # a new side may reuse the name
                segment = self._te_boards.get(key) or SharedMemorySegment(region.segment)
                if key not in self._te_boards:
                    self.te.register(_address(segment), segment.size)
                boards[key] = segment
            for key, segment in self._te_boards.items():
                if key not in boards:
                    self.te.unregister(_address(segment))
                    segment.close()
            self._te_boards = boards
            board_address, layer_board_address = (_address(seg) for seg in boards.values())
            regions = []
            for g in self._resources.groups:
                for layer, t in enumerate(g.tensors):
                    regions.append([g.kind, layer, int(t.data_ptr()), int(np.prod(t.shape)) * t.element_size()])
        return {"address": address, "regions": regions, "board": board_address, "layer_board": layer_board_address}

    def te_memory_ready(self) -> None:
        """Before a Transfer Engine transfer: this rank's memory as attached now is registered (a
        re-attach since the last transfer registers the new memory)."""
        if self._te_memory_generation != self._resources.memory_generation:
            with self._te_reg_lock:
                self._sync_te_memory()

    def _sync_te_memory(self) -> None:
        wanted = {}
        for g in self._resources.groups:
            for t in g.tensors:
                wanted[int(t.data_ptr())] = int(np.prod(t.shape)) * t.element_size()
            for ptr in g.host_ptrs:
                wanted[int(ptr)] = self._host_bytes(g)
        for address in [a for a in self._te_memory if self._te_memory[a] != wanted.get(a)]:
            self.te.unregister(address)
            del self._te_memory[address]
        for address, nbytes in wanted.items():
            if address not in self._te_memory:
                self.te.register(address, nbytes)
                self._te_memory[address] = nbytes
        self._te_memory_generation = self._resources.memory_generation

    def _memory_released(self) -> None:
        """This rank's caches or swap space are about to be let go: unregister all of it first."""
        if not self.te.is_open:
            return
        with self._te_reg_lock:
            for address in list(self._te_memory):
                self.te.unregister(address)
            self._te_memory.clear()
            self._te_memory_generation = -1

    def _host_bytes(self, group: Any) -> int:
        return int(group.swap_plan.host.capacities[0]) * group.swap_plan.host.stride

    # ------------------------------------------------------------------ link / unlink
    def link(self, local_wire: dict, peer_wires: Any, forced: str | None) -> str:
        """Link to the peer ranks this rank exchanges heads with (``peer_wires``: the peer
        instance's descriptors, one per rank).  Refused naming the first field that differs."""
        local = PeerDescriptor.from_wire(local_wire)
        if not isinstance(peer_wires, list) or not peer_wires:
            raise ValueError("pd_link needs the peer instance's descriptors, one per rank")
        peers = [PeerDescriptor.from_wire(w) for w in peer_wires]
        for index, peer in enumerate(peers):
            if (peer.rank, peer.tp, peer.instance_id) != (index, len(peers), peers[0].instance_id):
                raise ValueError(f"peer descriptor {index} is rank {peer.rank} of {peer.tp} of {peer.instance_id!r}: "
                                 f"want rank {index} of {len(peers)} of {peers[0].instance_id!r}")
            compatible_layouts(local, peer)
            if peer.generation == NO_GENERATION or peer.generation != peers[0].generation:
                raise ValueError(f"peer descriptor {index} names no generation of its engine's caches "
                                 f"({peer.generation}): describe the peer again once its caches are attached")
        mine, theirs = local.layout, peers[0].layout
        args = (self._rank, self._tp, mine.kv_heads, len(peers), theirs.kv_heads, mine.mla)
        pulls, pushes = reader_spans(*args), writer_spans(*args)
        head_bytes = {kind: nbytes // mine.kv_heads for kind, nbytes in self._kinds().items()}
        opened: dict[int, PeerLink] = {}
        try:
            for span in pulls + pushes:
                if span.peer_rank not in opened:
                    opened[span.peer_rank] = self._open_link(local, peers[span.peer_rank], forced, head_bytes)
        except BaseException:
            for link in opened.values():
                link.close()
            raise
        transports = {link.transport for link in opened.values()}
        link = InstanceLink(peers[0].instance_id, len(peers), transports.pop(),
                            [Route(opened[s.peer_rank], s) for s in pulls],
                            [Route(opened[s.peer_rank], s) for s in pushes], head_bytes)
        if transports:  # ranks of one peer chose differently (one on this host, one not)
            link.close()
            raise PeerError(f"{link.name}: its ranks need different transports; force one")
        with self._lock:
            old = self._links.get(link.peer_id)
            self._links[link.peer_id] = link
        if old is not None:
            self._retire(old)
        self._log.info("linked to %s over %s (heads: pull %s, push %s)", link.name, link.transport,
                       [(r.span.peer_rank, r.span.peer_head, r.span.heads) for r in link.pull_routes],
                       [(r.span.peer_rank, r.span.peer_head, r.span.heads) for r in link.push_routes])
        return link.transport

    def _open_link(self, local: PeerDescriptor, peer: PeerDescriptor, forced: str | None,
                   head_bytes: dict[str, int]) -> PeerLink:
        transport = choose_transport(local, peer, forced)
        kinds = {kind: nbytes * peer.layout.kv_heads for kind, nbytes in head_bytes.items()}
        link = PeerLink(peer, transport, kinds)
        if transport == "ipc":
            # A decode instance only reads its peers; others may push into theirs.
            link.ipc = IpcPeer(peer.transports["ipc"], kinds, self._resources.num_layers, link.name,
                               layer_board_bytes=8 * SLOTS * board_shape(peer.tp)[1], writable=self._role != "decode")
            return link
        if transport == "datadist":  # this rank becomes the client that moves the bytes
            link.datadist_token = self.datadist.link(link.name, peer.transports["datadist"])
            link.datadist = self.datadist
            return link
        params = peer.transports["mooncake"]
        link.te_address = str(params["address"])
        bases: dict[str, list[int]] = {}
        capacity = None
        for kind, layer, ptr, nbytes in params["regions"]:
            if kind not in kinds or not 0 <= layer < self._resources.num_layers or nbytes % kinds[kind]:
                raise PeerError(f"{link.name}: Transfer Engine region {kind!r} layer {layer} does not fit this layout")
            bases.setdefault(kind, [0] * self._resources.num_layers)[layer] = int(ptr)
            capacity = nbytes // kinds[kind] if capacity is None else min(capacity, nbytes // kinds[kind])
        if set(bases) != set(kinds) or any(0 in v for v in bases.values()):
            raise PeerError(f"{link.name}: Transfer Engine regions do not cover every kind and layer")
        link.te_bases = {k: np.asarray(v, dtype=np.int64) for k, v in bases.items()}
        link.te_capacity = capacity or 0
        link.te_board = int(params["board"])
        link.te_layer_board = int(params["layer_board"])
        if not self.te.is_open:
            raise PeerError(f"{link.name}: this rank's Transfer Engine is not open (describe with mooncake first)")
        return link

    def unlink(self, instance_id: str) -> bool:
        """Refuse new transfers over the link at once; its memory goes with its last transfer."""
        with self._lock:
            link = self._links.pop(instance_id, None)
        if link is None:
            return False
        self._retire(link)
        self._log.info("unlinked from %s", link.name)
        return True

    def _retire(self, link: InstanceLink) -> None:
        with self._lock:
            link.unlinked = True
            close = link.users == 0
        if close:
            link.close()

    @contextmanager
    def using(self, peer_id: str, what: str) -> Iterator[InstanceLink]:
        """The link to ``peer_id`` for one transfer: an unlink meanwhile closes its mappings only
        once the last transfer using them has ended (a copy never reads unmapped memory)."""
        with self._lock:
            link = self._links.get(peer_id)
            if link is None:
                raise PeerError(f"not linked to instance {peer_id!r}: link it before {what}")
            link.users += 1
        try:
            yield link
        finally:
            with self._lock:
                link.users -= 1
                close = link.unlinked and link.users == 0
            if close:
                link.close()

    # ------------------------------------------------------------------ board words
    def board_word(self, link: PeerLink, index: int, deadline: float) -> int:
        """Word ``index`` of the peer engine's exposure board (a handle slot or its generation word),
        read now, after every earlier byte this thread moved from the peer."""
        if link.ipc is not None:
            return link.ipc.board_word(index)
        if link.transport == "datadist":
            return self.datadist.endpoint.read_board(link.name, index, deadline)
        return self.read_word(link, link.te_board + 8 * index, deadline)

    def layer_board_word(self, link: PeerLink, index: int, deadline: float) -> int | None:
        """Word ``index`` of the peer engine's layer board, read after every earlier byte moved;
        None where the transport cannot read it (LLM-DataDist)."""
        if link.ipc is not None:
            if link.ipc.layer_board is None:
                raise PeerError(f"{link.name}: linked read-only (this instance is a decode instance)")
            return _shm_atomic.load_after_reads(link.ipc.layer_board, index)
        if link.transport == "datadist":
            return None
        return self.read_word(link, link.te_layer_board + 8 * index, deadline)

    def read_word(self, link: PeerLink, remote: int, deadline: float) -> int:
        with self._word_lock(link), self._te_scratch.take() as scratch:
            return self.te.read_word(link.name, link.te_address, scratch, remote, deadline)

    def write_word(self, link: PeerLink, remote: int, value: int, deadline: float) -> None:
        with self._word_lock(link), self._te_scratch.take() as scratch:
            self.te.write_word(link.name, link.te_address, scratch, remote, value, deadline)

    def _word_lock(self, link: PeerLink) -> threading.Lock:
        """Word transfers to one peer go one at a time (a late one cannot land over a newer one);
        a stalled peer holds up only its own."""
        with self._lock:
            return self._word_locks.setdefault(link.te_address, threading.Lock())

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def tp(self) -> int:
        return self._tp

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:  # the CTM's pools are shut down: no transfer uses them any more
            link.close()
        self.te.close()
        self.datadist.close()
        for segment in self._te_boards.values():
            segment.close()
        self._te_boards = {}


def peer_command(peers: PeerLinks | None, command: str, args: dict, rank: int) -> Any:
    """The engine's ``pd_*`` control commands, on this rank.  Each rank takes its own entry of the
    per-rank lists the engine broadcasts."""
    if peers is None:
        raise RuntimeError("this rank is not serving yet")
    if command == "pd_describe":
        return peers.describe(args)
    if command == "pd_link":
        local, peer, forced = args.get("local"), args.get("peer"), args.get("transport")
        if not (isinstance(local, list) and isinstance(peer, list) and len(local) > rank):
            raise ValueError("pd_link needs the lists 'local' (per rank) and 'peer' (the peer's ranks)")
        return peers.link(local[rank], peer, forced)
    if command == "pd_unlink":
        peer_id = args.get("peer")
        if type(peer_id) is not str:
            raise ValueError(f"pd_unlink peer {peer_id!r:.40} must be an instance id")
        return peers.unlink(peer_id)
    raise ValueError(f"unknown control command {command!r}")


def _inode(name: str) -> int:
    try:
        return os.stat(shm_path(name)).st_ino
    except OSError:
        return -1


def _address(segment: SharedMemorySegment) -> int:
    return int(np.frombuffer(segment.buf, dtype=np.uint8).ctypes.data)
