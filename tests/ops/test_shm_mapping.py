"""A segment's mapping (``ops.shm.map_shared``): mmap(2) without a descriptor, and its lifetime.

``close()`` unmaps at once unless arrays or tensors still view the memory; then the mapping stays
readable through them and goes with the last of them.
"""
from __future__ import annotations

import errno
import gc
import os

import numpy as np
import pytest

from ops.shm import SharedMemorySegment, map_shared, unlink_segments


def _mapped(name: str) -> int:
    """How many of this process's mappings are of the /dev/shm file ``name`` (unlinked or not)."""
    with open("/proc/self/maps") as f:
        return sum(line.split()[-1] == f"/dev/shm/{name}" or f"/dev/shm/{name} (deleted)" in line for line in f)


@pytest.fixture
def name():
    prefix = f"ctm-maptest{os.getpid()}."
    yield f"{prefix}seg"
    unlink_segments(prefix)


def test_buf_reads_writes_and_closes(name):
    seg = SharedMemorySegment(name, 8192, create=True)
    other = SharedMemorySegment(name)
    try:
        assert len(seg.buf) == 8192 and not seg.buf.readonly
        assert bytes(seg.buf[:4]) == b"\0\0\0\0"  # zero-filled
        seg.buf[:5] = b"hello"
        assert bytes(other.buf[:5]) == b"hello"  # shared
        np.frombuffer(other.buf, dtype=np.uint8, count=2, offset=8190)[:] = 7
        assert bytes(seg.buf[8190:]) == b"\x07\x07"
        assert np.ndarray((1,), np.uint32, buffer=seg.buf)[0] == int.from_bytes(b"hell", "little")
    finally:
        seg.close()
        other.close()
    assert _mapped(name) == 0
    with pytest.raises(ValueError, match="closed"):
        seg.buf
    seg.close()  # idempotent
    seg.unlink()


def test_an_array_outlives_close_and_the_mapping_goes_with_it(name):
    seg = SharedMemorySegment(name, 4096, create=True)
    seg.buf[:3] = b"abc"
    array = np.frombuffer(seg.buf, dtype=np.uint8, count=3)
    grid = np.ndarray((2, 2), np.int32, buffer=seg.buf)
    seg.close()
    seg.unlink()
    assert _mapped(name) == 1
    assert bytes(array) == b"abc"  # still readable, and writable
    grid[1, 1] = 5
    del array
    gc.collect()
    assert _mapped(name) == 1 and grid[1, 1] == 5
    del grid
    gc.collect()
    assert _mapped(name) == 0


def test_a_paddle_tensor_keeps_a_freed_cache_mapped(cpu):
    tensor = cpu.empty([4, 16], "float32")
    segment = cpu._device[int(tensor.data_ptr())].segment.name
    cpu.raw_view(tensor)[:] = np.full(16, 1.5, np.float32).view(np.uint8)  # each row of 16 floats
    cpu.free(tensor)  # unlinked and closed while the tensor still views it
    assert _mapped(segment) == 1
    assert float(tensor.sum()) == 4 * 16 * 1.5
    del tensor
    gc.collect()
    assert _mapped(segment) == 0


def test_a_failed_mmap_raises_oserror_with_its_errno(name):
    seg = SharedMemorySegment(name, 4096, create=True)
    seg.close()
    fd = os.open(seg.path, os.O_RDONLY)  # a shared writable mapping of a read-only descriptor: EACCES
    try:
        with pytest.raises(OSError) as err:
            map_shared(fd, 4096)
        assert err.value.errno == errno.EACCES
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        map_shared(-1, 4096)
    assert err.value.errno == errno.EBADF
    seg.unlink()
