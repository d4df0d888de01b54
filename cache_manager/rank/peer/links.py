"""A CTM rank's links to the ranks of other engine instances (prefill/decode, DESIGN §3.11).

The engine drives this with control commands, every rank alike (``peer_command``):
``pd_describe`` (this rank's ``PeerDescriptor``: layout, the generation of its engine's caches, and
where a peer finds its memory over each transport offered), ``pd_link`` (check the peer rank's
layout against ours, choose the transport both offer and open it), ``pd_unlink``.  A rank links to
every peer rank it exchanges kv heads with: rank ``r`` of the other instance when both run one TP
size, otherwise the ranks ``transfer_factory.peer.heads`` names, each with the head range of a block
it reads (``pull_routes``) or writes (``push_routes``).  Each transport is one ``PeerChannel``
(``channel``); this module never branches on a transport's name.

Lifetimes.  A link is made for one generation of the peer's caches (its descriptor's, checked by
every transfer against the peer's board) and one generation of this rank's memory
(``RankResources.memory_generation``): once this rank re-attaches (an RL update, a sleep and
wakeup) every link made before is refused until the engine links again.  Before this rank's memory
is freed each channel lets go of it (``memory_released``).  ``using`` lends a link to one transfer:
an unlink refuses new transfers at once, and closes the link only when the last transfer using it
has ended (a copy never reads unmapped memory).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from ops.layout import describe_caches
from ops.platform import Platform
from transfer_factory.peer import PeerDescriptor, compatible_layouts, usable_transports
from transfer_factory.peer.ipc import PeerUnavailable
from transfer_factory.peer.descriptor import TRANSPORTS, PeerLayout
from transfer_factory.peer.handles import NO_GENERATION
from transfer_factory.peer.heads import reader_spans, writer_spans
from transfer_factory.peer.ipc import Region

from cache_manager.cache_layout import CacheLayout
from cache_manager.rank.peer.tp_rules import refuse_layout, tp_heads
from cache_manager.queue.clocks import boot_id
from cache_manager.rank.peer.channel import Boards, InstanceLink, PeerChannel, PeerError, PeerLink, Route
from cache_manager.rank.peer.datadist import DataDistChannel
from cache_manager.rank.peer.digests import RankDigests
from cache_manager.rank.peer.ipc import IpcChannel
from cache_manager.rank.peer.te import TransferEngineChannel
from cache_manager.rank.resources import RankResources


FIRST_CONTACT_S = 5.0  # how long a link waits for a peer rank it must reach (the Transfer Engine)


class PeerLinks:
    def __init__(self, rank: int, tp: int, role: str, layout: CacheLayout, resources: RankResources,
                 platform: Platform, te_hostname: str, log: logging.Logger):
        self._rank, self._tp, self._role = rank, tp, role
        self._cache_layout = layout
        self._heads = tp_heads(layout)  # (kv heads per rank, replicated, the group a TP change would break)
        self._resources = resources
        self._log = log
        channels: list[PeerChannel] = [
            IpcChannel(resources, platform, role),
            DataDistChannel(rank, tp, role, platform, te_hostname, resources,
                            layout.legacy["cache_dtype"] if layout.legacy else None, self._kinds, log),
            TransferEngineChannel(resources, te_hostname, log),
        ]
        self._channels = {channel.name: channel for channel in channels}  # one per name in TRANSPORTS
        self._links: dict[str, InstanceLink] = {}
        self._lock = threading.Lock()
        self.digests = RankDigests(resources, log)  # this rank's digest table, where its engine publishes them
        # before this rank's memory goes (an RL clear, a sleep, the end): no peer may reach it
        resources.watch_release(self._memory_released)

    # ------------------------------------------------------------------ describe
    def _kinds(self) -> dict[str, int]:
        """Per cache kind, the bytes of one block of one layer."""
        return {g.kind: describe_caches(g.tensors)[1] for g in self._resources.groups}

    def _layout(self) -> PeerLayout:
        ns = self._resources.namespace()
        layout = self._cache_layout
        heads, replicated, _, total = self._heads
        first = (layout.block_groups() or layout.groups)[0]
        return PeerLayout(model_id=ns.model_id, model_version=ns.model_version,
                          cache_dtype=layout.legacy["cache_dtype"] if layout.legacy else ns.cache_dtype,
                          block_size=layout.block_size, num_layers=self._resources.num_layers, kv_heads=heads,
                          head_dim=first.block_shape[-1], mla=replicated, num_blocks=layout.num_blocks,
                          block_bytes=sum(self._kinds().values()),
                          groups=tuple(g.to_json() for g in layout.groups), total_kv_heads=total)

    def describe(self, args: dict) -> dict:
        """This rank's descriptor.  ``args``: ``instance_id``, ``board`` and ``layer_board``
        ([segment, offset, nbytes] of the engine's boards), ``engine_pid``, ``generation`` (of the
        engine's caches) and ``offer`` (transports)."""
        offer = args.get("offer", ["ipc"])
        tables = args.get("digests")  # per rank, [segment, offset, nbytes] of its digest table, if published
        if tables is not None and not (isinstance(tables, list) and len(tables) > self._rank):
            raise ValueError("pd_describe digests must list one digest table per rank")
        table = Region.from_wire(["digests", 0, *tables[self._rank]]) if tables else None
        self.digests.attach(table)
        boards = Boards(args["instance_id"], Region.from_wire(["board", 0, *args["board"]]),
                        Region.from_wire(["layer_board", 0, *args["layer_board"]]), int(args["engine_pid"]), table)
        transports: dict[str, dict] = {}
        for name in TRANSPORTS:
            params = self._channels[name].describe(boards) if name in offer else None
            if params is not None:
                transports[name] = params
        return PeerDescriptor(instance_id=args["instance_id"], role=self._role, rank=self._rank, tp=self._tp,
                              layout=self._layout(), boot_id=boot_id(), transports=transports,
                              generation=int(args.get("generation", 0)), pid=os.getpid()).to_wire()

    def _memory_released(self) -> None:
        """This rank's caches or swap space are about to be let go: every channel lets go first."""
        for channel in self._channels.values():
            try:
                channel.memory_released()
            except Exception:
                self._log.exception("transport %s could not let go of this rank's memory", channel.name)

    # ------------------------------------------------------------------ link / unlink
    def link(self, local_wire: dict, peer_wires: Any, forced: str | None) -> str:
        """Link to the peer ranks this rank exchanges heads with (``peer_wires``: the peer
        instance's descriptors, one per rank).  Refused naming the first field that differs."""
        local = PeerDescriptor.from_wire(local_wire)
        if not isinstance(peer_wires, list) or not peer_wires:
            raise ValueError("pd_link needs the peer instance's descriptors, one per rank")
        peers = [PeerDescriptor.from_wire(w) for w in peer_wires]
        refuse_layout(self._cache_layout, self._heads, self._tp, len(peers))  # names the group a TP change breaks
        for index, peer in enumerate(peers):
            if (peer.rank, peer.tp, peer.instance_id) != (index, len(peers), peers[0].instance_id):
                raise ValueError(f"peer descriptor {index} is rank {peer.rank} of {peer.tp} of {peer.instance_id!r}: "
                                 f"want rank {index} of {len(peers)} of {peers[0].instance_id!r}")
            compatible_layouts(local, peer)
            if peer.generation == NO_GENERATION or peer.generation != peers[0].generation:
                raise ValueError(f"peer descriptor {index} names no generation of its engine's caches "
                                 f"({peer.generation}): describe the peer again once its caches are attached")
        mine, theirs = local.layout, peers[0].layout
        total = mine.total_kv_heads if mine.total_kv_heads == theirs.total_kv_heads else 0
        args = (self._rank, self._tp, mine.kv_heads, len(peers), theirs.kv_heads, mine.mla, total)
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
        channels = {link.channel.name: link.channel for link in opened.values()}
        link = InstanceLink(peers[0].instance_id, len(peers), next(iter(channels.values())),
                            [Route(opened[s.peer_rank], s) for s in pulls],
                            [Route(opened[s.peer_rank], s) for s in pushes], head_bytes,
                            self._resources.memory_generation)
        if len(channels) > 1:  # ranks of one peer chose differently (one on this host, one not)
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
        kinds = {kind: nbytes * peer.layout.kv_heads for kind, nbytes in head_bytes.items()}
        names = usable_transports(local, peer, forced)
        for name, then in zip(names, names[1:]):
            link = PeerLink(peer, self._channels[name], kinds)
            try:
                link.state = link.channel.open(peer, kinds, link.name)
                return link
            except PeerUnavailable as exc:  # one kernel, but not its /dev/shm (or its pids): another container
                if name != "ipc":
                    raise
                self._log.warning("%s: same kernel, but its shared memory is not reachable from here (%s); "
                                  "linking over %s instead", link.name, exc, then)
        link = PeerLink(peer, self._channels[names[-1]], kinds)
        link.state = link.channel.open(peer, kinds, link.name)
        try:
            link.channel.first_contact(link, time.monotonic() + FIRST_CONTACT_S)
        except BaseException:
            link.close()
            raise
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
            if link.memory_generation != self._resources.memory_generation:
                raise PeerError(f"{link.name}: this rank's caches were replaced (an RL update or a sleep) since the "
                                f"link; link again before {what}")
            link.users += 1
        try:
            yield link
        finally:
            with self._lock:
                link.users -= 1
                close = link.unlinked and link.users == 0
            if close:
                link.close()

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
        for channel in self._channels.values():
            channel.close()
        self.digests.close()


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
    if command == "pd_digest":
        return peers.digests.publish(args)
    if command == "pd_unlink":
        peer_id = args.get("peer")
        if type(peer_id) is not str:
            raise ValueError(f"pd_unlink peer {peer_id!r:.40} must be an instance id")
        return peers.unlink(peer_id)
    raise ValueError(f"unknown control command {command!r}")
