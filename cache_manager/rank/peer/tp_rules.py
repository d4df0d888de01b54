"""How a cache layout's groups spread over TP ranks, and which P/D links between TP sizes they allow.

A group's TP rule (``cache_manager.cache_layout.TensorGroup.tp``) decides:

- ``split``: dimension 0 of its block is kv heads, each rank holds its share; ranks of different
  TP sizes exchange head ranges (``transfer_factory.peer.heads``);
- ``replicated``: every rank holds all of it (MLA's latent and rope, a DSA indexer); a reader of
  another TP size reads one rank's copy;
- ``unsplittable``: only ranks of the same TP size exchange it.

One link moves every block group over the same head spans, so a layout's block groups must agree:
all split with one head count, or all replicated.  A state group (one slot per request, not per
block) moves whole slots between ranks of the same index, so only between instances of one TP size;
ranks of other TP sizes would have to re-slice its heads, which is refused naming the group.
"""
from __future__ import annotations

from typing import NamedTuple

from cache_manager.cache_layout import CacheLayout


class TpHeads(NamedTuple):
    heads: int  # kv heads per rank
    replicated: bool  # every rank holds the whole group (MLA)
    breaker: str | None  # the first group that keeps ranks of different TP sizes apart, or None
    total: int = 0  # the model's kv heads, where the layout says (ranks may replicate them)


def tp_heads(layout: CacheLayout) -> TpHeads:
    """How the layout's block groups spread over TP ranks, as one link moves them."""
    groups = layout.block_groups()
    if not groups:
        return TpHeads(1, True, None)
    rules = {g.tp for g in groups}
    if rules == {"replicated"}:
        return TpHeads(groups[0].block_shape[0], True, None)
    if rules == {"split"}:
        heads, totals = {g.block_shape[0] for g in groups}, {g.heads for g in groups}
        if len(heads) == 1 and len(totals) == 1:
            return TpHeads(groups[0].block_shape[0], False, None, totals.pop())
        odd = next(g for g in groups if (g.block_shape[0], g.heads) != (groups[0].block_shape[0], groups[0].heads))
        return TpHeads(1, False, f"{odd.name!r} ({odd.block_shape[0]} kv heads per rank of {odd.heads or '?'}, "
                                 f"{groups[0].name!r} has {groups[0].block_shape[0]} of {groups[0].heads or '?'}): "
                                 "its heads split differently")
    odd = next((g for g in groups if g.tp == "unsplittable"), None) or \
        next(g for g in groups if g.tp != groups[0].tp)
    return TpHeads(1, False, f"{odd.name!r} (TP rule {odd.tp}, {groups[0].name!r} has {groups[0].tp})")


def refuse_layout(layout: CacheLayout, heads: TpHeads, tp: int, peer_tp: int) -> None:
    """Raise ``ValueError`` naming the group and its rule when this layout cannot be linked to an
    instance of TP size ``peer_tp`` (this one's is ``tp``)."""
    state = [g for g in layout.groups if g.per_request]
    if state and tp != peer_tp:
        raise ValueError(f"cannot link TP {tp} to TP {peer_tp}: cache group {state[0].name!r} is a state group "
                         f"(one slot per request, TP rule {state[0].tp}) and moves whole between ranks of one TP size")
    if tp != peer_tp and heads[2] is not None:
        raise ValueError(f"cannot link TP {tp} to TP {peer_tp}: cache group {heads[2]}")
