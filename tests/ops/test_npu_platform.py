"""The NPU platform on a host without Ascend hardware: its failure mode and its pure helpers."""
import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops.acl_copy import merge_runs
from ops.layout import Side, check_side_ids, tensor_info
from ops.npu import NpuDeviceView, NpuPlatform, check_acl

no_acl = pytest.mark.skipif(importlib.util.find_spec("acl") is not None, reason="pyACL is installed here")


@no_acl
def test_constructing_without_acl_names_the_missing_module():
    with pytest.raises(RuntimeError) as err:
        NpuPlatform()
    message = str(err.value)
    assert "'acl'" in message and "cpu" in message


@no_acl
def test_get_platform_npu_without_acl_raises():
    with pytest.raises(RuntimeError, match="acl"):
        ops.get_platform("npu")


def test_check_acl_names_call_and_code():
    check_acl(0, "acl.rt.memcpy")
    with pytest.raises(RuntimeError, match=r"acl\.rt\.memcpy failed with aclError 507899"):
        check_acl(507899, "acl.rt.memcpy")


def expand(runs):
    return [(s + k, d + k) for s, d, n in runs for k in range(n)]


def test_merge_runs_example():
    assert merge_runs([3, 4, 5, 9, 10], [0, 1, 2, 7, 9]) == [(3, 0, 3), (9, 7, 1), (10, 9, 1)]
    assert merge_runs([], []) == []
    assert merge_runs(np.array([7]), np.array([2])) == [(7, 2, 1)]
    with pytest.raises(ValueError):
        merge_runs([1, 2], [1])


# Pairs built from runs, so long consecutive stretches (and runs that touch) are common.
run_built = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 6)), max_size=12
).map(expand)
random_pairs = st.lists(st.tuples(st.integers(-3, 20), st.integers(-3, 20)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.one_of(run_built, random_pairs))
def test_merge_runs_is_exact_and_maximal(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = merge_runs(src, dst)
    assert expand(runs) == pairs
    assert all(n >= 1 for _, _, n in runs)
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert not (s1 == s0 + n0 and d1 == d0 + n0), "two adjacent runs could have been one"


def side(capacities):
    caps = np.array(capacities, dtype=np.int64)
    return Side("host", np.zeros(len(caps), dtype=np.int64), caps, 64)


def test_check_ids_range_and_duplicates():
    check_side_ids(np.array([0, 3, 1], dtype=np.int64), side([4, 5]), unique=True)
    with pytest.raises(ValueError, match=r"block id 4 at position 1 is out of range \[0, 4\)"):
        check_side_ids(np.array([0, 4], dtype=np.int64), side([4, 5]), unique=False)
    with pytest.raises(ValueError, match="block id -1 at position 0"):
        check_side_ids(np.array([-1], dtype=np.int64), side([4]), unique=False)
    with pytest.raises(ValueError, match=r"block id 2 appears more than once \(again at position 3\)"):
        check_side_ids(np.array([2, 0, 1, 2, 0], dtype=np.int64), side([4]), unique=True)
    check_side_ids(np.array([2, 2], dtype=np.int64), side([4]), unique=False)  # sources may repeat


def test_device_view_is_a_copy_operand():
    view = NpuDeviceView(0x1000, (8, 2, 16, 64), "bfloat16", "key_caches_0_rank0.device0")
    info = tensor_info(view, "caches[0]")
    assert (info.ptr, info.shape, info.dtype.name) == (0x1000, (8, 2, 16, 64), "bfloat16")
    assert info.nbytes == 8 * 2 * 16 * 64 * 2


def test_platforms_say_what_they_can_do_instead_of_being_named():
    """Capabilities, not names: every platform takes the engine instance into its IPC names, says
    whether device memory is host memory, and removes what a dead engine exported."""
    from ops.cpu import CpuPlatform

    assert NpuPlatform.takes_instance and CpuPlatform.takes_instance
    assert CpuPlatform.host_addressable and not NpuPlatform.host_addressable
    cpu = ops.get_platform("cpu", instance="capx")
    assert cpu.segment_prefix.endswith("capx.")
    npu = NpuPlatform.__new__(NpuPlatform)  # no pyACL here: only the naming is exercised
    npu.instance = "capy"
    assert npu.segment_prefix == "ctm.npu.capy." and npu.segment_name("k") == "ctm.npu.capy.k"
    t = cpu.empty([2, 4], "bfloat16")
    cpu.set_data_ipc(t, "orphan")
    removed = cpu.remove_orphans()  # as a CTM does once the engine process is gone
    assert cpu.segment_name("orphan") in removed
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(cpu.segment_prefix)]


def test_npu_device_view_reports_its_element_size():
    assert NpuDeviceView(4096, (2, 2, 4, 8), "bfloat16", "key_caches_0_rank0.device0").element_size() == 2
    assert NpuDeviceView(4096, (2, 2, 4, 8), "uint8", "key_caches_0_rank0.device0").element_size() == 1


def test_each_rank_s_caches_are_created_on_its_own_device(cpu, monkeypatch):
    from engine_hooks import CacheSpec
    from engine_hooks.core.device_caches import DeviceCaches

    bound = []
    monkeypatch.setattr(cpu, "set_device", bound.append)
    caches = DeviceCaches(cpu, CacheSpec(num_layers=1, num_blocks=2, kv_heads=1, block_size=2, head_dim=4), 2, [3, 5])
    try:
        caches.create_rank(0)
        caches.create_rank(1)
    finally:
        caches.close()
    assert bound == [3, 5]
