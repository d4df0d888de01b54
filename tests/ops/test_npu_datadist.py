"""LLM-DataDist as the NPU platform's swap-space copy engine (ops/npu_datadist.py), over two contract
stand-ins: tests/standins/llm_datadist running on tests/standins/acl (device memory the host cannot
reach; every byte the library moves is an acl.rt.memcpy it makes itself)."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import ops
from ops.modes import DEVICE_TO_HOST, HOST_TO_DEVICE
from ops.npu import NpuDeviceView
from ops.npu_datadist import split_by_source
from tests.npu_helpers import (BLOCK_BYTES, LAYERS, SHAPE, Rig, forget_standin_modules, leftovers,
                               scattered_swaps_are_bit_exact, use_acl_standin)

NUM_CPU = 8


@pytest.fixture
def standins(tmp_path, monkeypatch):
    """(acl, llm_datadist) stand-in modules, sharing $ACL_STANDIN_DIR."""
    use_acl_standin(tmp_path, monkeypatch)
    import acl
    import llm_datadist

    yield acl, llm_datadist
    forget_standin_modules()


@pytest.fixture
def rig(standins):
    made = Rig(copy_engine="llm_datadist", num_cpu=NUM_CPU)
    yield made
    made.close()
    assert made.ctm._datadist is None, "the last free should finalise LLM-DataDist"


def test_scattered_swaps_are_bit_exact_with_one_swap_blocks_per_plan_and_direction(standins, rig):
    acl, dd = standins
    want = rig.read()
    gpu, cpu = [1, 3, 4, 9, 12], [0, 1, 2, 3, 4]
    acl.standin_reset_calls()
    dd.standin_reset_calls()
    assert rig.ctm.run_plan(rig.plan, gpu, cpu, DEVICE_TO_HOST) == len(gpu) * LAYERS
    a, d = acl.standin_calls(), dd.standin_calls()
    assert d["swap_blocks"] == 1 and not d.get("register_blocks_cache"), "registered once, when the plan was built"
    assert a.get("memcpy") == d["acl.rt.memcpy"], "every runtime copy is LLM-DataDist's own"
    assert not (a.get("memcpy_batch_async") or a.get("memcpy_async") or a.get("synchronize_stream"))
    rig.zero()
    acl.standin_reset_calls()
    dd.standin_reset_calls()
    swap_in = threading.Thread(target=rig.ctm.run_plan, args=(rig.plan, [2, 5, 6, 7, 15], cpu, HOST_TO_DEVICE))
    swap_in.start()  # a fresh thread: run_plan binds it to the device
    swap_in.join()
    a, d = acl.standin_calls(), dd.standin_calls()
    assert d["swap_blocks"] == 1 and d["acl.rt.malloc"] == d["acl.rt.free"] == 1  # the staging area
    assert a.get("memcpy") == d["acl.rt.memcpy"] and not a.get("memcpy_batch_async")
    for got, w in zip(rig.read(), want):
        assert np.array_equal(got[[2, 5, 6, 7, 15]], w[gpu])
        assert not got[[0, 1, 3, 4, 8]].any()
    # A layout plan (block-major storage staging) keeps the pyACL batched copy.
    staging = rig.ctm.host_alloc(4 * LAYERS * BLOCK_BYTES)
    try:
        dd.standin_reset_calls()
        acl.standin_reset_calls()
        layout = rig.ctm.plan_layout(rig.attached, staging, list(SHAPE))
        rig.ctm.run_plan(layout, [2, 5], [0, 1], DEVICE_TO_HOST)
        assert acl.standin_calls().get("memcpy_batch_async") == 1 and not dd.standin_calls().get("swap_blocks")
    finally:
        rig.ctm.host_free(staging)


def test_ids_are_checked_before_anything_moves_and_a_repeated_source_is_split(standins, rig):
    _, dd = standins
    dd.standin_reset_calls()
    with pytest.raises(ValueError, match="host block id 3 appears more than once"):
        rig.ctm.run_plan(rig.plan, [1, 2], [3, 3], DEVICE_TO_HOST)
    with pytest.raises(ValueError, match="device block id 16"):
        rig.ctm.run_plan(rig.plan, [1, 16], [0, 1], DEVICE_TO_HOST)
    assert not dd.standin_calls().get("swap_blocks")
    want = rig.read()
    rig.ctm.run_plan(rig.plan, [5, 6], [0, 1], DEVICE_TO_HOST)
    rig.ctm.run_plan(rig.plan, [9, 10, 11], [0, 0, 1], HOST_TO_DEVICE)  # host block 0 to two device blocks
    assert dd.standin_calls()["swap_blocks"] == 3  # one out, two in (a dict holds a source once)
    for got, w in zip(rig.read(), want):
        assert np.array_equal(got[[9, 10, 11]], w[[5, 5, 6]])
    assert split_by_source([4, 4, 7, 4], [0, 1, 2, 3]) == [{4: 0, 7: 2}, {4: 1}, {4: 3}]


def test_the_documented_limits_fail_the_plan_with_a_clear_error(standins):
    acl, dd = standins
    from ops.npu import NpuPlatform

    ctm = NpuPlatform(instance="lim", copy_engine="llm_datadist")
    ctm.set_device(0)
    caches = [ctm.empty([4, 64], "bfloat16") for _ in range(257)]
    hosts = [ctm.host_alloc(4 * BLOCK_BYTES) for _ in range(257)]
    try:
        with pytest.raises(ValueError, match=r"at most 256 tensor addresses.*needs 257"):
            ctm.plan_all_layers(caches, hosts, 4)
        huge = NpuDeviceView(caches[0].ptr, (400_000, 65536), "bfloat16", "huge")  # 52.4e9 bytes described
        with pytest.raises(ValueError, match=r"at most 50 GB"):
            ctm.plan_all_layers([huge], [ctm.host_alloc(1 << 17)], 1)
        assert not dd.standin_calls().get("register_blocks_cache"), "refused before registering"
        # The stand-in holds the same limits itself (and the 240 of some releases by knob).
        manager = ctm._datadist._manager
        desc = dd.CacheDesc(200, [4, 64], dd.DataType.DT_BF16)
        first = manager.register_blocks_cache(desc, [c.ptr for c in caches[:200]])
        with pytest.raises(dd.LLMException, match="at most 256"):
            manager.register_blocks_cache(dd.CacheDesc(57, [4, 64], dd.DataType.DT_BF16), [c.ptr for c in caches[200:]])
        (Path(os.environ["ACL_STANDIN_DIR"]) / "llm_datadist_faults.json").write_text(json.dumps({"max_addresses": 240}))
        with pytest.raises(dd.LLMException, match="at most 240"):
            manager.register_blocks_cache(dd.CacheDesc(41, [4, 64], dd.DataType.DT_BF16), [c.ptr for c in caches[200:241]])
        with pytest.raises(dd.LLMException, match="50 GB"):
            manager.register_blocks_cache(dd.CacheDesc(1, [400_000, 65536], dd.DataType.DT_BF16), [caches[0].ptr])
        manager.unregister_cache(first.cache_id)
    finally:
        for ptr in list(ctm.host_allocations):
            ctm.host_free(ptr)
        for t in caches:
            ctm.free(t)


def test_a_swap_in_on_a_full_device_fails_and_leaves_the_destination_unchanged(standins, monkeypatch):
    acl, dd = standins
    monkeypatch.setenv("ACL_STANDIN_DEVICE_BYTES", str(256 << 10))  # 64 pages
    made = Rig(copy_engine="llm_datadist", num_cpu=NUM_CPU)
    filler = []
    try:
        want = made.read()
        made.ctm.run_plan(made.plan, [1, 2], [0, 1], DEVICE_TO_HOST)
        made.zero()
        made.ctm.set_device(0)
        for size in (1 << 17, 1 << 16, 1 << 15, 1 << 14, 1 << 13, 1 << 12):  # take every free page
            while True:
                ptr, ret = acl.rt.malloc(size, 0)
                if ret:
                    break
                filler.append(ptr)
        with pytest.raises(RuntimeError, match=r"swap_blocks swap in .*staging area.*aclError 207001"):
            made.ctm.run_plan(made.plan, [7, 8], [0, 1], HOST_TO_DEVICE)
        assert not any(got.any() for got in made.read()), "a refused swap-in wrote nothing"
        acl.rt.free(filler.pop())  # one page back: room for the 4-block staging area (4 x 3 x 128 bytes)
        made.ctm.run_plan(made.plan, [7, 8], [0, 1], HOST_TO_DEVICE)
        for got, w in zip(made.read(), want):
            assert np.array_equal(got[[7, 8]], w[[1, 2]])
    finally:
        for ptr in filler:
            acl.rt.free(ptr)
        made.close()


def test_the_standin_contract(standins, tmp_path):
    acl, dd = standins
    llm = dd.LLMDataDist(dd.LLMRole.DECODER, 7)
    with pytest.raises(dd.LLMException, match="init"):
        llm.cache_manager
    llm.init({"ge.exec.deviceId": "0"})
    with pytest.raises(dd.LLMException, match="EnableCacheManager"):
        llm.cache_manager
    llm.finalize()
    with pytest.raises(TypeError):
        dd.CacheDesc(2, [4, 64], "bf16")
    with pytest.raises(ValueError, match="num_tensors"):
        dd.Cache.create_cpu_cache(dd.CacheDesc(2, [4, 64], dd.DataType.DT_BF16, dd.Placement.HOST), [4096])
    from ops.npu import NpuPlatform

    rig = Rig(copy_engine="llm_datadist", layers=2, num_cpu=NUM_CPU)
    try:
        rig.ctm.run_plan(rig.plan, [0], [0], DEVICE_TO_HOST)  # build the caches
        manager = rig.ctm._datadist._manager
        (device, host), = [(r.cache, h) for r in rig.ctm._datadist._device.values() for h in rig.ctm._datadist._host.values()]
        rig.ctm.set_device(0)
        with pytest.raises(TypeError, match="int to int"):
            manager.swap_blocks(device, host, {np.int64(1): 0})
        with pytest.raises(ValueError, match="dst_block_index:8"):
            manager.swap_blocks(device, host, {1: 8})
        with pytest.raises(ValueError, match="must be equal"):
            bad = dd.Cache.create_cpu_cache(dd.CacheDesc(2, [8, 32], dd.DataType.DT_FLOAT16, dd.Placement.HOST), rig.host[:2])
            manager.swap_blocks(device, bad, {1: 0})
        with pytest.raises(AttributeError):
            manager.swap_blocks(device, host, None)
        errors = []
        unbound = threading.Thread(target=lambda: errors.append(pytest.raises(dd.LLMException, manager.swap_blocks,
                                                                              device, host, {1: 0})))
        unbound.start()  # a thread never bound to the device: refused, as the stand-in binds no thread itself
        unbound.join()
        assert errors and "acl.rt.set_device first" in str(errors[0].value)
        (tmp_path / "acl" / "llm_datadist_faults.json").write_text(json.dumps({"fail": {"swap_blocks": 1}}))
        dd.standin_reset_calls()
        with pytest.raises(RuntimeError, match="injected fault"):
            rig.ctm.run_plan(rig.plan, [0], [0], DEVICE_TO_HOST)
        rig.ctm.run_plan(rig.plan, [0], [0], DEVICE_TO_HOST)  # only the first call fails
    finally:
        rig.close()
    with pytest.raises(ValueError, match="'nccl'.*acl, llm_datadist"):
        NpuPlatform(copy_engine="nccl")
    with pytest.raises(ValueError, match="platform 'cpu' has no copy engine 'llm_datadist'; its copy engines: none"):
        ops.get_platform("cpu", copy_engine="llm_datadist")
    assert ops.copy_engines("npu") == ("acl", "llm_datadist") and ops.copy_engines("cpu") == ()


def test_a_service_swaps_through_llm_datadist(tmp_path, monkeypatch):
    """The whole system: real CTM processes on --platform npu --npu_copy_engine llm_datadist."""
    from engine_hooks import TaskFailedError
    from tests.service_helpers import SMALL, start_service

    acl_dir = use_acl_standin(tmp_path, monkeypatch)
    try:
        svc = start_service(SMALL, platform="npu", extra_flags={"npu_copy_engine": "llm_datadist"})
        port = svc.port
        try:
            assert scattered_swaps_are_bit_exact(svc, seed=7)
            # The ranks really swap through LLM-DataDist: its 5th swap_blocks (2 cache kinds x 2 tasks so far) fails.
            (acl_dir / "llm_datadist_faults.json").write_text(json.dumps({"fail": {"swap_blocks": 5}}))
            with pytest.raises(TaskFailedError, match="swap_blocks"):
                svc.swap_to_cpu([3], [1]).result(timeout=30)
            (acl_dir / "llm_datadist_faults.json").unlink()
            svc.swap_to_cpu([3], [1]).result(timeout=30)
        finally:
            svc.shutdown()
        assert leftovers(port) == []
    finally:
        forget_standin_modules()
