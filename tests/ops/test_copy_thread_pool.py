"""The block-copy kernel's copy-thread pool: exact copies at any thread count and size, concurrent
callers sharing the pool, a forked child starting without one, the fallback to the calling thread
when no thread can start, and idle workers that sleep."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from ops import _block_copy


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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
