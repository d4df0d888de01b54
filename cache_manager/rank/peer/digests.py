"""A CTM rank's part of the P/D digests (``transfer_factory.peer.digests``; DESIGN §3.11).

Prefill side: the engine created this rank's *digest table* (a shared-memory segment named in
``pd_describe``) and, when it exposes a request's blocks with digests on, asks every rank
(``pd_digest``) to write the blocks' digests, one per block and cache tensor of every block group,
into the region it allotted to the handle.  The digests are computed here, from the rank's own
device caches, where the bytes are.

Decode side: after a pull's bytes landed (``check``), read the source rank's region over the
link's transport, digest the bytes received (the destination blocks, the rows and blocks the pull
moved) and compare.  A block whose bytes differ is a failed block: the caller never counts it.
Digests are checked only where a decode rank reads whole blocks from one prefill rank (one TP size,
or a replicated latent): a head range of a block has no digest of its own.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from ops.cpu import default_copy_threads
from ops.layout import Side, describe_caches, device_side
from ops.shm import SharedMemorySegment, segment_identity
from transfer_factory.peer.digests import DigestMismatch, digests_split, read_region, region_words, write_region
from transfer_factory.peer.handles import TransferHandle
from transfer_factory.peer.ipc import Region

from cache_manager.rank.peer.channel import GroupSide, InstanceLink, PeerError
from cache_manager.rank.resources import RankResources

MAX_NAMED = 8  # failed blocks a message names
MAX_THREADS = 8  # digest threads per rank (as many as the copy's, at most this)
READERS = 4  # source regions read at once per rank (as many as its pulls)


class RankDigests:
    def __init__(self, resources: RankResources, log: logging.Logger):
        self._resources = resources
        self._log = log
        self._table: SharedMemorySegment | None = None
        self._key: tuple | None = None  # (segment name, its file identity)
        self._words: np.ndarray | None = None
        self._threads = max(1, min(MAX_THREADS, default_copy_threads()))
        self._pool: ThreadPoolExecutor | None = None  # started at the first digest, stopped at close
        self._reader: ThreadPoolExecutor | None = None  # reads sources' regions while the bytes move
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ prefill side
    def attach(self, region: Region | None) -> None:
        """Map the digest table the engine named in its latest descriptor (None: it publishes none)."""
        if region is None:
            return
        key = (region.segment, segment_identity(region.segment))
        if key == self._key:
            return
        segment = SharedMemorySegment(region.segment)
        if segment.size < region.nbytes or region.nbytes % 8:
            segment.close()
            raise ValueError(f"digest table {region.segment} holds {segment.size} bytes, not {region.nbytes}")
        self._close_table()
        self._table, self._key = segment, key
        self._words = np.frombuffer(segment.buf, dtype=np.int64, count=region.nbytes // 8)

    def tensor_count(self) -> int:
        """Digests per block: one per layer tensor of every block group."""
        return sum(len(g.tensors) for g in self._resources.block_groups())

    def publish(self, args: dict) -> int:
        """``pd_digest``: write the digests of ``args["blocks"]`` into the region at ``args["offset"]``,
        tagged with ``handle_id`` and ``generation``; returns the blocks written."""
        if self._words is None:
            raise RuntimeError("this rank has no digest table: describe the instance with digests on first")
        blocks, tensors = args.get("blocks"), args.get("tensors")
        offset, handle_id, generation = args.get("offset"), args.get("handle_id"), args.get("generation")
        if not isinstance(blocks, list) or not all(type(b) is int for b in blocks):
            raise ValueError("pd_digest blocks must be a list of block ids")
        for name, value in (("offset", offset), ("handle_id", handle_id), ("generation", generation)):
            if type(value) is not int or value < 0:
                raise ValueError(f"pd_digest {name} {value!r:.40} must be a non-negative integer")
        if tensors != self.tensor_count():
            raise ValueError(f"pd_digest for {tensors!r} tensors per block; this rank has {self.tensor_count()}")
        if offset + region_words(len(blocks), tensors) > len(self._words):
            raise ValueError(f"pd_digest region at {offset} of {len(blocks)} blocks outside the table")
        parts = [np.empty((0, len(blocks)), dtype=np.int64)]
        for group in self._resources.block_groups():
            side = _device_side(group)
            parts.append(self._digests(side.bases, side.capacities, side.stride, blocks, side.stride))
        write_region(self._words, offset, handle_id, generation, blocks, np.concatenate(parts))
        return len(blocks)

    # ------------------------------------------------------------------ decode side
    def start(self, link: InstanceLink, handle: TransferHandle, deadline: float) -> Future:
        """Before a pull's bytes move: check that its blocks can be checked (raises ``PeerError``
        naming why) and start reading the source's region, so its round trip overlaps the bytes.
        Reading it while the bytes move is safe: it counts only if the handle's word, read after
        both, still says LIVE (a region goes to another handle only once this one is not live)."""
        if handle.digests is None:
            raise PeerError(f"{link.name}: the handle of request {handle.req_id!r} carries no digests (expose it "
                            "with digests on and its blocks)")
        routes = link.pull_routes
        if len(routes) != 1:
            raise PeerError(f"{link.name}: digests are checked only where a rank reads whole blocks from one "
                            f"prefill rank (one TP size); this rank reads from {len(routes)}")
        peer = routes[0].peer
        offset, count, _ = handle.digests
        with self._pool_lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(READERS, thread_name_prefix="pd_digest_read")
            return self._reader.submit(link.channel.digest_words, peer, offset,
                                       region_words(count, self.tensor_count()), deadline)

    def check(self, link: InstanceLink, handle: TransferHandle, sides: list[GroupSide], local_ids: list[int],
              remote_ids: list[int], region: Future, received: dict[str, np.ndarray], deadline: float
              ) -> tuple[list[int], str]:
        """After a pull's bytes landed: the destination blocks whose bytes differ from the source's
        digests (``region``: what ``start`` read; ``received``: per kind, the digests the transport
        took of the bytes as it wrote them, the others are hashed here), and a message naming the
        peer and the first of them ('' when none)."""
        route = link.pull_routes[0]
        peer = route.peer
        tensors = self.tensor_count()
        _, _, exposed_id = handle.digests
        try:
            words = region.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        except FutureTimeout:
            raise PeerError(f"{peer.name} at {peer.where}: its digests did not arrive in time") from None
        positions, expected = read_region(words, exposed_id, peer.descriptor.generation, tensors, peer.name)
        bad: dict[int, str] = {}
        first_tensor = 0
        for group in self._resources.block_groups():
            part = next((s for s in sides if s.kind == group.kind), None)
            if part is not None and len(part.rows) and part.first < len(local_ids):
                self._check_group(link, route, part, first_tensor, local_ids, remote_ids, positions, expected,
                                  received.get(part.kind), bad)
            first_tensor += len(group.tensors)
        if not bad:
            return [], ""
        named = "; ".join(list(bad.values())[:MAX_NAMED]) + (f"; and {len(bad) - MAX_NAMED} more" if len(bad) >
                                                                 MAX_NAMED else "")
        return sorted(bad), (f"DigestMismatch: {peer.name}: {len(bad)} of {len(local_ids)} blocks arrived with bytes "
                             f"that differ from the prefill's digests, not counted: {named}")

    def _check_group(self, link: InstanceLink, route: Any, part: GroupSide, first_tensor: int, local_ids: list[int],
                     remote_ids: list[int], positions: dict[int, int], expected: np.ndarray,
                     got: np.ndarray | None, bad: dict[int, str]) -> None:
        peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[part.kind])
        if peer_off or local_off or nbytes != route.peer.kind_bytes[part.kind]:
            raise PeerError(f"{link.name}: digests are checked only where a rank reads whole blocks (one TP size); "
                            f"this rank reads a head range of {part.kind}")
        dst, src = local_ids[part.first:], remote_ids[part.first:]
        missing = [s for s in src if s not in positions]
        if missing:
            raise DigestMismatch(f"{route.peer.name}: blocks {missing[:MAX_NAMED]} were not exposed with digests "
                                 "under this handle")
        rows = part.rows
        if got is None:
            got = self._digests(part.side.bases[rows.start:rows.stop], part.side.capacities[rows.start:rows.stop],
                                part.side.stride, dst, nbytes)
        want = expected[first_tensor + rows.start:first_tensor + rows.stop][:, [positions[s] for s in src]]
        for row, col in zip(*np.nonzero(got != want)):
            if dst[col] not in bad:
                bad[dst[col]] = (f"block {src[col]} -> {dst[col]} ({part.kind} tensor {rows.start + row}: "
                                 f"{int(got[row, col]) & (2**64 - 1):016x}, want {int(want[row, col]) & (2**64 - 1):016x})")

    def _digests(self, bases: np.ndarray, capacities: np.ndarray, stride: int, ids: list[int],
                 nbytes: int) -> np.ndarray:
        with self._pool_lock:
            if self._pool is None and self._threads > 1:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="pd_digest")
            pool = self._pool
        return digests_split(pool, self._threads, bases, capacities, stride, ids, 0, nbytes)

    def close(self) -> None:
        with self._pool_lock:
            pools, self._pool, self._reader = (self._pool, self._reader), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        self._close_table()

    def _close_table(self) -> None:
        self._words = None
        if self._table is not None:
            self._table.close()
        self._table, self._key = None, None


def _device_side(group: Any) -> Side:
    infos, block_bytes = describe_caches(group.tensors)
    return device_side(infos, block_bytes)
