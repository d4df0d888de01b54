"""Every preset of the 2026 models' cache layouts (``cache_manager.cache_presets``) through the
paths a block takes, with real CTMs at TP 2, bit-exact on every tensor of every layer of every group:
a swap out and in, a layer-wise swap in, a storage write and read on the file store, and a P/D
pull and layer-wise push over both transports.  A state group is never touched by a block task,
and a P/D link of a layout with one is refused naming it."""
from __future__ import annotations

import numpy as np
import pytest

from cache_manager.cache_presets import preset
from transfer_factory.file.store import FileStore
from transfer_factory.keys import chain_hash_ids, storage_key
from tests.pd_helpers import link_both, local_instance
from tests.service_helpers import fill_distinct, start_service, views

TP = 2
BLOCKS = 16
LAYERS = 4  # the pattern's first layers (deepseek-v4: both compressions, qwen3-next: one full layer)
SCALE = 8  # hidden dimensions / 8: a few MiB per instance
PRESETS = ["deepseek-v3", "glm-5", "deepseek-v4", "gpt-oss", "qwen3-next", "qwen3-235b"]
BLOCK_PRESETS = [p for p in PRESETS if p != "qwen3-next"]  # no state group


def layout(name: str, tp: int = TP):
    return preset(name, num_blocks=BLOCKS, layers=LAYERS, dim_scale=SCALE, tp=tp)


def state_keys(svc) -> set:
    state = {g.name for g in svc.layout.groups if g.per_request}
    return {k for k in views(svc) if k[1] in state}


def blocks(svc, ids: list[int], skip: set = frozenset()) -> dict:
    """(rank, group, i) -> a copy of blocks ``ids`` of that tensor."""
    return {k: v[ids].copy() for k, v in views(svc).items() if k not in skip}


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    for key in got:
        assert np.array_equal(got[key], want[key]), f"{key} differs"


def windowed(svc, before: dict, source: dict, aligned: bool = False) -> dict:
    """What blocks hold after a request's blocks (in order) moved into them: the source's, but a
    sliding-window group's only inside its window (the last blocks); before it they keep ``before``."""
    window = {g.name: g.window_blocks(svc.layout.block_size, aligned) for g in svc.layout.groups}
    out = {}
    for key, old in before.items():
        first = 0 if window[key[1]] is None else max(0, len(old) - window[key[1]])
        out[key] = np.concatenate([old[:first], source[key][first:]])
    return out


def after_transfer(p_svc, d_before: dict, src: list[int], dst: list[int]) -> dict:
    """What the decode side's blocks ``dst`` hold after a pull or push of ``src``."""
    return windowed(p_svc, d_before, blocks(p_svc, src))


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_swaps_loads_layer_by_layer_and_stores_bit_exact(name, tmp_path):
    svc = start_service(layout(name), tp=TP, num_cpu_blocks=8, storage_backend="file",
                        storage_options={"root": str(tmp_path), "fsync": False})
    try:
        fill_distinct(svc, seed=5)
        state = state_keys(svc)
        assert bool(state) == (name == "qwen3-next")
        kept_state = {k: views(svc)[k].copy() for k in state}
        want = blocks(svc, [1, 2, 3], state)

        assert svc.swap_to_cpu([1, 2, 3], [0, 4, 7]).result(timeout=30)
        assert svc.swap_to_gpu([9, 10, 11], [0, 4, 7]).result(timeout=30)
        same(blocks(svc, [9, 10, 11], state), want)

        future = svc.swap_to_gpu([12, 13, 14], [0, 4, 7], layerwise=True)
        for layer in range(svc.layout.total_layers):
            future.wait_for_layer(layer, timeout=20)
        assert future.result(timeout=20)
        same(blocks(svc, [12, 13, 14], state), want)

        keys = chain_hash_ids([f"{name}-{i}" for i in range(3)])
        assert svc.write_storage(keys, [1, 2, 3]).result(timeout=30) == [1, 2, 3]
        stored = windowed(svc, blocks(svc, [4, 5, 6], state), want, aligned=True)
        assert svc.read_storage(keys, [4, 5, 6]).result(timeout=30) == [4, 5, 6]
        same(blocks(svc, [4, 5, 6], state), stored)
        for key, before in kept_state.items():  # a state group is addressed by slot: block tasks leave it
            assert np.array_equal(views(svc)[key], before), key
    finally:
        svc.shutdown()


@pytest.mark.parametrize("name", BLOCK_PRESETS)
def test_each_preset_pulls_and_pushes_bit_exact_over_both_transports(name):
    with local_instance(layout(name), "prefill-0", tp=TP, num_cpu_blocks=4) as (p_svc, p), \
            local_instance(layout(name), "decode-0", tp=TP, num_cpu_blocks=4) as (d_svc, d):
        fill_distinct(p_svc, seed=7)
        fill_distinct(d_svc, seed=8)
        for transport in ("ipc", "mooncake"):
            link_both(p, d, transport)
            handle = p.expose(f"req-{transport}")
            src, dst = [3, 4, 5, 6], [10, 2, 7, 13]
            want = after_transfer(p_svc, blocks(d_svc, dst), src, dst)
            assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=30) == dst, transport
            same(blocks(d_svc, dst), want)
            p.retract(handle)

            src, dst = [11, 12, 1], [0, 15, 14]
            want = after_transfer(p_svc, blocks(d_svc, dst), src, dst)
            target = d.receive_push("prefill-0", dst, timeout=30)
            future = p.push_blocks("decode-0", target.ticket, src, layerwise=True, timeout=30)
            for layer in range(p_svc.layout.total_layers):
                future.layer_computed(layer + 1)
                target.wait_for_layer(layer, timeout=20)
            assert target.result(timeout=20) == dst and future.result(timeout=20) == dst
            same(blocks(d_svc, dst), want)
            assert target.close()
            assert p.unlink("decode-0") and d.unlink("prefill-0")


def test_storage_keeps_every_block_of_a_sliding_window_and_a_read_loads_only_its_window(tmp_path):
    """deepseek-v4 (a 128-token window on 128-token pages: one block): any stored block may end a
    later prefix hit, so every block's window object is stored; a read of any run loads the window
    group only for its last block, the other groups for every block."""
    svc = start_service(layout("deepseek-v4"), tp=TP, num_cpu_blocks=4, storage_backend="file",
                        storage_options={"root": str(tmp_path), "fsync": False})
    try:
        fill_distinct(svc, seed=13)
        keys = chain_hash_ids([f"long-{i}" for i in range(6)])
        src = [1, 2, 3, 4, 5, 6]
        source = blocks(svc, src)
        assert svc.write_storage(keys[:3], src[:3]).result(timeout=30) == src[:3]  # window: block 2
        assert svc.write_storage(keys, src).result(timeout=30) == src  # window: block 5
        ns = str(svc.namespace())
        for rank in range(TP):
            probe = FileStore(ns, rank, {"root": str(tmp_path), "fsync": False})
            try:
                for tag, want in (("window_caches", [1] * 6), ("c4_caches", [1] * 6)):
                    assert probe.exists([storage_key(ns, h, rank, tag) for h in keys]) == want, (rank, tag)
            finally:
                probe.close()

        for asked, served in ((6, 6), (4, 4), (2, 2)):
            dst = [9, 10, 11, 12, 13, 14][:asked]
            before = blocks(svc, dst)
            got = svc.read_storage(keys[:asked], dst).result(timeout=30)
            assert got == dst[:served], (asked, got)
            if served:
                want = windowed(svc, {k: v[:served] for k, v in before.items()},
                                {k: v[:served] for k, v in source.items()}, aligned=True)
                same({k: v[:served] for k, v in blocks(svc, dst).items()}, want)
    finally:
        svc.shutdown()


def test_a_sliding_window_request_moves_only_its_window_over_pd():
    """gpt-oss: 128-token windows on pages of 128 tokens, so a request's window is its last 2 blocks;
    the full-attention layers move every block."""
    with local_instance(layout("gpt-oss"), "prefill-0", tp=TP, num_cpu_blocks=4) as (p_svc, p), \
            local_instance(layout("gpt-oss"), "decode-0", tp=TP, num_cpu_blocks=4) as (d_svc, d):
        fill_distinct(p_svc, seed=11)
        fill_distinct(d_svc, seed=12)
        link_both(p, d, "ipc")
        src, dst = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
        before = blocks(d_svc, dst)
        handle = p.expose("long")
        assert d.pull_blocks("prefill-0", handle, src, dst).result(timeout=30) == dst
        got, source = blocks(d_svc, dst), blocks(p_svc, src)
        for key in got:
            if key[1].startswith("window_"):  # out of the window: never moved; inside: the source's
                assert np.array_equal(got[key][:4], before[key][:4]), key
                assert np.array_equal(got[key][4:], source[key][4:]), key
            else:
                assert np.array_equal(got[key], source[key]), key


@pytest.mark.parametrize("name,p_tp,d_tp", [("glm-5", 2, 1), ("deepseek-v4", 1, 2)])
def test_replicated_groups_are_read_from_one_rank_across_tp_sizes(name, p_tp, d_tp):
    with local_instance(layout(name, p_tp), "prefill-0", tp=p_tp, num_cpu_blocks=4) as (p_svc, p), \
            local_instance(layout(name, d_tp), "decode-0", tp=d_tp, num_cpu_blocks=4) as (d_svc, d):
        fill_distinct(p_svc, seed=9)
        link_both(p, d, "ipc")
        handle = p.expose("req")
        assert d.pull_blocks("prefill-0", handle, [1, 2], [5, 6]).result(timeout=30) == [5, 6]
        src = blocks(p_svc, [1, 2])
        for (rank, group, i), got in blocks(d_svc, [5, 6]).items():
            # every decode rank holds the whole replicated block; prefill rank 0's copy is the model's
            assert np.array_equal(got, src[(0, group, i)]), (rank, group, i)


def test_a_split_layout_links_across_tp_sizes_by_heads():
    with local_instance(layout("qwen3-235b", 1), "prefill-0", tp=1, num_cpu_blocks=4) as (p_svc, p), \
            local_instance(layout("qwen3-235b", 2), "decode-0", tp=2, num_cpu_blocks=4) as (d_svc, d):
        fill_distinct(p_svc, seed=10)
        link_both(p, d, "ipc")
        handle = p.expose("req")
        assert d.pull_blocks("prefill-0", handle, [3], [4]).result(timeout=30) == [4]
        for (rank, group, i), got in blocks(d_svc, [4]).items():
            whole = views(p_svc)[(0, group, i)][[3]]  # [1, 4 heads, B, D] as bytes
            heads = whole.reshape(1, 4, -1)[:, rank * 2:(rank + 1) * 2].reshape(got.shape)
            assert np.array_equal(got, heads), (rank, group, i)



def test_a_layout_mismatch_at_link_names_the_group_and_field():
    other = preset("glm-5", num_blocks=BLOCKS, layers=LAYERS, dim_scale=16, tp=TP)  # a smaller indexer and latent
    with local_instance(layout("glm-5"), "prefill-0", tp=TP, num_cpu_blocks=4) as (_, p), \
            local_instance(other, "decode-0", tp=TP, num_cpu_blocks=4) as (_, d):
        with pytest.raises(Exception, match="cache group 'latent_caches' block_shape differs"):
            d.link(p.descriptor(["ipc"]), transport="ipc")


def test_a_requests_state_is_stored_once_with_the_writes_last_block_and_loaded_at_the_runs_end(tmp_path):
    """qwen3-next: the conv and SSM state of a request (its slot, not its blocks) is one object per
    write, under the write's last block; a read loads it into the slot it names, and a run that
    ends where no write ended is cut back to one that did."""
    svc = start_service(layout("qwen3-next"), tp=TP, num_cpu_blocks=4, storage_backend="file",
                        storage_options={"root": str(tmp_path), "fsync": False})
    try:
        fill_distinct(svc, seed=14)
        keys = chain_hash_ids([f"hybrid-{i}" for i in range(5)])
        state = {k: v.copy() for k, v in views(svc).items() if k in state_keys(svc)}
        src = [1, 2, 3, 4, 5]
        source = blocks(svc, src, set(state))
        assert svc.write_storage(keys[:3], src[:3], state_slot=1).result(timeout=30) == src[:3]
        slot1 = {k: v[1].copy() for k, v in state.items()}
        for k in state:  # the request goes on: its state changes before the longer write
            views(svc)[k][1] = np.roll(views(svc)[k][1], 1)
        assert svc.write_storage(keys, src, state_slot=1).result(timeout=30) == src
        ns = str(svc.namespace())
        for rank in range(TP):
            probe = FileStore(ns, rank, {"root": str(tmp_path), "fsync": False})
            try:
                for tag in ("conv_state", "ssm_state"):  # once per write, under its last block
                    assert probe.exists([storage_key(ns, h, rank, tag) for h in keys]) == [0, 0, 1, 0, 1], tag
            finally:
                probe.close()

        got = svc.read_storage(keys[:4], [9, 10, 11, 12], state_slot=3).result(timeout=30)
        assert got == [9, 10, 11], "the run is cut back to the end of the first write"
        same({k: v[:3] for k, v in blocks(svc, [9, 10, 11, 12], set(state)).items()},
             {k: v[:3] for k, v in source.items()})
        for k, want in slot1.items():
            assert np.array_equal(views(svc)[k][3], want), k
        assert svc.read_storage(keys[:2], [13, 14], state_slot=3).result(timeout=30) == []
        before = {k: views(svc)[k].copy() for k in state}
        assert svc.read_storage(keys, [9, 10, 11, 12, 13]).result(timeout=30) == [9, 10, 11, 12, 13]  # no slot:
        for k in state:  # blocks only
            assert np.array_equal(views(svc)[k], before[k]), k
        with pytest.raises(ValueError, match="state_slot 99 must be an integer in"):
            svc.write_storage(keys, src, state_slot=99)
    finally:
        svc.shutdown()


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_requests_state_moves_once_over_pd_with_its_blocks(transport):
    """qwen3-next: a pull or push names the request's state slots (source, destination); the state
    groups move that one slot, every other slot keeps its bytes.  Across TP sizes the link is
    refused naming the state group."""
    with local_instance(layout("qwen3-next"), "prefill-0", tp=TP, num_cpu_blocks=4) as (p_svc, p), \
            local_instance(layout("qwen3-next"), "decode-0", tp=TP, num_cpu_blocks=4) as (d_svc, d):
        fill_distinct(p_svc, seed=15)
        fill_distinct(d_svc, seed=16)
        state = state_keys(p_svc)
        link_both(p, d, transport)
        handle = p.expose("hybrid")
        before = {k: views(d_svc)[k].copy() for k in state}
        assert d.pull_blocks("prefill-0", handle, [1, 2], [5, 6], state_slots=(1, 2)).result(timeout=30) == [5, 6]
        same(blocks(d_svc, [5, 6], state), blocks(p_svc, [1, 2], state))
        for k in state:
            want = before[k].copy()
            want[2] = views(p_svc)[k][1]
            assert np.array_equal(views(d_svc)[k], want), k

        target = d.receive_push("prefill-0", [7, 8], timeout=30)
        future = p.push_blocks("decode-0", target.ticket, [3, 4], layerwise=False, timeout=30, state_slots=(3, 0))
        assert target.result(timeout=20) == [7, 8] and future.result(timeout=20) == [7, 8]
        same(blocks(d_svc, [7, 8], state), blocks(p_svc, [3, 4], state))
        for k in state:
            assert np.array_equal(views(d_svc)[k][0], views(p_svc)[k][3]), k
        assert target.close()
        with pytest.raises(ValueError, match=r"state_slots\[1\] 9 must be an integer in \[0, 4\)"):
            d.pull_blocks("prefill-0", handle, [1], [5], state_slots=(1, 9))

    with local_instance(layout("qwen3-next", 1), "prefill-0", tp=1, num_cpu_blocks=4) as (_, p), \
            local_instance(layout("qwen3-next"), "decode-0", tp=TP, num_cpu_blocks=4) as (_, d):
        with pytest.raises(Exception, match="cache group 'conv_state' is a state group"):
            d.link(p.descriptor(["ipc"]), transport="ipc")


@pytest.mark.parametrize("name", ["deepseek-v4", "qwen3-next"])
def test_a_window_and_a_state_round_trip_through_a_mooncake_pool(name, tmp_path):
    """The same objects through a real mooncake_master and store clients: a read loads the window of
    its run's end; the request's state is under the write's last block, so a run ending inside the
    write is cut back to none when it carries a state slot."""
    pytest.importorskip("mooncake.store")
    from scripts.local_mooncake_master import LocalMooncakeMaster

    with LocalMooncakeMaster(log_dir=str(tmp_path)) as master:
        options = {**master.config(), "global_segment_size": 32 << 20, "local_buffer_size": 16 << 20}
        svc = start_service(layout(name), tp=TP, num_cpu_blocks=4, storage_backend="mooncake",
                            storage_options=options)
        try:
            fill_distinct(svc, seed=17)
            state = state_keys(svc)
            slot = {"state_slot": 1} if state else {}
            keys = chain_hash_ids([f"pool-{name}-{i}" for i in range(3)])
            source = blocks(svc, [1, 2, 3], state)
            assert svc.write_storage(keys, [1, 2, 3], **slot).result(timeout=30) == [1, 2, 3]
            want = windowed(svc, blocks(svc, [4, 5, 6], state), source, aligned=True)
            kept = {k: views(svc)[k][1].copy() for k in state}
            into = {"state_slot": 2} if state else {}
            assert svc.read_storage(keys, [4, 5, 6], **into).result(timeout=30) == [4, 5, 6]
            same(blocks(svc, [4, 5, 6], state), want)
            for k, v in kept.items():
                assert np.array_equal(views(svc)[k][2], v), k
            short = svc.read_storage(keys[:2], [7, 8], **into).result(timeout=30)
            assert short == ([] if state else [7, 8])  # no state stored there; every block's window is
        finally:
            svc.shutdown()


def test_heads_replicated_over_more_ranks_than_the_model_has_are_read_from_one_rank():
    """qwen3-235b: 4 kv heads, so at TP 8 ranks 2r and 2r+1 both hold head r.  A TP 8 decode rank
    reads its head from the one TP 2 prefill rank that holds it; a TP 8 prefill pushes each head of
    a TP 2 decode rank from one of its replicas, never a split of two."""
    small = {"num_blocks": 8, "layers": 2, "dim_scale": SCALE}
    with local_instance(preset("qwen3-235b", tp=2, **small), "prefill-0", tp=2, num_cpu_blocks=0) as (p_svc, p), \
            local_instance(preset("qwen3-235b", tp=8, **small), "decode-0", tp=8, num_cpu_blocks=0) as (d_svc, d):
        fill_distinct(p_svc, seed=18)
        fill_distinct(d_svc, seed=19)
        link_both(p, d, "ipc")
        handle = p.expose("replicas")
        assert d.pull_blocks("prefill-0", handle, [1, 2], [3, 4]).result(timeout=30) == [3, 4]
        source = blocks(p_svc, [1, 2])
        for (rank, group, i), got in blocks(d_svc, [3, 4]).items():
            head = rank * 4 // 8  # the model's head this decode rank holds
            whole = source[(head // 2, group, i)].reshape(2, 2, -1)  # [blocks, 2 heads of that prefill rank, bytes]
            assert np.array_equal(got.reshape(2, -1), whole[:, head % 2]), (rank, group, i)

    with local_instance(preset("qwen3-235b", tp=8, **small), "prefill-0", tp=8, num_cpu_blocks=0) as (p_svc, p), \
            local_instance(preset("qwen3-235b", tp=2, **small), "decode-0", tp=2, num_cpu_blocks=0) as (d_svc, d):
        fill_distinct(p_svc, seed=20)
        link_both(p, d, "ipc")
        target = d.receive_push("prefill-0", [5, 6], timeout=30)
        future = p.push_blocks("decode-0", target.ticket, [1, 2], layerwise=False, timeout=30)
        assert target.result(timeout=20) == [5, 6] and future.result(timeout=20) == [5, 6]
        source = blocks(p_svc, [1, 2])
        for (rank, group, i), got in blocks(d_svc, [5, 6]).items():
            heads = got.reshape(2, 2, -1)
            for h in range(2):  # decode rank r's head h is the model's 2r + h, held by prefill ranks 4r+2h, +1
                model_head = 2 * rank + h
                replicas = [source[(model_head * 2 + k, group, i)].reshape(2, -1) for k in range(2)]
                assert any(np.array_equal(heads[:, h], rep) for rep in replicas), (rank, group, i, h)
        assert target.close()


def test_a_requests_state_swaps_to_host_state_slots_and_back_whole_and_layer_by_layer():
    """qwen3-next: a swap names (device slot, host state slot); the state groups' slot moves with
    the blocks, bit-exact, a layer-wise swap-in lands it before any layer; a rank replaced since
    the swap-out emptied its host state slots, and a swap-in from one is refused naming it."""
    svc = start_service(layout("qwen3-next"), tp=TP, num_cpu_blocks=4, num_cpu_state_slots=2)
    try:
        fill_distinct(svc, seed=21)
        state = state_keys(svc)
        slot1 = {k: views(svc)[k][1].copy() for k in state}
        want = blocks(svc, [1, 2], state)
        assert svc.swap_to_cpu([1, 2], [0, 1], state_slots=(1, 1)).result(timeout=30)
        assert svc.swap_to_gpu([5, 6], [0, 1], state_slots=(3, 1)).result(timeout=30)
        same(blocks(svc, [5, 6], state), want)
        for k, v in slot1.items():
            assert np.array_equal(views(svc)[k][3], v), k

        future = svc.swap_to_gpu([7, 8], [0, 1], layerwise=True, state_slots=(0, 1))
        future.wait_for_layer(0, timeout=20)
        for k, v in slot1.items():  # the state landed before layer 0 was published
            assert np.array_equal(views(svc)[k][0], v), k
        assert future.result(timeout=20)
        same(blocks(svc, [7, 8], state), want)

        with pytest.raises(ValueError, match=r"state_slots\[1\] \(a host state slot\) 2 must be an integer in \[0, 2\)"):
            svc.swap_to_cpu([1], [0], state_slots=(1, 2))
        replaced = svc.rank_replacements
        svc.restart_rank(1)
        assert svc.rank_replacements == replaced + 1
        with pytest.raises(Exception, match=r"host slots \[.*\('state', 1\)\] lost their contents"):
            svc.swap_to_gpu([9], [0], state_slots=(2, 1)).result(timeout=30)
    finally:
        svc.shutdown()
