"""Layer-wise loads and stores over real CTM processes (TP=2): per-layer progress in shared memory,
``wait_for_layer`` and ``layer_computed``, checked byte for byte as each layer is reported."""
import os
import signal
import time

import numpy as np
import pytest

from engine_hooks import CacheSpec, TaskFailedError
from engine_hooks.core.layerwise import LayerWaitTimeout
from tests.helpers import host_blocks_match, kv_swap_rig
from tests.service_helpers import process_gone, segments_of, start_service, views

SPEC = CacheSpec(num_layers=6, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)
HOST_BLOCKS = 32


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    service = start_service(SPEC, tp=2, num_cpu_blocks=HOST_BLOCKS, storage_backend="file",
                            storage_options={"root": str(root), "fsync": False})
    yield service
    port = service.port
    service.shutdown()
    assert segments_of(port) == [], "the progress board and every other segment must be unlinked"
    assert all(process_gone(pid) for pid in service.pids().values())


def _layer_views(svc, layer):
    return {k: v for k, v in views(svc).items() if k[2] == layer}


def _randomize(svc, ids, seed):
    rng = np.random.default_rng(seed)
    for v in views(svc).values():
        v[ids] = rng.integers(0, 256, v[ids].shape, dtype=np.uint8)


def test_each_reported_layer_is_bit_exact_on_every_rank(svc):
    gpu, cpu = list(range(24)), list(range(3, 27))
    _randomize(svc, gpu, seed=1)
    expected = {k: v[gpu].copy() for k, v in views(svc).items()}
    svc.swap_to_cpu(gpu, cpu).result(timeout=20)
    _randomize(svc, gpu, seed=2)  # the engine reused the blocks; the load must bring the originals back
    future = svc.swap_to_gpu(gpu, cpu, layerwise=True)
    for layer in range(SPEC.num_layers):
        assert future.wait_for_layer(layer, timeout=20) == len(gpu)
        for key, view in _layer_views(svc, layer).items():
            assert np.array_equal(view[gpu], expected[key]), f"layer {layer} reported before {key} landed"
    future.result(timeout=20)
    future.released.result(timeout=20)


def test_a_layer_is_ready_only_once_every_rank_has_it(svc):
    gpu, cpu = [0, 1, 2, 3], [10, 11, 12, 13]
    _randomize(svc, gpu, seed=3)
    expected = {k: v[gpu].copy() for k, v in views(svc).items()}
    svc.swap_to_cpu(gpu, cpu).result(timeout=20)
    _randomize(svc, gpu, seed=4)
    stopped = svc.pids()[1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        future = svc.swap_to_gpu(gpu, cpu, timeout=20, layerwise=True)
        with pytest.raises(LayerWaitTimeout):
            future.wait_for_layer(0, timeout=0.5)
        rank0 = {k: v for k, v in views(svc).items() if k[0] == 0}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(np.array_equal(v[gpu], expected[k]) for k, v in rank0.items()):
            time.sleep(0.01)
        assert all(np.array_equal(v[gpu], expected[k]) for k, v in rank0.items()), "rank 0 should have loaded"
        with pytest.raises(LayerWaitTimeout):  # rank 0 has every layer, rank 1 none: still not ready
            future.wait_for_layer(SPEC.num_layers - 1, timeout=0.2)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert future.wait_for_layer(SPEC.num_layers - 1, timeout=20) == len(gpu)
    for key, view in views(svc).items():
        assert np.array_equal(view[gpu], expected[key])
    future.result(timeout=20)


def test_a_failed_load_fails_the_wait_at_once_with_the_task_error(svc):
    future = svc.swap_to_gpu([0], [HOST_BLOCKS + 5], timeout=20, layerwise=True)  # host slot out of range
    with pytest.raises(TaskFailedError, match=str(HOST_BLOCKS + 5)):
        future.wait_for_layer(0, timeout=15)
    future.released.result(timeout=20)


def test_bad_layers_and_misuse_are_refused(svc):
    future = svc.swap_to_gpu([0], [0], layerwise=True)
    for bad in (-1, SPEC.num_layers, 1.0, True, "0"):
        with pytest.raises(ValueError, match="layer"):
            future.wait_for_layer(bad)
    with pytest.raises(ValueError, match="layer-wise stores"):
        future.layer_computed(1)
    future.result(timeout=20)


def test_a_layerwise_store_copies_each_layer_only_once_computed(svc):
    gpu, cpu = [4, 5, 6], [20, 21, 22]
    _randomize(svc, gpu, seed=5)
    future = svc.swap_to_cpu(gpu, cpu, timeout=20, layerwise=True)
    final = {}
    for layer in range(SPEC.num_layers):
        time.sleep(0.02)  # a rank that copied without waiting would have taken the old bytes by now
        rng = np.random.default_rng(100 + layer)
        for key, view in _layer_views(svc, layer).items():  # "compute" layer `layer`
            view[gpu] = rng.integers(0, 256, view[gpu].shape, dtype=np.uint8)
            final[key] = view[gpu].copy()
        future.layer_computed(layer + 1)
    future.result(timeout=20)
    _randomize(svc, gpu, seed=6)
    svc.swap_to_gpu(gpu, cpu).result(timeout=20)
    for key, view in views(svc).items():
        assert np.array_equal(view[gpu], final[key]), f"{key}: the store copied a layer before it was computed"


def test_a_store_whose_layers_never_come_fails_at_its_deadline(svc):
    future = svc.swap_to_cpu([7], [23], timeout=1.0, layerwise=True)
    future.layer_computed(2)
    with pytest.raises(TaskFailedError, match="layer 2 was not computed"):
        future.result(timeout=15)
    future.released.result(timeout=15)


def test_layerwise_storage_read_reports_the_blocks_found(svc):
    gpu = [8, 9, 10, 11]
    _randomize(svc, gpu, seed=7)
    expected = {k: v[gpu].copy() for k, v in views(svc).items()}
    keys = [f"lw-{i}" for i in range(4)]
    stored = svc.write_storage(keys[:3], gpu[:3], layerwise=True)
    stored.layer_computed(SPEC.num_layers)
    assert stored.result(timeout=20) == gpu[:3]
    _randomize(svc, gpu, seed=8)
    future = svc.read_storage(keys, gpu, layerwise=True)  # the fourth key was never stored
    for layer in range(SPEC.num_layers):
        assert future.wait_for_layer(layer, timeout=20) == 3
        for key, view in _layer_views(svc, layer).items():
            assert np.array_equal(view[gpu[:3]], expected[key][:3])
    assert future.result(timeout=20) == gpu[:3]


# -- the parts without processes ----------------------------------------------------------------
def test_a_malformed_layerwise_field_is_refused_naming_it():
    from cache_manager.cache_tasks import TaskFormatError, task_from_wire

    base = {"event_type": 1, "task_id": "t", "swap_node_ids": [], "gpu_block_ids": [0], "cpu_block_ids": [0]}
    ok = task_from_wire({**base, "layerwise": {"slot": 3, "seq": 9, "await_compute": False}})
    assert (ok.layerwise.slot, ok.layerwise.seq) == (3, 9)
    assert task_from_wire(base).layerwise is None
    for bad, word in (([1], "map"), ({"slot": -1, "seq": 1}, "slot"), ({"slot": 0, "seq": 0}, "seq"),
                      ({"slot": 0, "seq": 1, "await_compute": 1}, "await_compute"), ({"slot": 10**6, "seq": 1}, "slot")):
        with pytest.raises(TaskFormatError, match=word):
            task_from_wire({**base, "layerwise": bad})


def test_layer_cuts_and_merges_of_a_plan_address_the_same_bytes():
    from ops.layout import layer_range, merge_plans

    with kv_swap_rig(f"lw{os.getpid()}", seed=0) as (platform, kinds):
        plans = [plan for _, _, plan in kinds]
        for layer in range(3):
            merged = merge_plans([layer_range(p, layer, layer + 1) for p in plans])
            platform.run_plan(merged, [5, 2], [0, 3], 0)
        assert host_blocks_match(platform, kinds, [0, 3], [5, 2])
        with pytest.raises(ValueError, match="layer range"):
            layer_range(plans[0], 2, 4)
