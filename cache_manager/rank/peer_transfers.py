"""The transfers a CTM rank runs over its links to other engine instances (DESIGN §3.11).

Every transfer goes over the link's *routes* (``peer_links``): one per peer rank this rank
exchanges kv heads with, each a head range of every block (the whole block when both instances run
one TP size), so the same code serves equal and different TP sizes.

* **pull** (decode side, LLM-DataDist's ``pull_blocks``): read the exposed source blocks of every
  cache kind (a layer range or all layers) into this rank's device blocks or swap slots, each head
  range from the prefill rank that holds it, then read
  the handle's word on the prefill engine's exposure board: the blocks count only if the handle is
  still LIVE (and, on one host, the prefill engine still runs), so they hold exactly the request's
  KV (``transfer_factory.peer.handles``).  Otherwise the task fails naming the peer.
* **push** (prefill side, ``push_cache``): write each layer of the source blocks into the blocks the
  decode instance reserved (each head range into the decode rank that owns it), as the engine says
  the layer is computed, and publish the layer in this rank's ``pushed`` column of the decode
  engine's layer board; on failure publish FAILED there, so the decode side knows this rank writes
  no more.

A Transfer Engine batch still running at the task's deadline cannot be cancelled: the rank answers
0 blocks and keeps the blocks unreleased (``Outcome.still_running``) until the batch has ended.
Over LLM-DataDist (NPU ranks, whole blocks) every call is synchronous and bounded by its
``sync_kv_timeout``, and none starts after the deadline (``transfer_factory.peer.datadist``).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ops.layout import CopyPlan, Side, describe_caches, device_side, layer_range
from ops.modes import HOST_TO_DEVICE
from ops import _shm_atomic
from ops.platform import Platform
from transfer_factory.peer.handles import GENERATION_WORD, NO_GENERATION, TransferHandle, holds
from transfer_factory.peer.te import Inflight, block_addresses, coalesce

from cache_manager.cache_tasks import Outcome, PullTask, PushTask
from cache_manager.layer_progress import (FAILED, FENCED, LayerPublisher, pack, pushed_index, reservation_word,
                                          ticket_index)
from cache_manager.rank.peer_links import InstanceLink, PeerError, PeerLink, PeerLinks, Route
from cache_manager.rank.resources import RankResources


class PeerTransfers:
    def __init__(self, links: PeerLinks, resources: RankResources, platform: Platform, log: logging.Logger):
        self._links = links
        self._resources = resources
        self._platform = platform
        self._log = log
        self._rank, self._tp = links.rank, links.tp
        # Waits for Transfer Engine batches that outlived their task (they cannot be cancelled):
        # their destination blocks are released only once they end.
        self._late = ThreadPoolExecutor(2, thread_name_prefix="pd-late")
        self._stopping = threading.Event()
        self._device_sides: dict[int, tuple[Any, Side]] = {}  # id(group) -> (group, its device side)
        self._sides_of: list | None = None  # the groups list those sides describe

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
        self._check_generation(link, deadline, "before the pull")
        if not self._holds(link.board, handle, deadline):
            raise PeerError(f"{link.name}: handle of request {handle.req_id!r} is no longer exposed")
        moved = 0
        sides = [(g.kind, self._local_side(g, task.placement)) for g in self._resources.groups]
        if link.transport == "ipc":  # each head range from the prefill rank that holds it
            moved += self._copy_ipc(link, link.pull_routes, sides, True, task.dst_block_ids, task.src_block_ids,
                                    layers)
        elif link.transport == "datadist":  # whole blocks from the one rank of our index (equal TP sizes)
            moved += sum(self._links.datadist.endpoint.pull(r.peer.name, task.src_block_ids, task.dst_block_ids,
                                                            layers, task.placement, deadline) for r in link.pull_routes)
        else:  # the Transfer Engine: every prefill rank holding some of our heads at once
            written, inflight = self._transfer_te(link, link.pull_routes, False, sides, task.dst_block_ids,
                                                  task.src_block_ids, layers, deadline)
            moved += written
            if inflight is not None:  # bytes may still land in the destination: release it later
                self._log.error("pull %s from %s: still running at its deadline; its blocks stay held until it ends",
                                task.task_id, link.name)
                return Outcome(value=[], still_running=self._late.submit(self._wait_late, inflight))
        if not self._holds(link.board, handle, deadline):
            raise PeerError(f"{link.name}: request {handle.req_id!r} was retracted or its engine is gone "
                            "during the pull; no block counts")
        self._check_generation(link, deadline, "during the pull")
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
        if link.board.ipc is not None and link.board.ipc.layer_board is None:
            raise PeerError(f"{link.name}: linked read-only (this instance is a decode instance)")
        if not link.push_routes:  # MLA onto fewer decode ranks: another prefill rank writes their latent
            return Outcome(value=list(task.dst_block_ids))
        layers = self._resources.num_layers
        sides = [(g.kind, self._local_side(g, "device")) for g in self._resources.groups]
        moved = 0
        try:
            self._publish(link, task, 0, deadline)  # started: a cancel from now on waits for this rank
            self._check_ticket(link, task, deadline)
            self._check_generation(link, deadline, "before the push")
            # Layer by layer as the engine computes them; a push of computed blocks moves every
            # layer in one copy per kind (one batch) and publishes once.
            layerwise = compute is not None and compute.ref.await_compute
            steps = [range(l, l + 1) for l in range(layers)] if layerwise else [range(layers)]
            for step in steps:
                if layerwise:
                    compute.wait_computed(step.stop, deadline, stop)
                    self._check_ticket(link, task, deadline)  # cancelled or closed meanwhile: stop
                if link.transport == "ipc":  # each head range into the decode rank that owns it
                    moved += self._copy_ipc(link, link.push_routes, sides, False, task.dst_block_ids,
                                            task.src_block_ids, step)
                elif link.transport == "datadist":  # synchronous: the layer has landed when it returns
                    moved += sum(self._links.datadist.endpoint.push(r.peer.name, task.src_block_ids,
                                                                    task.dst_block_ids, step, deadline)
                                 for r in link.push_routes)
                else:
                    written, inflight = self._transfer_te(link, link.push_routes, True, sides, task.src_block_ids,
                                                          task.dst_block_ids, step, deadline)
                    moved += written
                    if inflight is not None:  # may still land: FAILED only once it ended
                        self._log.error("push %s to %s: layers [%d, %d) still being written at its deadline",
                                        task.task_id, link.name, step.start, step.stop)
                        return Outcome(value=[], bytes_moved=moved, still_running=self._late.submit(
                            self._fail_push_late, inflight, link, task))
                self._check_generation(link, deadline, f"while layers [{step.start}, {step.stop}) were pushed")
                self._publish(link, task, step.stop, deadline)
        except BaseException:
            try:
                self._publish(link, task, FAILED, deadline + 1.0)
            except Exception as exc:  # the peer is gone or stopped: it will not wait for this word
                self._log.warning("push %s: could not tell %s it failed: %s", task.task_id, link.name, exc)
            raise
        return Outcome(value=list(task.dst_block_ids), bytes_moved=moved)

    def _fail_push_late(self, inflight: Inflight, link: InstanceLink, task: PushTask) -> None:
        self._wait_late(inflight)
        try:
            self._publish(link, task, FAILED, time.monotonic() + 5.0)
        except Exception as exc:
            self._log.warning("push %s: could not tell %s it failed: %s", task.task_id, link.name, exc)

    def _publish(self, link: InstanceLink, task: PushTask, value: int, deadline: float) -> None:
        """This rank's word in the decode engine's layer board (every decode rank maps that board:
        the first route's is used; a word goes after the bytes it covers, on every route)."""
        index = pushed_index(link.peer_tp, task.target.slot, self._rank)
        word = pack(task.target.seq, value)
        board = link.board
        if board.ipc is not None:  # fenced: the ticket read after "started" cannot pass it (layer_progress)
            _shm_atomic.store_fenced(board.ipc.layer_board, index, word)
        elif board.transport == "datadist":
            self._links.datadist.endpoint.write_layer_word(board.name, index, word, deadline)
        else:
            self._links.write_word(board, board.te_layer_board + 8 * index, word, deadline)

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

    def _copy_ipc(self, link: InstanceLink, routes: list[Route], sides: list[tuple[str, Side]], pull: bool,
                  dst_ids: list[int], src_ids: list[int], layers: range) -> int:
        """Copy the routes' head ranges of ``layers`` between this rank's memory and the mapped
        peer ranks' (``pull``: into ours), one kernel call per cache kind: the routes' layers are
        concatenated into one plan, so a rank reading from two peer ranks makes as many calls as
        one reading from one.  The block kernel checks both sides' ids against their capacities."""
        moved = 0
        for kind, local in sides:
            plans: dict[int, list[CopyPlan]] = {}  # head-range bytes -> one plan per route
            for route in routes:
                peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[kind])
                mine, theirs = _shift(local, local_off), _shift(route.peer.ipc.side(kind), peer_off)
                dst, src = (mine, theirs) if pull else (theirs, mine)
                plans.setdefault(nbytes, []).append(layer_range(CopyPlan(dst, src, nbytes, None), layers.start,
                                                                layers.stop))
            for nbytes, parts in plans.items():
                self._platform.run_plan(_concat(parts), dst_ids, src_ids, HOST_TO_DEVICE)
                moved += len(dst_ids) * nbytes * len(layers) * len(parts)
        return moved

    def _transfer_te(self, link: InstanceLink, routes: list[Route], write: bool, sides: list[tuple[str, Side]],
                     local_ids: list[int], remote_ids: list[int], layers: range,
                     deadline: float) -> tuple[int, Inflight | None]:
        """One Transfer Engine transfer with the routes' peer ranks, all at once, of each route's
        head range of every kind's ``layers``, adjacent ranges coalesced: ``write`` pushes this
        rank's blocks into the peers', else it pulls theirs into ours.  Returns the bytes and, if
        the deadline passed first, what is still in flight."""
        for _, local in sides:
            self._check_ids(local_ids, int(local.capacities.min()), "source" if write else "destination")
        jobs = []
        for route in routes:
            peer = route.peer
            self._check_ids(remote_ids, peer.te_capacity, "destination" if write else "source")
            local_addrs: list[int] = []
            remote_addrs: list[int] = []
            lengths: list[int] = []
            for kind, local in sides:
                peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[kind])
                runs = coalesce(block_addresses(local.bases + local_off, local.stride, local_ids, layers),
                                block_addresses(peer.te_bases[kind] + peer_off, peer.kind_bytes[kind], remote_ids,
                                                layers), nbytes)
                local_addrs += runs[0]
                remote_addrs += runs[1]
                lengths += runs[2]
            jobs.append((peer.name, peer.te_address, local_addrs, remote_addrs, lengths))
        self._links.te_memory_ready()
        inflight = self._links.te.transfer_many(jobs, write, deadline)
        return sum(sum(job[4]) for job in jobs), inflight

    def _wait_late(self, inflight: Inflight) -> None:
        while not self._stopping.is_set() and not inflight.wait(1.0):
            pass

    @staticmethod
    def _check_ids(ids: list[int], capacity: int, what: str) -> None:
        bad = [i for i in ids if not 0 <= i < capacity]
        if bad:
            raise ValueError(f"{what} block ids {bad[:8]} outside [0, {capacity})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what} block ids list a block twice")

    def _holds(self, link: PeerLink, handle: TransferHandle, deadline: float) -> bool:
        """Whether the handle's word (read after the bytes) still says LIVE, and, on one host, the
        peer's engine still runs."""
        alive = link.ipc is None or link.ipc.engine_alive()
        return holds(self._links.board_word(link, handle.slot, deadline), handle) and alive

    def _check_ticket(self, link: InstanceLink, task: PushTask, deadline: float) -> None:
        """The decode side still accepts this push into exactly these blocks: its ticket word equals
        the digest of the ticket's seq and blocks (``layer_progress.reservation_word``)."""
        word = self._links.layer_board_word(link.board, ticket_index(link.peer_tp, task.target.slot), deadline)
        if word is None:  # LLM-DataDist: the decode's layer board cannot be read (README, "Limits")
            return
        if word != reservation_word(task.target.seq, task.dst_block_ids):
            why = ("fenced (the decode side cancelled or closed it, or it was pushed already)" if word == FENCED
                   else "not the reservation the decode side made (other blocks, or another reservation's slot)")
            raise PeerError(f"{link.name}: push ticket of slot {task.target.slot} is {why}; nothing more is written")

    def _check_generation(self, link: InstanceLink, deadline: float, when: str) -> None:
        """The peer engine's caches are still those its descriptor named (its board's generation
        word, read after every byte moved so far); else nothing of this transfer counts."""
        board = link.board
        now = self._links.board_word(board, GENERATION_WORD, deadline)
        if now != board.descriptor.generation:
            state = "closed its prefill/decode side or is replacing its caches" if now == NO_GENERATION else \
                f"replaced its caches (generation {board.descriptor.generation} -> {now})"
            raise PeerError(f"{link.name}: its engine {state} {when}; no block counts: describe it and link "
                            "again")

    def close(self) -> None:
        """Stop waiting for late batches (the process is stopping: they end with it)."""
        self._stopping.set()
        self._late.shutdown(wait=True)


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
