"""One interface for every peer transport (DESIGN §3.11): a ``PeerChannel`` per transport, one
``PeerLink`` per peer rank linked over it, and the ``InstanceLink`` that groups a peer instance's
links into the routes a transfer takes.

A channel knows how to: offer itself in this rank's descriptor (``describe``: None where this rank
cannot), open a link to one peer rank from that rank's descriptor (``open``), move runs of bytes over
a link's routes (``move``, every route at once), read a word of the peer engine's exposure board or
layer board *after* every byte it moved from that peer (``board_word``, ``layer_board_word``),
publish a word on the peer's layer board after the bytes it covers (``publish``), say whether the
peer's engine still runs (``peer_alive``), let go of this rank's memory before it is freed
(``memory_released``) and close.  The rank's transfer code (``transfers``) speaks only this
interface: no branch on a transport's name.  Channels: ``ipc`` (same host, mapped segments and the
block kernel), ``mooncake`` (the Transfer Engine) and ``datadist`` (LLM-DataDist on Ascend).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ops.layout import Side
from transfer_factory.peer import PeerDescriptor
from transfer_factory.peer.heads import HeadSpan
from transfer_factory.peer.ipc import Region
from transfer_factory.peer.te import Inflight

@dataclass(frozen=True)
class GroupSide:
    """One cache group's part of a transfer: this rank's side (device blocks or swap slots), the
    rows of it (indices of the group's per-layer tensors) the transfer's model layers cover, and
    the first of the transfer's blocks the group moves (a sliding-window group moves only the
    blocks inside its window: the last ones of the request)."""

    kind: str
    side: Side
    rows: range
    first: int = 0


Sides = list[GroupSide]


class PeerError(RuntimeError):
    """A transfer that cannot count: the message names the peer and why."""


@dataclass
class PeerLink:
    """This rank's link to one rank of the peer instance, over ``channel``; ``state`` is the
    channel's own (mapped memory, addresses, a link token)."""

    descriptor: PeerDescriptor
    channel: "PeerChannel"
    kind_bytes: dict[str, int]  # the peer's bytes of one block of one layer, per cache kind
    state: Any = None

    @property
    def where(self) -> str:
        """The peer rank's address over this link's transport (``this host`` for ``ipc``)."""
        return str(self.descriptor.transports.get(self.transport, {}).get("address", "")) or "this host"

    @property
    def name(self) -> str:
        return f"{self.descriptor.instance_id} rank {self.descriptor.rank}"

    @property
    def transport(self) -> str:
        return self.channel.name

    def close(self) -> None:
        self.channel.close_link(self)


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
    channel: "PeerChannel"
    pull_routes: list[Route]  # where this rank's heads come from
    push_routes: list[Route]  # where this rank's heads go (empty: this rank writes nothing)
    head_bytes: dict[str, int]  # per cache kind, the bytes of one kv head of one block of one layer
    memory_generation: int  # this rank's memory (``RankResources.memory_generation``) when linked

    users: int = 0  # transfers running over it now
    unlinked: bool = False

    @property
    def transport(self) -> str:
        return self.channel.name

    @property
    def board(self) -> PeerLink:
        """Any rank of the peer maps its engine's boards; the first route's is used."""
        return (self.pull_routes or self.push_routes)[0].peer

    @property
    def where(self) -> str:
        """The peer ranks' addresses over this link's transport (``this host`` for ``ipc``)."""
        found = {str(r.peer.descriptor.transports.get(self.transport, {}).get("address", ""))
                 for r in self.pull_routes + self.push_routes} - {""}
        return ", ".join(sorted(found)) or "this host"

    @property
    def name(self) -> str:
        ranks = sorted({r.peer.descriptor.rank for r in self.pull_routes + self.push_routes})
        return f"{self.peer_id} rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    def close(self) -> None:
        for link in {id(r.peer): r.peer for r in self.pull_routes + self.push_routes}.values():
            link.close()


@dataclass(frozen=True)
class Boards:
    """This rank's engine as a descriptor points peers at it: its exposure and layer boards."""

    instance_id: str
    board: Region
    layer_board: Region
    engine_pid: int
    digests: Region | None = None  # this rank's digest table, where the engine publishes digests


class PeerChannel(ABC):
    name: ClassVar[str]

    @abstractmethod
    def describe(self, boards: Boards) -> dict | None:
        """What a peer needs to reach this rank over this transport, or None if this rank cannot
        offer it.  May register this rank's memory and ``boards`` with the transport."""

    @abstractmethod
    def open(self, peer: PeerDescriptor, kinds: dict[str, int], name: str) -> Any:
        """Open a link to ``peer`` (whose blocks of one layer take ``kinds`` bytes per cache kind);
        returns the link's state.  Raises naming ``name`` when the peer's offer does not fit."""

    def first_contact(self, link: PeerLink, deadline: float) -> None:
        """Reach the peer rank once, at link time (a transport whose first transfer to a peer is
        expensive or can hang does it here, while the router knows both are alive); raises naming
        the peer when it cannot be reached or no longer holds the memory its descriptor names."""

    def close_link(self, link: PeerLink) -> None:
        """Let go of what ``open`` made (called once no transfer uses the link)."""

    @abstractmethod
    def move(self, link: InstanceLink, routes: list[Route], sides: Sides, pull: bool, local_ids: list[int],
             remote_ids: list[int], layers: range, placement: str, deadline: float) -> tuple[int, Inflight | None]:
        """Move each route's head range of ``layers`` of the listed blocks between this rank's
        ``sides`` and the peer ranks' (``pull``: into ours); the bytes moved, and what is still in
        flight at ``deadline`` (None once every byte landed)."""

    def move_digested(self, link: InstanceLink, routes: list[Route], sides: Sides, local_ids: list[int],
                      remote_ids: list[int], layers: range, placement: str, deadline: float
                      ) -> tuple[int, Inflight | None, dict[str, Any]]:
        """A pull's ``move``, and per cache kind the XXH3-64 digests (rows x blocks from the group's
        ``first``) of the bytes received where the transport took them as it wrote them (while they
        were in the caches); a kind left out is digested by the caller afterwards."""
        return (*self.move(link, routes, sides, True, local_ids, remote_ids, layers, placement, deadline), {})

    @abstractmethod
    def board_word(self, peer: PeerLink, index: int, deadline: float) -> int:
        """Word ``index`` of the peer engine's exposure board, read after every byte moved so far."""

    def board_words(self, peer: PeerLink, indices: list[int], deadline: float) -> list[int]:
        """Words ``indices`` of the peer engine's exposure board, each read after every byte moved so
        far (a transport may read them in one round trip)."""
        return [self.board_word(peer, index, deadline) for index in indices]

    @abstractmethod
    def layer_board_word(self, peer: PeerLink, index: int, deadline: float) -> int | None:
        """Word ``index`` of the peer engine's layer board, read after every byte moved so far;
        None where the transport cannot read it."""

    @abstractmethod
    def publish(self, peer: PeerLink, index: int, value: int, deadline: float) -> None:
        """Store ``value`` into word ``index`` of the peer engine's layer board, after every byte
        this rank wrote there before."""

    def digest_words(self, peer: PeerLink, offset: int, count: int, deadline: float) -> Any:
        """Words ``[offset, offset + count)`` of the peer rank's digest table (an int64 array), read
        after every byte moved so far (``transfer_factory.peer.digests``)."""
        raise PeerError(f"{peer.name}: digests cannot be read over {self.name}")

    def writable(self, peer: PeerLink) -> bool:
        """Whether this rank may write into the peer's memory over the link."""
        return True

    def peer_alive(self, peer: PeerLink) -> bool:
        """False once the peer's engine is known to be gone (where this transport can tell)."""
        return True

    def memory_released(self) -> None:
        """This rank's caches or swap space are about to be freed: no peer may reach them after."""

    def close(self) -> None:
        """The rank is stopping; every link was closed."""
