"""The transfers a CTM rank runs over its links to other engine instances (DESIGN §3.11).

Every transfer goes over the link's *routes* (``links``): one per peer rank this rank exchanges kv
heads with, each a head range of every block (the whole block when both instances run one TP size),
through the link's channel (``channel.PeerChannel``), so the same code serves equal and different TP
sizes and every transport.

* **pull** (decode side, LLM-DataDist's ``pull_blocks``): check the prefill engine's generation
  word and the handle's word, read the exposed source blocks of every cache kind (a layer range or
  all layers) into this rank's device blocks or swap slots, then read both words again: the blocks
  count only if the handle is still LIVE and the generation still the link's (and, on one host,
  the prefill engine still runs), so they hold exactly the request's KV
  (``transfer_factory.peer.handles``).  Otherwise the task fails naming the peer.
* **push** (prefill side, ``push_cache``): publish "started" in this rank's ``pushed`` column of the
  decode engine's layer board, check the ticket word (the decode side's reservation of exactly these
  blocks, ``layer_progress``) and the decode engine's generation, then write each layer of the source
  blocks into the reserved blocks as the engine says the layer is computed (the ticket checked again
  before each), and publish the layer once its bytes landed and the generation still holds; on any
  failure publish FAILED, so the decode side knows this rank writes no more.

A Transfer Engine batch still running at the task's deadline cannot be cancelled: the rank answers
0 blocks and keeps the blocks unreleased (``Outcome.still_running``) until the batch has ended, or
ends itself once it is stuck (``late.LateBatches``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ops.layout import Side, describe_caches, device_side
from transfer_factory.peer.handles import GENERATION_WORD, NO_GENERATION, TransferHandle, holds

from cache_manager.cache_tasks import Outcome, PullTask, PushTask
from cache_manager.layer_progress import (FAILED, FENCED, LayerPublisher, pack, pushed_index, reservation_word,
                                          ticket_index)
from cache_manager.rank.peer.channel import GroupSide, InstanceLink, PeerError
from cache_manager.rank.peer.late import LateBatches
from cache_manager.rank.peer.links import PeerLinks
from cache_manager.rank.resources import RankResources


class PeerTransfers:
    def __init__(self, links: PeerLinks, resources: RankResources, log: logging.Logger,
                 on_stuck: Callable[[str], None], late_limit: float | None = None):
        self._links = links
        self._resources = resources
        self._log = log
        self._rank, self._tp = links.rank, links.tp
        self._late = LateBatches(on_stuck, late_limit)  # transfers that outlived their task
        self._device_sides: dict[int, tuple[Any, Side]] = {}  # id(group) -> (group, its device side)
        self._sides_of: list | None = None  # the groups list those sides describe

    # ------------------------------------------------------------------ pull
    def pull(self, task: PullTask, deadline: float) -> Outcome:
        with self._links.using(task.peer, "pulling") as link:
            return self._pull(link, task, deadline)

    def _pull(self, link: InstanceLink, task: PullTask, deadline: float) -> Outcome:
        handle = TransferHandle.from_wire(task.handle)
        if handle.instance_id != task.peer:
            raise PeerError(f"handle of instance {handle.instance_id!r} used for a pull from {task.peer!r}")
        layers = range(*(task.layers or (0, self._resources.num_layers)))
        if layers.stop > self._resources.num_layers:
            raise ValueError(f"pull layers [{layers.start}, {layers.stop}) past this model's {self._resources.num_layers}")
        if not self._still_exposed(link, handle, deadline, "before the pull"):
            raise PeerError(f"{link.name}: handle of request {handle.req_id!r} is no longer exposed")
        sides = self._sides(task.placement, layers, len(task.dst_block_ids))
        # with digests: the source's region is read while the bytes move, checked after them
        region = self._links.digests.start(link, handle, deadline) if task.digests else None
        received: dict = {}  # per kind, the digests of the bytes received, where the transport took them
        if region is None:
            moved, inflight = link.channel.move(link, link.pull_routes, sides, True, task.dst_block_ids,
                                                task.src_block_ids, layers, task.placement, deadline)
        else:
            moved, inflight, received = link.channel.move_digested(link, link.pull_routes, sides, task.dst_block_ids,
                                                                   task.src_block_ids, layers, task.placement,
                                                                   deadline)
        if inflight is None and task.state_slots is not None:  # the request's state, once, after its blocks
            src, dst = task.state_slots
            state, inflight = link.channel.move(link, link.pull_routes, self._state_sides(), True, [dst], [src],
                                                layers, "device", deadline)
            moved += state
        if inflight is not None:  # bytes may still land in the destination: fail now, release later
            return Outcome(value=[], still_running=self._late.watch(inflight), error=(
                f"PeerError: {link.name} at {link.where}: the pull was still running at its deadline (the peer "
                "stopped, or the network between us is down); its blocks stay held until no byte can land"))
        bad, why = [], ""
        if region is not None:  # the received bytes against the source's digests, before the handle's word
            bad, why = self._links.digests.check(link, handle, sides, task.dst_block_ids, task.src_block_ids,
                                                 region, received, deadline)
        if not self._still_exposed(link, handle, deadline, "during the pull"):
            raise PeerError(f"{link.name}: request {handle.req_id!r} was retracted or its engine is gone "
                            "during the pull; no block counts")
        if bad:  # failed blocks, never data: the others are loaded, the task fails naming them
            failed = set(bad)
            return Outcome(value=[b for b in task.dst_block_ids if b not in failed], bytes_moved=moved, error=why,
                           digest_mismatches=len(bad))
        return Outcome(value=list(task.dst_block_ids), bytes_moved=moved)

    # ------------------------------------------------------------------ push
    def push(self, task: PushTask, deadline: float, compute: LayerPublisher | None, stop: threading.Event) -> Outcome:
        """Write each layer of the source blocks into the peer's reserved blocks, then publish the
        layer on the peer's layer board; on any failure publish FAILED there, so the peer's
        ``wait_for_layer`` fails at once and it knows this rank writes no more."""
        with self._links.using(task.peer, "pushing") as link:
            return self._push(link, task, deadline, compute, stop)

    def _push(self, link: InstanceLink, task: PushTask, deadline: float, compute: LayerPublisher | None,
              stop: threading.Event) -> Outcome:
        if not link.channel.writable(link.board):
            raise PeerError(f"{link.name}: linked read-only (this instance is a decode instance)")
        if not link.push_routes:  # MLA onto fewer decode ranks: another prefill rank writes their latent
            return Outcome(value=list(task.dst_block_ids))
        moved = 0
        try:
            self._publish(link, task, 0, deadline)  # started: a cancel from now on waits for this rank
            self._check_ticket(link, task, deadline)
            self._check_generation(link, None, "before the push", deadline)
            # Layer by layer as the engine computes them; a push of computed blocks moves every
            # layer in one copy per kind (one batch) and publishes once.
            layerwise = compute is not None and compute.ref.await_compute
            num_layers = self._resources.num_layers
            steps = [range(l, l + 1) for l in range(num_layers)] if layerwise else [range(num_layers)]
            for step in steps:
                if layerwise:
                    compute.wait_computed(step.stop, deadline, stop)
                    self._check_ticket(link, task, deadline)  # cancelled or closed meanwhile: stop
                sides = self._sides("device", step, len(task.dst_block_ids))
                written, inflight = link.channel.move(link, link.push_routes, sides, False, task.src_block_ids,
                                                      task.dst_block_ids, step, "device", deadline)
                if inflight is None and task.state_slots is not None and step.stop == num_layers:
                    src, dst = task.state_slots  # the request's state, once, before its last layer is published
                    state, inflight = link.channel.move(link, link.push_routes, self._state_sides(), False, [src],
                                                        [dst], step, "device", deadline)
                    written += state
                moved += written
                if inflight is not None:  # may still land: FAILED only once it ended
                    return Outcome(value=[], bytes_moved=moved, still_running=self._late.watch(
                        inflight, lambda: self._fail_push_late(link, task)), error=(
                        f"PeerError: {link.name} at {link.where}: layers [{step.start}, {step.stop}) were still "
                        "being written at the push's deadline (the peer stopped, or the network is down)"))
                self._check_generation(link, None, f"while layers [{step.start}, {step.stop}) were pushed",
                                       deadline)
                self._publish(link, task, step.stop, deadline)
        except BaseException:
            try:
                self._publish(link, task, FAILED, deadline + 1.0)
            except Exception as exc:  # the peer is gone or stopped: it will not wait for this word
                self._log.warning("push %s: could not tell %s it failed: %s", task.task_id, link.name, exc)
            raise
        return Outcome(value=list(task.dst_block_ids), bytes_moved=moved)

    def _fail_push_late(self, link: InstanceLink, task: PushTask) -> None:
        """A push's late batch ended: only now may the decode side hear this rank writes no more."""
        try:
            self._publish(link, task, FAILED, time.monotonic() + 5.0)
        except Exception as exc:
            self._log.warning("push %s: could not tell %s it failed: %s", task.task_id, link.name, exc)

    def _publish(self, link: InstanceLink, task: PushTask, value: int, deadline: float) -> None:
        """This rank's word in the decode engine's layer board (every decode rank maps that board:
        the first route's is used; a word goes after the bytes it covers, on every route)."""
        link.channel.publish(link.board, pushed_index(link.peer_tp, task.target.slot, self._rank),
                             pack(task.target.seq, value), deadline)

    # ------------------------------------------------------------------ checks
    def _still_exposed(self, link: InstanceLink, handle: TransferHandle, deadline: float, when: str) -> bool:
        """Whether the handle's word still says LIVE and the peer's engine still runs (where the
        channel can tell); raises if its caches are no longer the link's generation.  Both words in
        one read, after every byte moved so far."""
        peer = link.board
        generation, word = peer.channel.board_words(peer, [GENERATION_WORD, handle.slot], deadline)
        self._check_generation(link, generation, when)
        return holds(word, handle) and peer.channel.peer_alive(peer)

    def _check_ticket(self, link: InstanceLink, task: PushTask, deadline: float) -> None:
        """The decode side still accepts this push into exactly these blocks: its ticket word equals
        the digest of the ticket's seq, blocks and tenant salt tag (``layer_progress.reservation_word``)."""
        word = link.channel.layer_board_word(link.board, ticket_index(link.peer_tp, task.target.slot), deadline)
        if word is None:  # LLM-DataDist: the decode's layer board cannot be read (README, "Limits")
            return
        if word != reservation_word(task.target.seq, task.dst_block_ids, task.salt_tag):
            why = ("fenced (the decode side cancelled or closed it, or it was pushed already)" if word == FENCED
                   else "not the reservation the decode side made (other blocks, another reservation's slot, "
                        "or another tenant's cache_salt)")
            raise PeerError(f"{link.name}: push ticket of slot {task.target.slot} is {why}; nothing more is written")

    def _check_generation(self, link: InstanceLink, now: int | None, when: str, deadline: float = 0.0) -> None:
        """The peer engine's caches are still those its descriptor named: its board's generation word
        ``now`` (read here when None, after every byte moved so far) is the link's; else nothing of
        this transfer counts."""
        board = link.board
        if now is None:
            now = board.channel.board_word(board, GENERATION_WORD, deadline)
        if now != board.descriptor.generation:
            state = "closed its prefill/decode side or is replacing its caches" if now == NO_GENERATION else \
                f"replaced its caches (generation {board.descriptor.generation} -> {now})"
            raise PeerError(f"{link.name}: its engine {state} {when}; no block counts: describe it and link "
                            "again")

    # ------------------------------------------------------------------ memory
    def _sides(self, placement: str, layers: range, blocks: int) -> list[GroupSide]:
        """Each block group's part of a transfer of ``blocks`` blocks (a request's, in order) of
        model ``layers``: a sliding-window group moves only the blocks inside its window."""
        block_size = self._resources.layout.block_size
        out = []
        for g in self._resources.block_groups():
            window = g.spec.window_blocks(block_size)
            out.append(GroupSide(g.kind, self._local_side(g, placement), self._resources.rows(g, layers),
                                 0 if window is None else max(0, blocks - window)))
        return out

    def _state_sides(self) -> list[GroupSide]:
        """The state groups' part of a transfer: one slot, every layer the group has."""
        groups = [g for g in self._resources.groups if not g.moves_by_block]
        if not groups:
            raise ValueError("state_slots: this cache layout has no state group")
        return [GroupSide(g.kind, self._local_side(g, "device"), range(len(g.tensors))) for g in groups]

    def _local_side(self, group: Any, placement: str) -> Side:
        if placement == "host":
            if group.swap_plan is None:
                raise ValueError("this CTM has no host swap space (--num_cpu_blocks 0) to pull into")
            return group.swap_plan.host
        # Described once per attached group (a re-attach makes new groups): describing every
        # layer's tensor per task cost ~0.1 ms at 16 tensors, and grows with the layers.
        if self._sides_of is not self._resources.groups:  # re-attached: drop the old groups' tensors
            self._device_sides, self._sides_of = {}, self._resources.groups
        cached = self._device_sides.get(id(group))
        if cached is None or cached[0] is not group:
            infos, block_bytes = describe_caches(group.tensors)
            cached = self._device_sides[id(group)] = (group, device_side(infos, block_bytes))
        return cached[1]

    def close(self) -> None:
        """Wait for late batches (each bounded) before the memory they move is unregistered
        (``PeerLinks.close`` comes next)."""
        self._late.close()
