"""Which kv heads of which peer rank a rank exchanges, when prefill and decode run different TP
sizes (DESIGN §3.11, "Heterogeneous TP").

An instance of TP size ``tp`` splits the model's kv heads evenly: rank ``r`` holds global heads
``[r * heads, (r + 1) * heads)``.  In the ``[num_blocks, kv_heads, block_size, head_dim]`` layout
(and ``[num_blocks, kv_heads, block_size]`` for fp8 scales) a run of heads of one block is one
contiguous byte range, so a rank reads or writes a peer's heads as a sub-block: ``heads *
head_bytes`` bytes at ``head * head_bytes`` into the block, for every cache kind.

``reader_spans(reader, ...)`` is the one definition: the heads reader rank ``r`` needs, by source
rank.  A push is the same relation seen from the writer: prefill rank ``p`` writes to decode rank
``d`` exactly what ``d`` would have read from ``p`` (``writer_spans``).  With MLA the latent is
replicated on every rank: reader ``r`` takes it whole from rank ``r % peer_tp``.

With more ranks than the model has kv heads (``total``, e.g. Qwen3-235B's 4 heads at TP 8), ranks
replicate heads: rank ``r`` holds head ``r * total // tp``.  A reader takes each of its heads from
one rank that holds it, never a split of replicas; readers spread over the replicas.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSpan:
    """``heads`` heads starting at ``peer_head`` of peer rank ``peer_rank``'s blocks, which are
    heads ``local_head ...`` of this rank's blocks."""

    peer_rank: int
    peer_head: int
    local_head: int
    heads: int

    def offsets(self, head_bytes: int) -> tuple[int, int, int]:
        """(byte offset into the peer's block, into ours, bytes) for one cache kind."""
        return self.peer_head * head_bytes, self.local_head * head_bytes, self.heads * head_bytes


def first_head(rank: int, tp: int, heads: int, total: int = 0) -> int:
    """The first of the model's kv heads rank ``rank`` holds (``total``: the model's, 0 when the
    ranks split them without replicas)."""
    if not total or heads * tp == total:
        return rank * heads
    return rank * total // tp  # more ranks than heads: tp // total ranks hold each head


def reader_spans(rank: int, tp: int, heads: int, peer_tp: int, peer_heads: int, mla: bool,
                 total: int = 0) -> list[HeadSpan]:
    """What reader ``rank`` (of ``tp`` ranks holding ``heads`` heads each) reads from an instance of
    ``peer_tp`` ranks holding ``peer_heads`` each; every head of the reader is covered once, from
    one rank (``total``: the model's kv heads, when ranks may replicate them)."""
    _check(rank, tp, heads, peer_tp, peer_heads, mla, total)
    if mla:
        return [HeadSpan(rank % peer_tp, 0, 0, heads)]
    first = first_head(rank, tp, heads, total)
    covered: set[int] = set()
    spans = []
    for step in range(peer_tp):  # from rank ``rank`` on: readers spread over a head's replicas
        peer = (rank + step) % peer_tp
        start = first_head(peer, peer_tp, peer_heads, total)
        lo, hi = max(first, start), min(first + heads, start + peer_heads)
        if lo < hi and lo not in covered:  # a peer's heads are another's wholly or not at all
            covered.update(range(lo, hi))
            spans.append(HeadSpan(peer, lo - start, lo - first, hi - lo))
    return sorted(spans, key=lambda s: s.local_head)


def writer_spans(rank: int, tp: int, heads: int, peer_tp: int, peer_heads: int, mla: bool,
                 total: int = 0) -> list[HeadSpan]:
    """What writer ``rank`` writes into the ranks of an instance of ``peer_tp`` ranks: for each
    peer rank that reads from this one, the same span seen from here."""
    out = []
    for peer in range(peer_tp):
        for span in reader_spans(peer, peer_tp, peer_heads, tp, heads, mla, total):
            if span.peer_rank == rank:
                out.append(HeadSpan(peer, span.local_head, span.peer_head, span.heads))
    return out


def writers(reader_tp: int, reader_heads: int, writer_tp: int, writer_heads: int, mla: bool,
            total: int = 0) -> list[int]:
    """The writer ranks that write into at least one reader rank (the words a push waits for)."""
    return sorted({s.peer_rank for r in range(reader_tp)
                   for s in reader_spans(r, reader_tp, reader_heads, writer_tp, writer_heads, mla, total)})


def _check(rank: int, tp: int, heads: int, peer_tp: int, peer_heads: int, mla: bool, total: int = 0) -> None:
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, tp={tp})")
    if mla:
        if heads != peer_heads:
            raise ValueError(f"MLA latent heads differ: {heads} here, {peer_heads} on the peer")
    elif total:
        for n, h in ((tp, heads), (peer_tp, peer_heads)):
            if h != max(1, total // n) or (total % n and n % total):
                raise ValueError(f"{h} kv heads per rank at TP {n} do not split the model's {total} kv heads")
    elif heads * tp != peer_heads * peer_tp:
        raise ValueError(f"kv heads x tp differ: {heads} x {tp} here, {peer_heads} x {peer_tp} on the peer")
