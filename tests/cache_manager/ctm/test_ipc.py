"""Caches and signals shared by name between real processes; nothing leaks, nothing vanishes early."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

from cache_manager.ipc_signal import IPCSignal
from ops.shm import list_segments
from tests.helpers import cache_bytes, fill_random

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHAPE = [8, 2, 4, 16]
BLOCK_BYTES = 2 * 4 * 16 * 2

CHILD = textwrap.dedent(
    """
    import os, sys, numpy as np, paddle
    from ops.cpu import CpuPlatform
    from cache_manager.ipc_signal import IPCSignal
    instance, suffix, how = sys.argv[1], sys.argv[2], sys.argv[3]
    p = CpuPlatform(instance=instance)
    cache = p.share_external_data_(paddle.empty([], dtype="bfloat16"), "key_caches_0_rank1.device0", %r)
    ready = IPCSignal("cache_ready_signal", np.zeros(2, np.int32), suffix=suffix)
    host = p.host_alloc(%d)
    p.host_buffer(host, %d)[:] = 0xAB
    p.swap_cache_all_layers([cache], [host], 1, [2], [0], 0, 1)   # host -> device block 2
    ready.value[1] = 7
    if how == "crash":
        os.kill(os.getpid(), 9)
    ready.clear()          # an attached process must not unlink
    p.unset_data_ipc(cache, "key_caches_0_rank1.device0", True, False)
    """
) % (SHAPE, BLOCK_BYTES, BLOCK_BYTES)


def run_child(instance: str, suffix: str, how: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-c", CHILD, instance, suffix, how], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("how", ["exit", "crash"])
def test_child_attaches_writes_and_leaves_segments_alive(cpu, how):
    rng = np.random.default_rng(3)
    suffix = f"{os.getpid()}{how}"
    cache = cpu.empty(SHAPE, "bfloat16")
    fill_random(cpu, cache, rng)
    before = cache_bytes(cache)
    cpu.set_data_ipc(cache, "key_caches_0_rank1.device0")
    ready = IPCSignal("cache_ready_signal", np.zeros(2, np.int32), suffix=suffix, create=True)
    names = set(list_segments(cpu.segment_prefix)) | {ready.segment_name}

    result = run_child(cpu.instance, suffix, how)
    if how == "exit":
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode == -signal.SIGKILL, result.stderr

    after = cache_bytes(cache)
    assert np.all(after[2] == 0xAB)
    assert np.array_equal(np.delete(after, 2, axis=0), np.delete(before, 2, axis=0))
    assert ready.value.tolist() == [0, 7]
    present = set(os.listdir("/dev/shm"))
    assert names <= present, f"segments vanished after the child exited: {names - present}"

    cpu.unset_data_ipc(None, "key_caches_0_rank1.device0", close_ipc=False, unlink_shm=True)
    cpu.free(cache)
    ready.clear()
    present = set(os.listdir("/dev/shm"))
    assert not (names & present), f"segments left after teardown: {names & present}"


def test_attach_checks_shape_dtype_and_name(cpu):
    cache = cpu.empty(SHAPE, "float16")
    cpu.set_data_ipc(cache, "value_caches_3_rank0.device0")
    with pytest.raises(FileExistsError):
        cpu.set_data_ipc(cache, "value_caches_3_rank0.device0")
    with pytest.raises(ValueError, match="exported as float16, attached as bfloat16"):
        cpu.share_external_data_(paddle.empty([], dtype="bfloat16"), "value_caches_3_rank0.device0", SHAPE)
    with pytest.raises(ValueError, match="needs 4096 bytes"):
        cpu.share_external_data_(paddle.empty([], dtype="float16"), "value_caches_3_rank0.device0", [16, 2, 4, 16])
    with pytest.raises(FileNotFoundError, match="no cache exported as 'nope'"):
        cpu.share_external_data_(paddle.empty([], dtype="float16"), "nope", SHAPE)
    attached = cpu.share_external_data_(paddle.empty([], dtype="float16"), "value_caches_3_rank0.device0", SHAPE)
    assert attached.data_ptr() != cache.data_ptr()  # a second mapping of the same bytes
    fill_random(cpu, cache, np.random.default_rng(0))
    assert np.array_equal(cache_bytes(attached), cache_bytes(cache))
    cpu.unset_data_ipc(attached, "value_caches_3_rank0.device0", True, True)
    cpu.free(cache)


def test_signal_attach_checks_size_and_existence():
    suffix = f"{os.getpid()}sz"
    sig = IPCSignal("swap_space_ready_signal", np.zeros(4, np.int32), suffix=suffix, create=True)
    try:
        with pytest.raises(ValueError, match="holds 16 bytes"):
            IPCSignal("swap_space_ready_signal", np.zeros(2, np.int32), suffix=suffix)
        other = IPCSignal("swap_space_ready_signal", np.zeros(4, np.int32), suffix=suffix)
        other.value[3] = 5
        assert sig.value[3] == 5
        other.clear()  # not the creator: only detaches
        assert sig.segment_name in os.listdir("/dev/shm")
    finally:
        sig.clear()
    assert sig.segment_name not in os.listdir("/dev/shm")
    with pytest.raises(FileNotFoundError):
        IPCSignal("swap_space_ready_signal", np.zeros(4, np.int32), suffix=suffix)
    with pytest.raises(ValueError, match="must be 1-200 characters"):
        IPCSignal("bad/name", np.zeros(1, np.int32), create=True)


def test_attach_refuses_a_segment_owned_by_another_user():
    from ops.shm import SharedMemorySegment

    name = f"ctm.t{os.getpid()}.foreign"
    seg = SharedMemorySegment(name, 4096, create=True)
    try:
        os.chown(seg.path, 65534, 65534)  # as root: hand it to "nobody"
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            SharedMemorySegment(name)
        os.chown(seg.path, os.getuid(), os.getgid())
        SharedMemorySegment(name).close()  # its owner's again: attaches
    finally:
        seg.unlink()
        seg.close()
