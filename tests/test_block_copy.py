"""Block copies on the CPU platform: bit-exact round trips, untouched neighbours, refused bad input,
and the kernel's copy-thread pool under concurrent callers, fork and thread-creation failure."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ops
from ops import _block_copy
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


# ---------------------------------------------------------------- the copy-thread pool
#
# These call the kernel directly: layers of uint8 [blocks, block_bytes] numpy arrays, ids
# permuted on both sides.  A copy needs 512 KiB per thread before the kernel hands work to
# the pool's workers, and 4 MiB before it streams its stores.

def _kernel_copy(src, dst, src_ids, dst_ids, threads, bulk=False):
    block_bytes = src[0].shape[1]
    bases = [np.array([a.ctypes.data for a in arrays], dtype=np.int64) for arrays in (src, dst)]
    caps = [np.array([a.shape[0] for a in arrays], dtype=np.int64) for arrays in (src, dst)]
    return _block_copy.copy_blocks(
        bases[0], caps[0], block_bytes, np.ascontiguousarray(src_ids, dtype=np.int64), "src",
        bases[1], caps[1], block_bytes, np.ascontiguousarray(dst_ids, dtype=np.int64), "dst", block_bytes, threads,
        bulk,
    )


class _Job:
    """Source layers of random bytes; each run() copies a random subset of blocks into freshly
    marked destination layers and checks every byte, the untouched blocks included."""

    def __init__(self, rng, layers, blocks, block_bytes):
        self.rng = rng
        self.src = [rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8) for _ in range(layers)]
        self.dst = [np.empty_like(s) for s in self.src]
        self.nbytes = layers * blocks * block_bytes

    def run(self, threads, marker=0, bulk=False):
        blocks = self.src[0].shape[0]
        n = int(self.rng.integers(blocks // 2, blocks + 1))
        src_ids, dst_ids = self.rng.permutation(blocks)[:n], self.rng.permutation(blocks)[:n]
        for d in self.dst:
            d[:] = marker
        _kernel_copy(self.src, self.dst, src_ids, dst_ids, threads, bulk)
        untouched = np.setdiff1d(np.arange(blocks), dst_ids)
        return all(np.array_equal(d[dst_ids], s[src_ids]) and not d[untouched].any() if marker == 0
                   else np.array_equal(d[dst_ids], s[src_ids]) and (d[untouched] == marker).all()
                   for s, d in zip(self.src, self.dst))


BIG = dict(layers=2, blocks=48, block_bytes=64 << 10)  # 6 MiB: up to 12 threads, streaming stores
MEDIUM = dict(layers=1, blocks=32, block_bytes=48 << 10)  # 1.5 MiB: up to 3 threads, plain memcpy
SMALL = dict(layers=3, blocks=16, block_bytes=4 << 10)  # 192 KiB: the caller alone


def _copy_workers():
    """Ids of this process's pool workers, which name themselves ctm-copy."""
    tasks = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == "ctm-copy":
                    tasks.append(task)
        except FileNotFoundError:
            pass
    return tasks


def _cpu_ticks(tasks):
    total = 0
    for task in tasks:
        with open(f"/proc/self/task/{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def test_pool_copies_exactly_with_varying_thread_counts():
    rng = np.random.default_rng(11)
    big, medium, small = _Job(rng, **BIG), _Job(rng, **MEDIUM), _Job(rng, **SMALL)
    for i, threads in enumerate([1, 2, 3, 8, 2, 5, 1, 64, 1000, 0, -3, 4, 2]):
        for job in (big, medium, small):
            assert job.run(threads, marker=i % 256), f"threads={threads}, {job.nbytes} bytes"
    src, dst = big.src[0].reshape(-1), np.zeros(big.src[0].size, dtype=np.uint8)
    for threads in (4, 1, 3):
        dst[:] = 0
        _block_copy.copy_contiguous(dst.ctypes.data, src.ctypes.data, src.size - 64, threads)
        assert np.array_equal(dst[:-64], src[:-64]) and not dst[-64:].any()
    _block_copy.copy_contiguous(dst.ctypes.data, src.ctypes.data, 0, 4)
    assert 1 <= _block_copy.pool_workers() <= 63
    assert len(_copy_workers()) == _block_copy.pool_workers()


def test_bulk_pieces_stream_at_any_size_and_stay_exact():
    """A piece of a far larger transfer (a pieced storage read's scatter) streams its stores
    whatever its own size: odd sizes and unaligned blocks land bit-exact, neighbours untouched."""
    rng = np.random.default_rng(12)
    for block_bytes in (100, 255, 256, 4 << 10, 4100, 48 << 10):
        job = _Job(rng, layers=2, blocks=8, block_bytes=block_bytes)
        for i, threads in enumerate((1, 2, 4)):
            assert job.run(threads, marker=7 + i, bulk=True), f"{block_bytes} bytes per block, threads={threads}"


def test_small_blocks_streamed_four_at_a_time_land_exact_across_chunks_and_alignments():
    """Streamed copies of small blocks go four at a time, a line of each in turn.  Every block
    lands bit-exact whether its group of four sits inside one thread's chunk or straddles two,
    and whether the destination layer is 16-byte aligned (interleaved) or not (one at a time)."""
    rng = np.random.default_rng(21)
    layers, blocks, block_bytes = 4, 512, 4 << 10  # at least 4 MiB per copy: streamed stores
    src = [rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8) for _ in range(layers)]
    raw = [np.empty(blocks * block_bytes + 64, dtype=np.uint8) for _ in range(layers)]
    for shift in (0, 8):  # every layer aligned, then two of them 8 bytes off
        dst = []
        for layer, buf in enumerate(raw):
            start = (-buf.ctypes.data) % 64 + (shift if layer % 2 else 0)
            dst.append(buf[start:start + blocks * block_bytes].reshape(blocks, block_bytes))
        for threads in (1, 2, 3):
            n = int(rng.integers(blocks // 2, blocks + 1)) - int(rng.integers(0, 4))  # groups of 4 and a tail
            src_ids, dst_ids = rng.permutation(blocks)[:n], rng.permutation(blocks)[:n]
            for d in dst:
                d[:] = 0xA5
            _kernel_copy(src, dst, src_ids, dst_ids, threads)
            untouched = np.setdiff1d(np.arange(blocks), dst_ids)
            for layer, (s, d) in enumerate(zip(src, dst)):
                assert np.array_equal(d[dst_ids], s[src_ids]), f"layer {layer}, shift {shift}, threads {threads}"
                assert (d[untouched] == 0xA5).all(), f"layer {layer}: a block outside the copy was written"


def test_concurrent_callers_share_the_pool_and_each_copy_is_exact():
    """Python threads submit big, medium and small copies at once, none holding the GIL while
    it copies; each of them checks every byte of every copy it made."""
    callers, rounds = 6, 25
    barrier = threading.Barrier(callers)
    failures = []

    def caller(index):
        rng = np.random.default_rng(100 + index)
        jobs = [_Job(rng, **BIG), _Job(rng, **MEDIUM), _Job(rng, **SMALL)]
        barrier.wait()
        for r in range(rounds):
            job = jobs[(index + r) % 3]
            threads = [2, 3, 4, 8][(index * 7 + r) % 4]
            if not job.run(threads, marker=(index * rounds + r) % 255 + 1):
                failures.append((index, r, threads, job.nbytes))

    pool = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(callers)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a copy never returned (deadlock in the pool?)"
    assert not failures, f"wrong bytes in (caller, round, threads, bytes): {failures}"


def _wait_child(pid, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def test_forked_child_starts_without_a_pool_and_copies_exactly():
    """Forks while another thread copies through the pool, so the fork can land while the
    pool's lock is held or a job is queued; the child must get a fresh, empty pool."""
    # Two generators: a generator's lock, held by the copying thread at fork time, would stay
    # held in the child for good.
    background, job = _Job(np.random.default_rng(4), **BIG), _Job(np.random.default_rng(5), **BIG)
    assert job.run(4)
    stop, failures = threading.Event(), []

    def keep_copying():
        while not stop.is_set():
            if not background.run(3, marker=7):
                failures.append("parent")

    copier = threading.Thread(target=keep_copying, daemon=True)
    copier.start()
    try:
        for attempt in range(6):
            time.sleep(0.005 * attempt)
            pid = os.fork()
            if pid == 0:  # child: no pytest here, only an exit status
                code = 1
                try:
                    if _block_copy.pool_workers() != 0:
                        code = 2
                    elif not (job.run(4, marker=attempt + 1) and job.run(2) and job.run(8, marker=3)):
                        code = 3
                    elif not 1 <= _block_copy.pool_workers() <= 7:
                        code = 4
                    else:
                        code = 0
                finally:
                    os._exit(code)
            status = _wait_child(pid)
            assert status == 0, {2: "child inherited pool workers", 3: "child copied wrong bytes",
                                 4: "child started no workers", "hung": "child hung"}.get(status, status)
    finally:
        stop.set()
        copier.join(timeout=60)
    assert not copier.is_alive() and not failures
    assert job.run(4, marker=9)  # and the parent's pool still works


_NO_THREADS_CHILD = """
import resource, sys
import numpy as np
from ops import _block_copy
src = np.random.default_rng(9).integers(0, 256, (48, 64 << 10), dtype=np.uint8)
dst = np.zeros_like(src)
ids = np.arange(48, dtype=np.int64)
back = np.ascontiguousarray(ids[::-1])
one = np.array([48], dtype=np.int64)
with open("/proc/self/status") as f:
    vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, ((vm_kib + 128) * 1024, hard))  # less than one worker stack
try:
    _block_copy.copy_blocks(np.array([src.ctypes.data]), one, 64 << 10, ids, "src",
                            np.array([dst.ctypes.data]), one, 64 << 10, back, "dst", 64 << 10, 4)
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
sys.exit(0 if np.array_equal(dst, src[::-1]) and _block_copy.pool_workers() == 0 else
         2 if np.array_equal(dst, src[::-1]) else 3)
"""


def test_copy_falls_back_to_the_caller_when_no_thread_can_start():
    """In a process whose address space cannot take another thread stack, a copy that asks for
    4 threads still completes, on the calling thread alone.  A fresh interpreter, not a fork:
    a forked child inherits the parent's dead threads' stacks, and reuses them."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _NO_THREADS_CHILD], cwd=root, env=env, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == 0, {2: "a worker started despite the limit (the test proves nothing)",
                                  3: "wrong bytes"}.get(proc.returncode, proc.stderr[-2000:])


def test_idle_pool_workers_sleep():
    rng = np.random.default_rng(3)
    job = _Job(rng, **BIG)
    for threads in (2, 4):
        assert job.run(threads)
    time.sleep(0.05)  # past the workers' short spin after a job
    workers = _copy_workers()
    assert workers
    before = _cpu_ticks(workers)
    time.sleep(0.5)
    assert _cpu_ticks(workers) - before <= 2, "idle pool workers used CPU (busy-waiting?)"
