"""The engine's side of prefill/decode disaggregation (DESIGN §3.11), in LLM-DataDist's terms.

``PrefillDecode(service)`` gives a running ``CacheTransferService`` what a P/D router drives:

- ``descriptor(offer)``: this instance's descriptor, one ``PeerDescriptor`` per rank (the ranks
  build them: only a rank knows where its memory is mapped).  ``offer`` names the transports to
  offer: ``ipc`` (same host, no port) and ``datadist`` (LLM-DataDist: only ranks on the NPU
  platform with CANN's SDK offer it) by default; ``mooncake`` opens the ranks' Transfer Engines.
- ``link(peer)`` / ``unlink(peer_id)`` (``link_clusters``): every rank checks the peer ranks'
  layouts against its own, refusing with the first field that differs, and opens the transport
  both offer (or ``transport=`` if forced) to each peer rank it exchanges heads with: the rank of
  the same index when both run one TP size, otherwise those holding its kv heads
  (``transfer_factory.peer.heads``; MLA: one rank, the latent is replicated).  A rank whose process
  is replaced (a crash and restart) starts with no links: every peer is linked again; one that
  cannot be is unlinked and reported to ``on_link_lost(peer_id, reason)``, so ``linked()`` is true.
- prefill side: ``expose(req_id)`` → a ``TransferHandle`` (``CacheKey(cluster, req_id)``): the
  engine keeps the request's blocks until ``retract(handle)`` (``remove_cache_key``), which it
  calls once the puller confirmed or it gave up, or its lease ends (``ttl``, 30 s by default, unless
  ``renew``ed: a lost decode instance never pins prefill blocks).  Retracting is always safe: a pull that read a
  block after the retraction does not count it (``transfer_factory.peer.handles``).
- decode side: ``pull_blocks(peer_id, handle, src_blocks, dst_blocks, placement, layers)`` →
  a ``TaskFuture`` like every task: its result is the destination blocks loaded on every rank,
  ``released`` once no byte may still land in them.

Descriptors travel out of band (a router's own channel; the replay hands them over directly):
they are plain data (``to_wire``), checked field by field when they come in.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from cache_manager.cache_data import CacheStatus
from cache_manager.layer_progress import LayerwiseRef
from cache_manager.rank.peer.tp_rules import tp_heads
from ops.procs import ProcessWatch, process_argv
from ops.shm import SharedMemorySegment
from transfer_factory.peer.handles import (BOARD_BYTES, BOARD_WORDS, DEFAULT_TTL_S, NO_GENERATION, ExposureBoard,
                                           TransferHandle)
from transfer_factory.keys import salt_tag
from transfer_factory.peer.heads import writers

from ..core.wire_tasks import block_ids
from ..core.wire_tasks import state_slot as wire_state_slot
from .digests import DigestTables, check_peer_publishes
from .leases import LeaseReaper
from .push import PushTarget, check_writers

logger = logging.getLogger(__name__)

TRANSPORT_CHOICES = ("auto", "ipc", "datadist", "mooncake")
DEFAULT_OFFER = ("ipc", "datadist")  # each rank offers what its platform can: ipc on CPU, datadist on NPU


def offer_for(transport: str) -> list[str]:
    """What a descriptor offers for a link over ``transport`` (one of ``TRANSPORT_CHOICES``): what
    each platform can by default, and the Transfer Engine, which opens only when asked for."""
    return ["ipc", "mooncake"] if transport == "mooncake" else list(DEFAULT_OFFER)


class PrefillDecode:
    def __init__(self, service: Any, instance_id: str | None = None, control_timeout: float = 30.0,
                 on_expire: Callable[[TransferHandle], None] | None = None,
                 on_link_lost: Callable[[str, str], None] | None = None, digests: bool = False,
                 digest_table_bytes: int | None = None):
        if service.server is None:
            raise RuntimeError("start the service before its prefill/decode side")
        self._svc = service
        self.instance_id = instance_id or f"{os.uname().nodename}-{service.instance}"
        self._timeout = control_timeout
        self._segment = SharedMemorySegment(f"ctm.{service.instance}.pd_handles", BOARD_BYTES, create=True)
        self._words = np.frombuffer(self._segment.buf, dtype=np.int64, count=BOARD_WORDS)
        self.board = ExposureBoard(self._words, self.instance_id)
        # digests on: exposed blocks get digests on every rank, pulled blocks are checked against them
        try:
            self.digests = DigestTables(service, self.board, self._control, digest_table_bytes) if digests else None
        except BaseException:
            self._segment.close()
            self._segment.unlink()
            raise
        self._peer_digests: dict[str, str | None] = {}  # peer instance id -> why it cannot be checked, or None
        # The board's generation word follows the caches' (DESIGN §3.8): an RL clear or a sleep
        # retracts every handle and stops peers' transfers from counting before the memory goes.
        self._unwatch = service.resources.watch_generation(self.board.publish_generation)
        self._leases = LeaseReaper(self.board, on_expire, self.instance_id)  # handles expire unless renewed
        self._links: dict[str, str] = {}  # peer instance id -> transport
        self._link_args: dict[str, tuple] = {}  # peer instance id -> (its descriptor, transport asked, offer)
        self._relinks: list[threading.Thread] = []  # re-links after a rank restart (joined at close)
        self._unwatch_up = service.core.watch_rank_up(self._rank_up)
        self.on_link_lost = on_link_lost
        self._peer_writers: dict[str, list[int]] = {}  # peer instance id -> its ranks that push into us
        # peer instance id -> its writer ranks' processes, where linked on this host (a dead one writes no more)
        self._writer_procs: dict[str, dict[int, ProcessWatch]] = {}
        self._closed = False

    # ------------------------------------------------------------------ descriptors and links
    def descriptor(self, offer: Sequence[str] = DEFAULT_OFFER) -> dict:
        """This instance's descriptor: ``{"instance_id", "tp", "ranks": [one per rank]}``."""
        bad = [t for t in offer if t not in TRANSPORT_CHOICES[1:]]
        if bad:
            raise ValueError(f"cannot offer transports {bad}; known: {TRANSPORT_CHOICES[1:]}")
        layer_board = self._svc.layerwise.board.signal
        generation = self.board.generation
        if generation == NO_GENERATION:
            raise RuntimeError(f"instance {self.instance_id}: its caches are being replaced (or its prefill/decode "
                               "side is closed): describe it once they are attached")
        ranks = self._control("pd_describe", instance_id=self.instance_id, offer=list(offer), generation=generation,
                              board=[self._segment.name, 0, BOARD_BYTES], engine_pid=os.getpid(),
                              layer_board=[layer_board.segment_name, 0, int(layer_board.value.nbytes)],
                              **({"digests": self.digests.regions()} if self.digests else {}))
        return {"instance_id": self.instance_id, "tp": self._svc.tp, "ranks": ranks}

    def link(self, peer: dict, transport: str = "auto", offer: Sequence[str] | None = None) -> str:
        """Link every rank to the peer ranks it exchanges kv heads with; returns the transport
        chosen.  Refused (``ValueError`` naming the field) when the layouts cannot exchange blocks."""
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport {transport!r} must be one of {TRANSPORT_CHOICES}")
        if not isinstance(peer, dict) or not isinstance(peer.get("ranks"), list) or not peer["ranks"]:
            raise ValueError("a peer descriptor is a map with a non-empty list of 'ranks'")
        if peer.get("tp") != len(peer["ranks"]):
            raise ValueError(f"peer descriptor tp {peer.get('tp')!r} but {len(peer['ranks'])} ranks")
        local = self.descriptor(offer or offer_for(transport))
        answers = self._control("pd_link", local=local["ranks"], peer=peer["ranks"],
                                transport=None if transport == "auto" else transport)
        chosen = set(answers)
        if len(chosen) != 1:
            self._control("pd_unlink", peer=str(peer.get("instance_id")))
            raise RuntimeError(f"ranks chose different transports {answers}: unlinked")
        layout = peer["ranks"][0]["layout"]  # checked field by field by every rank
        heads, replicated, _, total = tp_heads(self._svc.layout)
        total = total if total == layout.get("total_kv_heads", 0) else 0
        peer_id = str(peer["instance_id"])
        self._peer_writers[peer_id] = writers(self._svc.tp, heads, peer["tp"], layout["kv_heads"], replicated, total)
        self._watch_writers(peer_id, peer["ranks"] if answers[0] == "ipc" else [])
        self._links[peer_id] = answers[0]
        self._link_args[peer_id] = (peer, transport, offer)
        self._peer_digests[peer_id] = check_peer_publishes(peer, answers[0]) or (
            None if peer["tp"] == self._svc.tp or replicated else
            f"instance {peer_id!r} runs TP {peer['tp']}, this one TP {self._svc.tp}: digests are checked only "
            "between instances of one TP size (a head range of a block has no digest of its own)")
        return answers[0]

    def _rank_up(self, rank: int) -> None:
        """A rank's new process serves, with none of the links its predecessor had: link every peer
        again (off the thread that brought it up).  A peer that cannot be linked again is unlinked,
        logged, and reported to ``on_link_lost(peer_id, reason)``, so ``linked()`` stays true."""
        if self._closed or not self._links:
            return
        thread = threading.Thread(target=self._relink_all, args=(rank,), name=f"pd-relink-{rank}", daemon=True)
        self._relinks = [t for t in self._relinks if t.is_alive()] + [thread]
        thread.start()

    def _relink_all(self, rank: int) -> None:
        for peer_id, (peer, transport, offer) in list(self._link_args.items()):
            if self._closed or peer_id not in self._links:
                continue
            try:
                chosen = self.link(peer, transport, offer)
                logger.warning("rank %d restarted: linked %s again over %s", rank, peer_id, chosen)
            except Exception as exc:
                reason = f"rank {rank} restarted and the link could not be made again: {exc}"
                logger.error("%s: %s; unlinked", peer_id, reason)
                try:
                    self.unlink(peer_id)
                except Exception as unlink_exc:  # linked() is already false for it
                    logger.warning("unlinking %s after a failed re-link: %s", peer_id, unlink_exc)
                if self.on_link_lost is not None:
                    self.on_link_lost(peer_id, reason)

    def _watch_writers(self, peer_id: str, ranks: list) -> None:
        """Watch the peer's rank processes (same host only: a pid means nothing on another host).
        A pid is watched only if it is that rank's CTM of that engine (its command line says so):
        a descriptor naming another process must not release a target while its writer still runs."""
        for watch in self._writer_procs.pop(peer_id, {}).values():
            watch.close()
        procs = {}
        for rank, wire in enumerate(ranks):
            pid = wire.get("pid") if isinstance(wire, dict) else None
            engine = wire.get("transports", {}).get("ipc", {}).get("engine_pid") if isinstance(wire, dict) else None
            if type(pid) is int and pid > 0 and _is_rank_ctm(pid, rank, engine):
                watch = ProcessWatch(pid)
                if _is_rank_ctm(pid, rank, engine):  # still that process once its pidfd is open
                    procs[rank] = watch
                else:
                    watch.close()
        self._writer_procs[peer_id] = procs

    def unlink(self, peer_id: str) -> bool:
        """Close every rank's link to ``peer_id``; pulls from it are refused from then on."""
        self._links.pop(peer_id, None)
        self._link_args.pop(peer_id, None)
        self._peer_writers.pop(peer_id, None)
        self._peer_digests.pop(peer_id, None)
        self._watch_writers(peer_id, [])
        return any(self._control("pd_unlink", peer=peer_id))

    def linked(self) -> dict[str, str]:
        return dict(self._links)

    # ------------------------------------------------------------------ prefill side
    def expose(self, req_id: str, ttl: float | None = DEFAULT_TTL_S, cache_salt: str | None = None,
               blocks: Any = None) -> TransferHandle:
        """Expose the request's blocks under a handle whose lease ends ``ttl`` seconds from now
        unless renewed (None: only ``retract`` ends it); at expiry the handle is retracted and
        ``on_expire(handle)`` tells the engine to free the blocks.  ``cache_salt``: the request's
        tenant salt; a pull naming another salt counts no block (``ExposureBoard``).  ``blocks``: the
        request's blocks, which every rank digests when digests are on (``engine_hooks.pd.digests``)."""
        if self.digests is not None and blocks is None:
            raise ValueError(f"instance {self.instance_id} publishes digests: expose(req_id, ..., blocks=[...]) must "
                             "name the request's blocks")
        ids = block_ids(blocks, "blocks") if self.digests is not None else None
        handle = self.board.expose(req_id, ttl, cache_salt)
        if ids is not None:
            try:
                handle = self.digests.publish(handle, ids)
            except BaseException:
                self.board.retract(handle)
                raise
        self._leases.wake()
        return handle

    def renew(self, handle: TransferHandle | dict, ttl: float | None = None) -> bool:
        """The decode side still needs ``handle`` (it says so through the router): its lease runs
        ``ttl`` (default: the exposed ttl) from now.  False once it was retracted or expired."""
        if isinstance(handle, dict):
            handle = TransferHandle.from_wire(handle)
        return self.board.renew(handle, ttl)

    def retract(self, handle: TransferHandle) -> bool:
        return self.board.retract(handle)

    # ------------------------------------------------------------------ decode side
    def pull_blocks(self, peer_id: str, handle: TransferHandle | dict, src_blocks: Any, dst_blocks: Any,
                    placement: str = "device", layers: tuple[int, int] | None = None,
                    timeout: float | None = None, state_slots: tuple[int, int] | None = None,
                    cache_salt: str | None = None, request_id: str | None = None, digests: bool | None = None):
        """Read the peer's ``src_blocks`` exposed under ``handle`` into this instance's
        ``dst_blocks`` (device blocks, or swap slots with ``placement="host"``), and with
        ``state_slots`` (the peer's slot, this instance's) the request's state groups once.
        ``cache_salt``: this request's tenant salt; blocks exposed under another salt never count.
        ``request_id``: the task is recorded for that request (``svc.transfers``).  ``digests``: check
        every pulled block against the digests the peer published (default: on where this instance
        was made with ``digests=True``); a block that differs fails and is never counted."""
        if peer_id not in self._links:
            raise ValueError(f"instance {peer_id!r} is not linked (linked: {sorted(self._links) or 'none'})")
        if isinstance(handle, dict):
            handle = TransferHandle.from_wire(handle)
        check = self.digests is not None if digests is None else bool(digests)  # default: this instance's
        if check:  # every block is checked against the peer's digests: the peer must publish them
            why = self._peer_digests.get(peer_id) or (None if handle.digests else (
                f"instance {peer_id!r} published no digests for request {handle.req_id!r} (expose it with blocks= "
                "on a PrefillDecode with digests=True), and this instance checks them"))
            if why:
                raise ValueError(why)
        handle = handle.for_salt(cache_salt).to_wire()  # the word the board holds for this tenant only
        src, dst = block_ids(src_blocks, "src_blocks"), block_ids(dst_blocks, "dst_blocks")
        if len(src) != len(dst):
            raise ValueError(f"src_blocks has {len(src)} ids but dst_blocks has {len(dst)}")
        task = {"event_type": int(CacheStatus.PEER_PULL), "peer": peer_id, "handle": handle,
                "src_block_ids": src, "dst_block_ids": dst, "placement": placement}
        if layers is not None:
            task["layers"] = [int(layers[0]), int(layers[1])]
        if state_slots is not None:
            task["state_slots"] = self._state_slots(state_slots, mine=1)
        if check:
            task["digests"] = True
        return self._svc.submit(task, timeout, request_id=request_id)

    def _state_slots(self, slots: Any, mine: int) -> list[int]:
        """(source, destination) state slots; ``slots[mine]`` is this instance's."""
        if not isinstance(slots, (list, tuple)) or len(slots) != 2:
            raise ValueError(f"state_slots {slots!r:.60} must be (source slot, destination slot)")
        out = [wire_state_slot(slots[0], 1 << 40, "state_slots[0]"), wire_state_slot(slots[1], 1 << 40, "state_slots[1]")]
        wire_state_slot(out[mine], self._svc.layout.request_slots, f"state_slots[{mine}]")
        return out

    # ------------------------------------------------------------------ push
    def receive_push(self, peer_id: str, dst_blocks: Any, timeout: float | None = None,
                     cache_salt: str | None = None) -> PushTarget:
        """Decode side: reserve ``dst_blocks`` for ``peer_id`` to push into; hand ``target.ticket``
        to the prefill instance, then ``target.wait_for_layer(i)`` / ``target.result()``.  The
        blocks may be reused only once ``target.released``.  ``cache_salt``: the request's tenant
        salt; a push of a request with another salt matches no reservation and writes nothing."""
        if peer_id not in self._links:
            raise ValueError(f"instance {peer_id!r} is not linked (linked: {sorted(self._links) or 'none'})")
        dst = block_ids(dst_blocks, "dst_blocks")
        check_writers(peer_id, self._peer_writers[peer_id])
        ref = self._svc.layerwise.acquire(await_compute=False)
        if ref is None:
            raise RuntimeError("every layer-board slot is held by unreleased tasks: no push can be received now")
        timeout = self._svc.task_timeout if timeout is None else float(timeout)
        procs = self._writer_procs.get(peer_id, {})
        return PushTarget(self._svc.layerwise, ref, self.instance_id, peer_id, dst, len(self._svc.spec.layer_blocks()),
                          time.monotonic() + timeout, self._peer_writers[peer_id],
                          writer_gone=lambda writer: writer in procs and procs[writer].gone(),
                          salt_tag=salt_tag(cache_salt))

    def push_blocks(self, peer_id: str, ticket: dict, src_blocks: Any, layerwise: bool = True,
                    timeout: float | None = None, state_slots: tuple[int, int] | None = None,
                    cache_salt: str | None = None, request_id: str | None = None):
        """Prefill side: write ``src_blocks`` into the blocks the decode instance reserved
        (``ticket``), each layer as soon as ``future.layer_computed(n)`` says it is computed
        (``layerwise=True``), or all at once.  ``cache_salt``: this request's tenant salt, which the
        reservation must have been made with (every rank checks it before its first byte).
        ``request_id``: the task is recorded for that request (``svc.transfers``)."""
        if peer_id not in self._links:
            raise ValueError(f"instance {peer_id!r} is not linked (linked: {sorted(self._links) or 'none'})")
        if not isinstance(ticket, dict) or ticket.get("instance_id") != peer_id:
            raise ValueError(f"the push ticket is not from instance {peer_id!r}")
        target = LayerwiseRef.from_wire({"slot": ticket.get("slot"), "seq": ticket.get("seq")})
        src, dst = block_ids(src_blocks, "src_blocks"), block_ids(ticket.get("dst_block_ids", []), "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"src_blocks has {len(src)} ids but the ticket reserved {len(dst)}")
        task = {"event_type": int(CacheStatus.PEER_PUSH), "peer": peer_id, "target": target.to_wire(),
                "src_block_ids": src, "dst_block_ids": dst}
        tag = salt_tag(cache_salt)
        if tag:
            task["salt_tag"] = tag
        if state_slots is not None:
            task["state_slots"] = self._state_slots(state_slots, mine=0)
        return self._svc._submit_maybe_layerwise(task, timeout, 0.0, layerwise, is_store=True,
                                                 request_id=request_id)

    # ------------------------------------------------------------------ lifetime
    def _control(self, command: str, **args: Any) -> list:
        return self._svc.control(command, timeout=self._timeout, **args).result(timeout=self._timeout + 5)

    def close(self) -> None:
        """Retract every handle and unlink every peer, then remove the board."""
        if self._closed:
            return
        self._closed = True
        self._leases.stop()
        self._unwatch()
        self._unwatch_up()
        for thread in self._relinks:
            thread.join(self._timeout)
        self.board.publish_generation(NO_GENERATION)  # retracts every handle; peers' links count nothing more
        for peer_id in list(self._links):
            try:
                self.unlink(peer_id)
            except Exception as exc:  # the service may be stopping: its ranks drop their links anyway
                logger.warning("unlinking %s at close failed: %s", peer_id, exc)
        self._words = None
        self.board.words = np.zeros(BOARD_WORDS, dtype=np.int64)
        self._segment.close()
        self._segment.unlink()
        if self.digests is not None:
            self.digests.close()


def _is_rank_ctm(pid: int, rank: int, engine_pid: object) -> bool:
    """Whether process ``pid`` is the CTM of rank ``rank`` launched by engine ``engine_pid``."""
    argv = process_argv(pid)
    if argv is None:
        return False

    def flag(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv[:-1] else None

    return ("cache_manager.cache_transfer_manager" in argv and flag("--rank") == str(rank)
            and flag("--engine_pid") == str(engine_pid))
