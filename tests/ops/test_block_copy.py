"""Block copies on the CPU platform: bit-exact round trips, untouched neighbours and refused bad input.
The kernel's copy-thread pool (concurrent callers, fork, thread-creation failure) is tested in
test_copy_thread_pool.py."""
import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ops
from ops.cpu import CpuPlatform
from tests.helpers import cache_bytes, fill_random

DTYPES = ["bfloat16", "float16", "uint8", "float32"]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def copy_case(draw):
    layers = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 24))
    num_cpu_blocks = draw(st.integers(1, 24))
    heads, block_size, head_dim = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 8, 32]))
    scales = draw(st.booleans())  # fp8 scale tensors are [num_blocks, heads, block_size]
    shape = [num_blocks, heads, block_size] + ([] if scales else [head_dim])
    count = draw(st.integers(0, min(num_blocks, num_cpu_blocks)))
    device_ids = draw(st.permutations(range(num_blocks)))[:count]
    host_ids = draw(st.permutations(range(num_cpu_blocks)))[:count]
    if draw(st.booleans()):  # runs of consecutive ids exercise the merging path
        device_ids, host_ids = sorted(device_ids), sorted(host_ids)
    return dict(
        layers=layers, shape=shape, num_cpu_blocks=num_cpu_blocks, dtype=draw(st.sampled_from(DTYPES)),
        device_ids=list(device_ids), host_ids=list(host_ids), threads=draw(st.sampled_from([1, 2, 3])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _caches(platform, case, rng):
    caches = [platform.empty(case["shape"], case["dtype"]) for _ in range(case["layers"])]
    for c in caches:
        fill_random(platform, c, rng)
    return caches


@FAST
@given(case=copy_case())
def test_all_layers_round_trip_is_bit_exact(cpu, case):
    rng = np.random.default_rng(case["seed"])
    cpu.copy_threads = case["threads"]
    k, v = _caches(cpu, case, rng), _caches(cpu, case, rng)
    block_bytes = cache_bytes(k[0]).shape[1]
    host_k = [cpu.host_alloc(case["num_cpu_blocks"] * block_bytes) for _ in k]
    host_v = [cpu.host_alloc(case["num_cpu_blocks"] * block_bytes) for _ in v]
    hosts = [cpu.host_buffer(p, case["num_cpu_blocks"] * block_bytes).reshape(case["num_cpu_blocks"], -1) for p in host_k + host_v]
    for h in hosts:
        h[:] = rng.integers(0, 256, h.shape, dtype=np.uint8)
    host_before = [h.copy() for h in hosts]
    dev, hst = case["device_ids"], case["host_ids"]

    for caches, ptrs in ((k, host_k), (v, host_v)):
        cpu.swap_cache_all_layers(caches, ptrs, case["num_cpu_blocks"], dev, hst, 0, ops.DEVICE_TO_HOST)
    unlisted_host = np.setdiff1d(np.arange(case["num_cpu_blocks"]), hst)
    for cache, h, before in zip(k + v, hosts, host_before):
        assert np.array_equal(h[hst], cache_bytes(cache)[dev])
        assert np.array_equal(h[unlisted_host], before[unlisted_host])

    expected = [cache_bytes(c) for c in k + v]
    for c in k + v:  # new contents everywhere, then bring the swapped blocks back
        fill_random(cpu, c, rng)
    scrambled = [cache_bytes(c) for c in k + v]
    for caches, ptrs in ((k, host_k), (v, host_v)):
        cpu.swap_cache_all_layers(caches, ptrs, case["num_cpu_blocks"], dev, hst, 0, ops.HOST_TO_DEVICE)
    unlisted_dev = np.setdiff1d(np.arange(case["shape"][0]), dev)
    for cache, want, other in zip(k + v, expected, scrambled):
        got = cache_bytes(cache)
        assert np.array_equal(got[dev], want[dev])
        assert np.array_equal(got[unlisted_dev], other[unlisted_dev])


@FAST
@given(case=copy_case())
def test_layout_round_trip_is_bit_exact(cpu, case):
    rng = np.random.default_rng(case["seed"])
    cpu.copy_threads = case["threads"]
    caches = _caches(cpu, case, rng)
    layers = len(caches)
    block_bytes = cache_bytes(caches[0]).shape[1]
    staging_ptr = cpu.host_alloc(case["num_cpu_blocks"] * layers * block_bytes)
    staging = cpu.host_buffer(staging_ptr, case["num_cpu_blocks"] * layers * block_bytes).reshape(
        case["num_cpu_blocks"], layers, block_bytes
    )
    staging[:] = rng.integers(0, 256, staging.shape, dtype=np.uint8)
    staging_before = staging.copy()
    dev, hst = case["device_ids"], case["host_ids"]

    cpu.swap_cache_layout(caches, staging_ptr, case["shape"], dev, hst, 0, ops.DEVICE_TO_HOST)
    for layer, cache in enumerate(caches):
        assert np.array_equal(staging[hst, layer], cache_bytes(cache)[dev])
    unlisted = np.setdiff1d(np.arange(case["num_cpu_blocks"]), hst)
    assert np.array_equal(staging[unlisted], staging_before[unlisted])

    expected = [cache_bytes(c) for c in caches]
    for c in caches:
        fill_random(cpu, c, rng)
    scrambled = [cache_bytes(c) for c in caches]
    cpu.swap_cache_layout(caches, staging_ptr, case["shape"], dev, hst, 0, ops.HOST_TO_DEVICE)
    unlisted_dev = np.setdiff1d(np.arange(case["shape"][0]), dev)
    for cache, want, other in zip(caches, expected, scrambled):
        got = cache_bytes(cache)
        assert np.array_equal(got[dev], want[dev])
        assert np.array_equal(got[unlisted_dev], other[unlisted_dev])


def test_large_copy_split_across_threads_is_exact(cpu):
    """Big enough that the kernel splits segments between threads mid-block."""
    rng = np.random.default_rng(7)
    shape = [64, 4, 16, 128]  # 16 KiB blocks of bf16, 1 MiB per layer
    caches = [cpu.empty(shape, "bfloat16") for _ in range(4)]
    for c in caches:
        fill_random(cpu, c, rng)
    block_bytes = 4 * 16 * 128 * 2
    hosts = [cpu.host_alloc(64 * block_bytes) for _ in caches]
    dev = rng.permutation(64)[:50]
    hst = np.concatenate([np.arange(10, 40), rng.permutation(np.arange(40, 64))[:20]])
    for threads in (1, 2, 3, 7):
        cpu.copy_threads = threads
        for h in hosts:
            cpu.host_buffer(h, 64 * block_bytes)[:] = 0
        cpu.swap_cache_all_layers(caches, hosts, 64, dev, hst, 0, 0)
        for c, h in zip(caches, hosts):
            view = cpu.host_buffer(h, 64 * block_bytes).reshape(64, -1)
            assert np.array_equal(view[hst], cache_bytes(c)[dev]), f"threads={threads}"


# ---------------------------------------------------------------- bad input

GUARD = 4096


class Guarded:
    """Device caches and host buffers with canary bytes before and after each one."""

    def __init__(self, cpu: CpuPlatform, layers=2, num_blocks=8, num_cpu_blocks=6, block_shape=(2, 4, 8)):
        rng = np.random.default_rng(1)
        self.cpu = cpu
        self.block_bytes = int(np.prod(block_shape)) * 2
        self.shape = [num_blocks, *block_shape]
        self.num_cpu_blocks = num_cpu_blocks
        self.device_raw = []
        self.caches = []
        for _ in range(layers):
            raw = rng.integers(0, 256, GUARD * 2 + num_blocks * self.block_bytes, dtype=np.uint8)
            self.device_raw.append(raw)
            self.caches.append(raw[GUARD:-GUARD].view(np.float16).reshape(self.shape))
        # Host buffers get a leading canary inside the allocation; their end is the
        # allocation's end, which the room check guards.
        host_bytes = num_cpu_blocks * self.block_bytes
        self.host_alloc = [cpu.host_alloc(GUARD + host_bytes) for _ in range(layers)]
        self.host_ptrs = [p + GUARD for p in self.host_alloc]
        self.host_raw = [cpu.host_buffer(p, GUARD + host_bytes) for p in self.host_alloc]
        for h in self.host_raw:
            h[:] = rng.integers(0, 256, h.size, dtype=np.uint8)
        self.staging_alloc = cpu.host_alloc(GUARD + layers * num_cpu_blocks * self.block_bytes)
        self.staging_raw = cpu.host_buffer(self.staging_alloc, GUARD + layers * num_cpu_blocks * self.block_bytes)
        self.staging_raw[:] = rng.integers(0, 256, self.staging_raw.size, dtype=np.uint8)
        self.snapshot = self._all_bytes()

    def _all_bytes(self):
        return [b.copy() for b in self.device_raw + self.host_raw + [self.staging_raw]]

    def assert_untouched(self):
        for before, after in zip(self.snapshot, self._all_bytes()):
            assert np.array_equal(before, after), "a refused copy changed bytes"

    def all_layers(self, dev, hst, mode=0, num_cpu_blocks=None, caches=None, host_ptrs=None):
        self.cpu.swap_cache_all_layers(
            caches if caches is not None else self.caches,
            host_ptrs if host_ptrs is not None else self.host_ptrs,
            self.num_cpu_blocks if num_cpu_blocks is None else num_cpu_blocks, dev, hst, 0, mode,
        )

    def layout(self, dev, hst, mode=0, shape=None, caches=None):
        self.cpu.swap_cache_layout(
            caches if caches is not None else self.caches, self.staging_alloc + GUARD,
            shape or self.shape, dev, hst, 0, mode,
        )


BAD_ALL_LAYERS = [
    ("device block id 8", dict(dev=[8], hst=[0])),
    ("device block id -1", dict(dev=[-1], hst=[0])),
    ("host block id 6", dict(dev=[0], hst=[6])),
    ("host block id -3", dict(dev=[0, 1], hst=[1, -3], mode=1)),
    ("device_block_ids has 2 ids but host_block_ids has 1", dict(dev=[0, 1], hst=[0])),
    ("num_cpu_blocks is 7", dict(dev=[0], hst=[0], num_cpu_blocks=7)),
    ("mode 2", dict(dev=[0], hst=[0], mode=2)),
    ("block id 1.5 is not an integer", dict(dev=[1.5], hst=[0])),
    ("device block id 1180591620717411303424 at position 0 is out of range", dict(dev=[2**70], hst=[0])),
    ("host block id 1180591620717411303424 at position 1 is out of range", dict(dev=[0, 1], hst=[0, 2**70])),
    ("device block id 3 appears more than once", dict(dev=[3, 3], hst=[0, 1], mode=1)),
    ("host block id 2 appears more than once", dict(dev=[0, 1], hst=[2, 2], mode=0)),
]


@pytest.mark.parametrize("message,kwargs", BAD_ALL_LAYERS, ids=[m for m, _ in BAD_ALL_LAYERS])
@pytest.mark.parametrize("mode", [0, 1])
def test_bad_all_layers_input_raises_and_copies_nothing(cpu, message, kwargs, mode):
    g = Guarded(cpu)
    kwargs = {"mode": mode, **kwargs}
    with pytest.raises(ValueError, match=message):
        g.all_layers(**kwargs)
    g.assert_untouched()


BAD_LAYOUT = [
    ("device block id 9", dict(dev=[9], hst=[0])),
    ("host block id 6 at position 0 is out of range", dict(dev=[0], hst=[6])),
    ("cache_shape is \\[8, 2, 4, 4\\]", dict(dev=[0], hst=[0], shape=[8, 2, 4, 4])),
    ("device_block_ids has 0 ids but host_block_ids has 1", dict(dev=[], hst=[0])),
    ("mode -1", dict(dev=[0], hst=[0], mode=-1)),
]


@pytest.mark.parametrize("message,kwargs", BAD_LAYOUT, ids=[m for m, _ in BAD_LAYOUT])
def test_bad_layout_input_raises_and_copies_nothing(cpu, message, kwargs):
    g = Guarded(cpu)
    with pytest.raises(ValueError, match=message):
        g.layout(**kwargs)
    g.assert_untouched()


def test_wrong_dtype_and_shape_mismatch_raise(cpu):
    g = Guarded(cpu)
    mixed = [g.caches[0], g.caches[1].view(np.uint8).reshape(8, 2, 4, 16)]
    with pytest.raises(ValueError, match="caches\\[1\\] has dtype uint8"):
        g.all_layers([0], [0], caches=mixed)
    doubles = [np.zeros((8, 2, 4, 4), dtype=np.float64)] * 2
    with pytest.raises(ValueError, match="float64"):
        g.all_layers([0], [0], caches=doubles)
    short = [g.caches[0], g.caches[1][:, :1].copy()]
    with pytest.raises(ValueError, match="bytes per block"):
        g.all_layers([0], [0], caches=short)
    with pytest.raises(ValueError, match="host_ptrs has 1 pointers"):
        g.all_layers([0], [0], host_ptrs=g.host_ptrs[:1])
    with pytest.raises(ValueError, match="not inside any host_alloc allocation"):
        g.all_layers([0], [0], host_ptrs=[g.host_ptrs[0], 4096])
    g.assert_untouched()


def test_edge_blocks_copy_without_touching_canaries(cpu):
    g = Guarded(cpu)
    last_dev, last_host = g.shape[0] - 1, g.num_cpu_blocks - 1
    g.all_layers([0, last_dev], [last_host, 0], mode=0)
    g.all_layers([0, last_dev], [last_host, 0], mode=1)
    g.layout([last_dev, 0], [0, last_host], mode=0)
    g.layout([last_dev, 0], [0, last_host], mode=1)
    for before, after in zip(g.snapshot, g._all_bytes()):
        assert np.array_equal(before[:GUARD], after[:GUARD])
    for before, after in zip(g.snapshot[: len(g.device_raw)], g._all_bytes()):
        assert np.array_equal(before[-GUARD:], after[-GUARD:])
    h = g.host_raw[0][GUARD:].reshape(g.num_cpu_blocks, -1)
    assert np.array_equal(h[last_host], g.caches[0].view(np.uint8).reshape(g.shape[0], -1)[0])


def test_empty_id_lists_are_a_no_op(cpu):
    g = Guarded(cpu)
    g.all_layers([], [], mode=0)
    g.layout(np.array([], dtype=np.int64), [], mode=1)
    g.assert_untouched()


def test_host_free_of_unknown_pointer_raises(cpu):
    with pytest.raises(ValueError, match="was not returned by host_alloc"):
        cpu.host_free(12345)
    ptr = cpu.cuda_host_alloc(4096)
    cpu.cuda_host_free(ptr)
    with pytest.raises(ValueError, match="freed already"):
        cpu.host_free(ptr)
    with pytest.raises(ValueError, match="host_alloc size 0"):
        cpu.host_alloc(0)


def test_unknown_platform_lists_known_ones():
    with pytest.raises(ValueError, match="unknown platform 'tpu'; known platforms: cpu, npu"):
        ops.get_platform("tpu")


def test_bad_device_id_raises(cpu):
    with pytest.raises(ValueError, match="device_id -1"):
        cpu.set_device(-1)


def test_memory_allocated_counts_device_allocations(cpu):
    before = cpu.memory_allocated()
    t = cpu.empty([4, 2, 4, 8], paddle.bfloat16)
    assert cpu.memory_allocated() - before == 4 * 2 * 4 * 8 * 2
    cpu.free(t)
    assert cpu.memory_allocated() == before
