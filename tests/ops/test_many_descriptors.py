"""An engine process with more than 1,024 open descriptors (issue 35: a 61-layer model at TP 8).

``select()`` refuses a descriptor numbered past FD_SETSIZE (1024): the supervisor then failed every
iteration and no task deadline fired.  The waits are poll(2) now, and a mapped segment holds no
descriptor (Python's ``mmap.mmap`` kept a dup() of each), so the count stays far below anyway.
"""
from __future__ import annotations

import os
import resource
import signal
import time

import paddle
import pytest

from engine_hooks import TaskTimeoutError
from ops.procs import ProcessWatch, wait_readable
from ops.shm import SharedMemorySegment, unlink_segments
from tests.service_helpers import process_gone, start_service

FD_SETSIZE = 1024
HELD = 1100  # descriptors opened first, so that every later one is numbered past FD_SETSIZE
SWAP_TIMEOUT = 3.0
SLACK = 2.5  # past the swap's own timeout, for the supervisor's wake-up and a loaded CI machine


def _fds() -> list[str]:
    """What this process's descriptors point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the descriptor listdir itself used
    return out


def _shm_fds() -> int:
    return sum(target.startswith("/dev/shm/") for target in _fds())


@pytest.fixture
def many_descriptors():
    """``HELD`` descriptors open on /dev/null (the soft RLIMIT_NOFILE raised to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}: too low to open {HELD} descriptors and run a service")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[int] = []
    try:
        while len(held) < HELD:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        yield held
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_mapped_segment_holds_no_descriptor():
    prefix = f"ctm-fdtest{os.getpid()}."
    before = len(_fds())
    created = [SharedMemorySegment(f"{prefix}{i}", 4096 * (i + 1), create=True) for i in range(16)]
    attached = [SharedMemorySegment(s.name) for s in created]
    try:
        assert len(_fds()) == before, "a mapped segment keeps a descriptor open"
        created[3].buf[:4] = b"ctm!"
        assert bytes(attached[3].buf[:4]) == b"ctm!"
    finally:
        for s in created + attached:
            s.close()
        assert unlink_segments(prefix) == sorted(s.name for s in created)


def test_cpu_device_caches_and_their_attachments_hold_no_descriptor(cpu):
    before = _shm_fds()
    caches = []
    for layer in range(8):
        tensor = cpu.empty([16, 2, 4, 8], "bfloat16")
        cpu.set_data_ipc(tensor, f"key_caches_{layer}_rank0.device0")
        caches.append(tensor)
        caches.append(cpu.share_external_data_(paddle.empty([], dtype="bfloat16"), f"key_caches_{layer}_rank0.device0",
                                               [16, 2, 4, 8]))
    try:
        assert _shm_fds() == before
    finally:
        for tensor in caches:
            cpu.free(tensor)
        for layer in range(8):
            cpu.unset_data_ipc(None, f"key_caches_{layer}_rank0.device0", close_ipc=False, unlink_shm=True)


def test_waits_take_descriptors_past_fd_setsize(many_descriptors):
    r, w = os.pipe()
    try:
        assert r > FD_SETSIZE
        t0 = time.monotonic()
        assert wait_readable([r], 0.05) == set()
        assert time.monotonic() - t0 >= 0.05  # rounded up to poll's milliseconds, never early
        os.write(w, b"x")
        assert wait_readable([r], 5.0) == {r}
        os.close(w)
        w = -1
        os.read(r, 1)
        assert wait_readable([r], 5.0) == {r}  # hung up counts as ready
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    watch = ProcessWatch(pid)
    try:
        deadline = time.monotonic() + 10
        while not watch.gone() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.gone()
    finally:
        watch.close()
        os.waitpid(pid, 0)


def test_a_task_deadline_fires_with_descriptors_past_fd_setsize(many_descriptors):
    """The fault of issue 35: a swap with a 3 s timeout against a SIGSTOPped rank ran into the caller's
    own timeout, the supervisor failing on every iteration."""
    svc = start_service()
    stopped = None
    try:
        assert svc.swap_to_cpu([4], [5]).result(timeout=20)
        assert _shm_fds() == 0, "the engine process holds a descriptor per mapped segment"
        stopped = svc.pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        future = svc.swap_to_gpu([6], [5], timeout=SWAP_TIMEOUT)
        with pytest.raises(TaskTimeoutError) as err:
            future.result(timeout=SWAP_TIMEOUT + 10)
        elapsed = time.monotonic() - t0
        assert err.value.missing_ranks == [1]
        assert "no answer from ranks [1]" in str(err.value)
        assert elapsed < SWAP_TIMEOUT + SLACK, f"the deadline fired {elapsed:.1f}s after submission"
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        assert svc.swap_to_gpu([6], [5]).result(timeout=20)  # and the rank serves on
        assert svc.supervisor_errors == 0
    finally:
        if stopped is not None and not process_gone(stopped):
            os.kill(stopped, signal.SIGCONT)
        svc.shutdown()
