"""One conformance suite for every storage backend (DESIGN §3.10), at TP=2 with real CTM processes:
``file`` (real files), ``mooncake`` (a real master on loopback), ``attention_store`` and ``ems``
(the vendor SDKs' contract stand-ins, ``tests/standins``).  Every task carries both the block
hashes and the token ids, as the engine's tasks do, so hash- and token-addressed backends run
the same rows.  A row a backend cannot honour is reported with its reason (``Harness.cannot``).

``pytest tests/transfer_factory/backends/test_backend_conformance.py`` runs it alone (about two minutes).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_hooks import StartupError
from tests.backend_harness import FP8, HARNESSES
from tests.service_helpers import block_bytes, fill_distinct, views, write_random_blocks
from transfer_factory.keys import chain_hashes

FAULT_TIMEOUT = 1.0  # seconds a task may take while its backend is failing


@pytest.fixture(scope="module", params=list(HARNESSES))
def harness(request, tmp_path_factory):
    h = HARNESSES[request.param](tmp_path_factory.mktemp(f"store-{request.param}"))
    yield h
    h.close()


@pytest.fixture(scope="module")
def svc(harness):
    service = harness.start()
    yield service
    service.shutdown()


def prefix(svc, n: int, seed: int) -> tuple[list[int], list[str]]:
    """The token ids of an n-block prefix and its chained block hashes."""
    bs = svc.spec.block_size
    tokens = np.random.default_rng(seed).integers(0, 50000, n * bs).tolist()
    return tokens, chain_hashes(tokens, bs)


def unless(harness, row: str) -> None:
    if row in harness.cannot:
        pytest.skip(f"{harness.name} cannot: {harness.cannot[row]}")


def equal(got: dict, want: dict) -> None:
    for k in want:
        assert np.array_equal(got[k], want[k]), f"rank/kind/layer {k}"


def test_round_trip_is_bit_exact_with_every_cache_kind_and_extra_layers(svc, harness):
    fill_distinct(svc, seed=1)
    kinds = {kind for (_, kind, _) in views(svc)}
    assert max(layer for (_, _, layer) in views(svc)) == svc.spec.num_layers  # the speculative layer
    if "fp8" in harness.cannot:  # the refusal is the behaviour: never half a cache
        assert "key_cache_scales" not in kinds
        with pytest.raises(StartupError, match="block_wise_fp8"):
            harness.start(spec=FP8, model_id="conf/fp8")
    else:
        assert {"key_cache_scales", "value_cache_scales"} <= kinds
    tokens, keys = prefix(svc, 5, seed=1)
    src, dst = [1, 2, 3, 4, 5], [8, 9, 10, 11, 12]
    want = block_bytes(svc, src)
    assert svc.write_storage(keys, src, token_ids=tokens).result(timeout=30) == src
    for view in views(svc).values():
        view[dst] = 0
    assert svc.read_storage(keys, dst, token_ids=tokens).result(timeout=30) == dst
    equal(block_bytes(svc, dst), want)


def spoil_block_2_of_rank_1(svc, seed: int, spoil) -> None:
    """Store 4 blocks, ``spoil`` block 2 on rank 1 only; a read loads blocks 0 and 1, bit-exact."""
    fill_distinct(svc, seed=seed)
    tokens, keys = prefix(svc, 4, seed=seed)
    want = block_bytes(svc, [0, 1])
    assert svc.write_storage(keys, [0, 1, 2, 3], token_ids=tokens).result(timeout=30) == [0, 1, 2, 3]
    spoil(svc, keys, tokens, block=2, rank=1)
    assert svc.read_storage(keys, [8, 9, 10, 11], token_ids=tokens).result(timeout=30) == [8, 9]
    equal(block_bytes(svc, [8, 9]), want)


def test_a_block_missing_on_one_rank_cuts_the_read_at_the_minimum_over_ranks(svc, harness):
    spoil_block_2_of_rank_1(svc, 2, harness.drop)


def test_a_write_skips_the_prefix_already_stored(svc):
    fill_distinct(svc, seed=3)
    tokens, keys = prefix(svc, 4, seed=3)
    first = block_bytes(svc, [0, 1])
    assert svc.write_storage(keys[:2], [0, 1], token_ids=tokens[:2 * svc.spec.block_size]).result(timeout=30) == [0, 1]
    write_random_blocks(svc, [0, 1], seed=33)  # a second write must not store these bytes
    later = block_bytes(svc, [2, 3])
    assert svc.write_storage(keys, [0, 1, 2, 3], token_ids=tokens).result(timeout=30) == [0, 1, 2, 3]
    assert svc.read_storage(keys, [12, 13, 14, 15], token_ids=tokens).result(timeout=30) == [12, 13, 14, 15]
    equal(block_bytes(svc, [12, 13]), first)
    equal(block_bytes(svc, [14, 15]), later)


def test_a_read_starts_at_start_read_block_idx(svc):
    fill_distinct(svc, seed=4)
    tokens, keys = prefix(svc, 6, seed=4)
    want = block_bytes(svc, [2, 3])
    assert svc.write_storage(keys[:4], [0, 1, 2, 3], token_ids=tokens).result(timeout=30) == [0, 1, 2, 3]
    got = svc.read_storage(keys, [5, 6, 7, 8], start_read_block_idx=2, token_ids=tokens).result(timeout=30)
    assert got == [5, 6]  # blocks 2 and 3 are stored, 4 and 5 are not
    equal(block_bytes(svc, [5, 6]), want)
    _, other = prefix(svc, 3, seed=99)
    assert svc.read_storage(other, [5, 6, 7], token_ids=prefix(svc, 3, seed=99)[0]).result(timeout=30) == []


def test_two_models_and_two_tp_layouts_never_see_each_others_blocks(svc, harness):
    fill_distinct(svc, seed=5)
    tokens, keys = prefix(svc, 3, seed=5)
    assert svc.write_storage(keys, [0, 1, 2], token_ids=tokens).result(timeout=30) == [0, 1, 2]
    for other in (harness.start(model_id="conf/model-b"), harness.start(tp=1)):
        try:
            assert other.read_storage(keys, [0, 1, 2], token_ids=tokens).result(timeout=30) == [], \
                f"{other.model_id} at TP={other.tp} read blocks of conf/model-a at TP=2"
        finally:
            other.shutdown()
    assert svc.read_storage(keys, [6, 7, 8], token_ids=tokens).result(timeout=30) == [6, 7, 8]


def test_a_damaged_object_is_a_miss(svc, harness):
    unless(harness, "damage")
    spoil_block_2_of_rank_1(svc, 6, harness.damage)


def test_a_failing_backend_gives_zero_blocks_in_time_swaps_go_on_and_it_recovers(svc, harness):
    """Last in the file: it leaves the backend's I/O threads busy for a few seconds."""
    fill_distinct(svc, seed=7)
    tokens, keys = prefix(svc, 2, seed=7)
    new_tokens, new_keys = prefix(svc, 2, seed=77)
    stored = block_bytes(svc, [0, 1])
    assert svc.write_storage(keys, [0, 1], token_ids=tokens).result(timeout=30) == [0, 1]
    swapped = block_bytes(svc, [6])
    with harness.failing():
        write = svc.write_storage(new_keys, [2, 3], token_ids=new_tokens, timeout=FAULT_TIMEOUT)
        read = svc.read_storage(keys, [4, 5], token_ids=tokens, timeout=FAULT_TIMEOUT)
        assert write.result(timeout=FAULT_TIMEOUT + 10) == []  # bounded by the task's deadline plus grace
        assert read.result(timeout=FAULT_TIMEOUT + 10) == []
        if harness.late_call_holds_blocks:  # answered in time, blocks held until the hung SDK returns
            assert not write.released.done() and not read.released.done()
        assert svc.swap_to_cpu([6], [0]).result(timeout=30)
        assert svc.swap_to_gpu([7], [0]).result(timeout=30)
        equal(block_bytes(svc, [7]), swapped)
    write.released.result(timeout=30)  # a late call has let go of the blocks
    read.released.result(timeout=30)
    assert svc.read_storage(keys, [8, 9], token_ids=tokens).result(timeout=30) == [8, 9]
    equal(block_bytes(svc, [8, 9]), stored)
    fresh = block_bytes(svc, [2, 3])
    assert svc.write_storage(new_keys, [2, 3], token_ids=new_tokens).result(timeout=30) == [2, 3]
    assert svc.read_storage(new_keys, [10, 11], token_ids=new_tokens).result(timeout=30) == [10, 11]
    equal(block_bytes(svc, [10, 11]), fresh)
