"""Digests of a pull's blocks taken as the Transfer Engine lands them (P/D digests, DESIGN §3.11).

A Transfer Engine pull is many runs in flight at once; ``LandedDigests.landed`` hears which runs
ended (``TransferEngineEndpoint.transfer_many``'s ``on_landed``) and hashes their blocks (XXH3-64, one
C call per look, the GIL let go) while the other runs are still on the wire, so the hashing hides
behind the transfer instead of following it.  ``result()`` gives, per cache kind whose every block
was hashed, the digests (rows x blocks from the group's ``first``) that ``RankDigests.check``
compares; a kind left out (or every kind, after a failure here) is hashed there afterwards.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from transfer_factory.peer.digests import digests_at

from cache_manager.rank.peer.channel import InstanceLink, Route, Sides

BATCH_BYTES = 1 << 20  # landed bytes hashed together


def whole_blocks(link: InstanceLink, routes: list[Route], sides: Sides) -> bool:
    """Whether this rank reads whole blocks of every kind from one peer rank (one TP size, or a
    replicated latent): what a block's digest covers."""
    if len(routes) != 1:
        return False
    route = routes[0]
    for group in sides:
        peer_off, local_off, nbytes = route.span.offsets(link.head_bytes[group.kind])
        if peer_off or local_off or nbytes != route.peer.kind_bytes[group.kind]:
            return False
    return True


class LandedDigests:
    def __init__(self, sides: Sides, local_ids: list[int], runs: list[tuple[int, int, int]], block_bytes: list[int],
                 log: logging.Logger):
        """``runs``: per run of the transfer, (index into ``sides``, its first item, its items); item
        ``k`` of a group is its block ``k % blocks`` of row ``k // blocks``; ``block_bytes``: per
        group, the bytes of one of its blocks."""
        self._sides, self._runs, self._bytes, self._log = sides, runs, block_bytes, log
        self._ids = np.asarray(local_ids, dtype=np.int64)
        self._out = [np.zeros((len(g.rows), max(0, len(local_ids) - g.first)), dtype=np.int64) for g in sides]
        self._done = [0] * len(sides)
        self._failed = False
        self._waiting: list[tuple[int, int, int]] = []  # runs landed, not hashed yet
        self._waiting_bytes = 0

    def landed(self, runs: list[tuple[int, int]]) -> None:
        """The runs ``(job, run)`` of the transfer whose batches ended: their blocks are hashed
        once ``BATCH_BYTES`` of them waits (one C call per group; a call per small run cost more
        in Python than its hashing)."""
        for _, run in runs:
            group, _, count = entry = self._runs[run]
            self._waiting.append(entry)
            self._waiting_bytes += count * self._bytes[group]
        if self._waiting_bytes >= BATCH_BYTES:
            self._hash_waiting()

    def _hash_waiting(self) -> None:
        waiting, self._waiting, self._waiting_bytes = self._waiting, [], 0
        if self._failed or not waiting:
            return
        try:
            table = np.asarray(waiting, dtype=np.int64)  # (group, first item, items) per run
            for group in np.unique(table[:, 0]).tolist():
                side, out = self._sides[group], self._out[group]
                starts, counts = table[table[:, 0] == group, 1], table[table[:, 0] == group, 2]
                k = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
                rows, blocks = np.divmod(k, out.shape[1])
                ptrs = side.side.bases[side.rows.start + rows] + self._ids[side.first + blocks] * side.side.stride
                nbytes = self._bytes[group]
                out[rows, blocks] = digests_at(ptrs, np.ones(len(ptrs), dtype=np.int64), nbytes, [0], 0, nbytes)[:, 0]
                self._done[group] += len(k)
        except Exception:  # digested after the transfer instead
            self._log.exception("digesting landed runs failed; the pull's blocks are digested after it")
            self._failed = True

    def result(self) -> dict[str, Any]:
        """Per kind whose every block was hashed, its digests (what is still waiting is hashed first)."""
        self._hash_waiting()
        if self._failed:
            return {}
        return {g.kind: out for g, out, done in zip(self._sides, self._out, self._done) if done and done == out.size}
