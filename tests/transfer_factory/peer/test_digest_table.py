"""The P/D digest table (``transfer_factory.peer.digests``): a region validates only for the handle
and generation that wrote it, and the arena gives a region to another handle only once its own is
no longer live."""
import numpy as np
import pytest

from transfer_factory.peer.digests import DigestArena, DigestMismatch, read_region, region_words, write_region


def test_a_region_validates_only_for_its_handle_and_generation():
    table = np.zeros(64, dtype=np.int64)
    digests = np.arange(6, dtype=np.int64).reshape(2, 3) + 100  # 2 tensors x 3 blocks
    write_region(table, 5, handle_id=7, generation=3, ids=[4, 9, 2], digests=digests)
    words = table[5:5 + region_words(3, 2)]
    positions, got = read_region(words, 7, 3, 2, "p rank 0")
    assert positions == {4: 0, 9: 1, 2: 2} and np.array_equal(got, digests)
    with pytest.raises(DigestMismatch, match="no digests published for this handle"):
        read_region(words, 8, 3, 2, "p rank 0")  # a stale region of another handle
    with pytest.raises(DigestMismatch, match="generation 3"):
        read_region(words, 7, 4, 2, "p rank 0")  # the caches were replaced since
    with pytest.raises(DigestMismatch, match="does not hold"):
        read_region(words[:-1], 7, 3, 2, "p rank 0")
    with pytest.raises(DigestMismatch, match="no digests published"):
        read_region(np.zeros(region_words(3, 2), dtype=np.int64), 7, 3, 2, "p rank 0")  # never written


def test_the_arena_reuses_a_region_only_once_its_handle_is_not_live():
    arena = DigestArena(100)
    a, b = arena.allocate(1, 40), arena.allocate(2, 40)
    assert (a, b) == (0, 40)
    with pytest.raises(RuntimeError, match="no room"):
        arena.allocate(3, 40)
    assert arena.reclaim(live=[1, 2]) == 0  # both live: nothing goes back
    assert arena.reclaim(live=[2]) == 1
    assert arena.allocate(3, 40) == 0  # handle 1's region, now that it is not live
    assert arena.reclaim(live=[]) == 2
    assert arena.allocate(4, 100) == 0  # every free range merged back into one
