"""Which kv heads of which peer rank a rank exchanges (transfer_factory/peer/heads.py), checked
against the model's heads: every reader head comes from a rank that holds that head, once."""
import pytest

from transfer_factory.peer.heads import first_head, reader_spans, writer_spans


def model_heads(rank: int, tp: int, heads: int, total: int) -> list[int]:
    start = first_head(rank, tp, heads, total)
    return list(range(start, start + heads))


@pytest.mark.parametrize("tp,peer_tp,total", [(1, 2, 4), (2, 1, 4), (2, 8, 4), (8, 2, 4), (8, 4, 4), (4, 8, 4),
                                               (8, 1, 4), (2, 4, 8), (8, 8, 4)])
def test_every_reader_head_comes_once_from_a_rank_that_holds_it(tp, peer_tp, total):
    heads, peer_heads = max(1, total // tp), max(1, total // peer_tp)
    readers_of = {}
    for rank in range(tp):
        got = {}
        for span in reader_spans(rank, tp, heads, peer_tp, peer_heads, False, total):
            theirs = model_heads(span.peer_rank, peer_tp, peer_heads, total)[span.peer_head:span.peer_head + span.heads]
            mine = model_heads(rank, tp, heads, total)[span.local_head:span.local_head + span.heads]
            assert theirs == mine, (rank, span)
            for h in mine:
                assert h not in got, f"head {h} read twice"
                got[h] = span.peer_rank
        assert sorted(got) == model_heads(rank, tp, heads, total)
        for h, peer in got.items():
            readers_of.setdefault((h, peer), []).append(rank)
    if peer_tp > total:  # readers of a replicated head spread over its replicas
        used = {peer for (_, peer) in readers_of}
        assert len(used) >= min(peer_tp, tp * heads), used
    # a push is the same relation seen from the writer
    pushed = {(p, s.peer_rank, s.local_head, s.heads) for p in range(peer_tp)
              for s in writer_spans(p, peer_tp, peer_heads, tp, heads, False, total)}
    pulled = {(s.peer_rank, r, s.peer_head, s.heads) for r in range(tp)
              for s in reader_spans(r, tp, heads, peer_tp, peer_heads, False, total)}
    assert pushed == pulled


def test_heads_that_cannot_split_the_model_are_refused():
    with pytest.raises(ValueError, match="2 kv heads per rank at TP 8 do not split the model's 4"):
        reader_spans(0, 8, 2, 2, 2, False, 4)
    with pytest.raises(ValueError, match="kv heads x tp differ"):
        reader_spans(0, 8, 1, 2, 2, False)  # replicas, but nobody said how many heads the model has
