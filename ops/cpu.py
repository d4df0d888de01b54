"""The CPU platform, the embedded default: "device" memory is POSIX shared memory.

Each device allocation is one shared-memory segment viewed as a paddle CPU tensor
without a copy.  ``set_data_ipc`` publishes a small handle segment under the
exported name (like a CUDA IPC handle); ``share_external_data_`` reads it and maps
the data segment.  Segment names carry the engine's instance id, so two engines on
one host never collide: ``ctm.<instance>.<name>``.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import _block_copy
from .dtypes import CacheDtype, cache_dtype
from .layout import CopyPlan, HostAllocations, check_mode, orient, plain_int_list, tensor_info
from .modes import DEVICE_TO_HOST
from .platform import BlockIds, Platform
from .shm import SharedMemorySegment

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "ctm."
# magic, format version, data segment name, offset, nbytes, dtype name
_HANDLE = struct.Struct("<8sI200sQQ16s")
_HANDLE_MAGIC = b"CTMIPC\x00\x01"
_HANDLE_VERSION = 1


def default_copy_threads() -> int:
    env = os.environ.get("CTM_COPY_THREADS")
    if env:
        n = int(env)
        if n < 1:
            raise ValueError(f"CTM_COPY_THREADS={env!r} must be a positive integer")
        return n
    return max(1, min(8, len(os.sched_getaffinity(0))))


@dataclass
class _DeviceAllocation:
    segment: SharedMemorySegment
    owned: bool  # allocated here (free unlinks) rather than attached


def _as_tensor(segment: SharedMemorySegment, offset: int, shape: Sequence[int], dtype: CacheDtype):
    import paddle

    count = math.prod(shape)
    array = np.frombuffer(segment.buf, dtype=dtype.numpy_storage, count=count, offset=offset).reshape(shape)
    tensor = paddle.from_dlpack(array)
    if dtype.name == "bfloat16":
        tensor = tensor.view(paddle.bfloat16)
    return tensor


class CpuPlatform(Platform):
    """Shared memory as device memory; the C kernel moves blocks."""

    name = "cpu"
    host_addressable = True
    copies_cannot_stall = True
    digests_copies = True
    takes_instance = True
    exports_device_memory = True

    def __init__(self, instance: str | None = None, copy_threads: int | None = None):
        self.instance = instance or os.environ.get("CTM_INSTANCE", "0")
        self.copy_threads = copy_threads or default_copy_threads()
        self.device_id = 0
        self._hosts = HostAllocations()
        self._device: dict[int, _DeviceAllocation] = {}  # data_ptr -> allocation
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._attached: dict[str, tuple[int, int]] = {}  # name -> identity of each segment attached here

    # -- names -------------------------------------------------------------
    def segment_name(self, name: str) -> str:
        return f"{SEGMENT_PREFIX}{self.instance}.{name}"

    @property
    def segment_prefix(self) -> str:
        """Every segment this platform instance creates starts with this."""
        return f"{SEGMENT_PREFIX}{self.instance}."

    # -- device ------------------------------------------------------------
    def set_device(self, device_id: int) -> None:
        if not isinstance(device_id, (int, np.integer)) or isinstance(device_id, bool) or device_id < 0:
            raise ValueError(f"device_id {device_id!r} must be a non-negative integer")
        self.device_id = int(device_id)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        shape = [int(d) for d in shape]
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"shape {shape} must have positive dimensions")
        dt = cache_dtype(dtype)
        name = self.segment_name(f"dev{os.getpid()}-{next(self._counter)}")
        segment = SharedMemorySegment(name, math.prod(shape) * dt.itemsize, create=True)
        tensor = _as_tensor(segment, 0, shape, dt)
        with self._lock:
            self._device[int(tensor.data_ptr())] = _DeviceAllocation(segment, owned=True)
        return tensor

    def free(self, tensor: Any) -> None:
        ptr = int(tensor.data_ptr())
        with self._lock:
            alloc = self._device.pop(ptr, None)
        if alloc is None:
            raise ValueError(f"tensor at {ptr:#x} was not allocated by empty() or attached here")
        if alloc.owned:
            alloc.segment.unlink()
        alloc.segment.close()

    def _allocation_of(self, ptr: int) -> tuple[_DeviceAllocation, int]:
        with self._lock:
            for base, alloc in self._device.items():
                if base <= ptr < base + alloc.segment.size:
                    return alloc, ptr - base
        raise ValueError(f"tensor at {ptr:#x} is not device memory of this platform (use empty())")

    def raw_view(self, tensor: Any) -> np.ndarray:
        """A writable uint8 ``[num_blocks, block_bytes]`` view of a device tensor's bytes (no copy)."""
        info = tensor_info(tensor, "tensor")
        alloc, offset = self._allocation_of(info.ptr)
        view = np.frombuffer(alloc.segment.buf, dtype=np.uint8, count=info.nbytes, offset=offset)
        return view.reshape(info.shape[0], -1)

    def read_bytes(self, tensor: Any) -> np.ndarray:
        """A host copy of a device cache's bytes, ``[num_blocks, block_bytes]``."""
        return self.raw_view(tensor).copy()

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """Overwrite a device cache with ``data`` (its exact size in bytes)."""
        view = self.raw_view(tensor)
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if data.nbytes != view.nbytes:
            raise ValueError(f"write_bytes: {data.nbytes} bytes for a cache of {view.nbytes}")
        view.reshape(-1)[:] = data.reshape(-1)

    def exported_region(self, tensor: Any) -> tuple[str, int, int]:
        """(shared-memory name, offset, bytes) of a device tensor's memory, for a peer instance's
        rank on this host to map (``transfer_factory.peer.ipc``)."""
        info = tensor_info(tensor, "tensor")
        alloc, offset = self._allocation_of(info.ptr)
        return alloc.segment.name, offset, info.nbytes

    # -- IPC ---------------------------------------------------------------
    def set_data_ipc(self, tensor: Any, name: str) -> None:
        info = tensor_info(tensor, f"tensor exported as {name!r}")
        alloc, offset = self._allocation_of(info.ptr)
        record = _HANDLE.pack(
            _HANDLE_MAGIC,
            _HANDLE_VERSION,
            alloc.segment.name.encode(),
            offset,
            info.nbytes,
            info.dtype.name.encode(),
        )
        handle = SharedMemorySegment(self.segment_name(name), _HANDLE.size, create=True)
        handle.buf[: _HANDLE.size] = record
        handle.close()

    def _read_handle(self, name: str) -> tuple[str, int, int, str]:
        try:
            handle = SharedMemorySegment(self.segment_name(name))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no cache exported as {name!r} (segment {self.segment_name(name)} is missing)"
            ) from None
        try:
            raw = bytes(handle.buf[: _HANDLE.size])
        finally:
            handle.close()
        self._note_attached(handle)
        magic, version, seg, offset, nbytes, dtype = _HANDLE.unpack(raw)
        if magic != _HANDLE_MAGIC or version != _HANDLE_VERSION:
            raise ValueError(f"segment {self.segment_name(name)} is not a cache IPC handle")
        return seg.rstrip(b"\0").decode(), offset, nbytes, dtype.rstrip(b"\0").decode()

    def share_external_data_(self, tensor: Any, name: str, shape: Sequence[int], use_ipc: bool = True) -> Any:
        dt = cache_dtype(tensor.dtype)
        shape = [int(d) for d in shape]
        data_name, offset, nbytes, exported_dtype = self._read_handle(name)
        if exported_dtype != dt.name:
            raise ValueError(f"cache {name!r} was exported as {exported_dtype}, attached as {dt.name}")
        want = math.prod(shape) * dt.itemsize
        if want != nbytes:
            raise ValueError(
                f"cache {name!r} holds {nbytes} bytes; shape {shape} of {dt.name} needs {want} bytes"
            )
        segment = SharedMemorySegment(data_name)
        self._note_attached(segment)
        if offset + nbytes > segment.size:
            segment.close()
            raise ValueError(f"cache {name!r}: handle points past the end of {data_name}")
        attached = _as_tensor(segment, offset, shape, dt)
        with self._lock:
            self._device[int(attached.data_ptr())] = _DeviceAllocation(segment, owned=False)
        return attached

    def _note_attached(self, segment: SharedMemorySegment) -> None:
        with self._lock:
            self._attached[segment.name] = segment.identity

    def attached_segments(self) -> dict[str, tuple[int, int]]:
        """Every segment attached here (IPC handles and the caches' memory), with the file attached."""
        with self._lock:
            return dict(self._attached)

    def unset_data_ipc(self, tensor: Any, name: str, close_ipc: bool = True, unlink_shm: bool = False) -> None:
        if unlink_shm:
            SharedMemorySegment.unlink_name(self.segment_name(name))
        if close_ipc and tensor is not None:
            ptr = int(tensor.data_ptr())
            with self._lock:
                alloc = self._device.get(ptr)
                if alloc is not None and not alloc.owned:
                    del self._device[ptr]
                else:
                    alloc = None
            if alloc is not None:
                alloc.segment.close()

    # -- host --------------------------------------------------------------
    def host_alloc(self, nbytes: int) -> int:
        if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"host_alloc size {nbytes!r} must be a positive integer")
        ptr = _block_copy.host_alloc(int(nbytes))
        self._hosts.add(ptr, int(nbytes))
        return ptr

    def host_free(self, ptr: int) -> None:
        nbytes = self._hosts.pop(ptr)
        _block_copy.host_free(ptr, nbytes)

    # -- copies ------------------------------------------------------------
    @property
    def host_allocations(self) -> HostAllocations:
        return self._hosts

    def run_plan(self, plan: CopyPlan, device_ids: BlockIds, host_ids: BlockIds, mode: int,
                 bulk: bool = False) -> int:
        mode = check_mode(mode)
        if plain_int_list(device_ids) and plain_int_list(host_ids) and len(device_ids) == len(host_ids):
            # A task's ids as the queue brings them: the kernel takes the lists as they are and
            # checks lengths, ranges and duplicates itself (orient's arrays cost more than a
            # small task's copy).
            src, dst = (plan.device, plan.host) if mode == DEVICE_TO_HOST else (plan.host, plan.device)
            src_ids, dst_ids = (device_ids, host_ids) if mode == DEVICE_TO_HOST else (host_ids, device_ids)
        else:
            c = orient(plan, device_ids, host_ids, mode)  # the kernel checks ranges and duplicates itself
            src, dst, src_ids, dst_ids = c.src, c.dst, c.src_ids, c.dst_ids
        # A bulk piece (a pieced storage read's scatter) is copied by its caller alone: pieces
        # come one after another from a thread that is already one of the busy ones, and waking
        # pool workers for each piece cost more than they saved (128 MiB file reads at TP=2 on
        # 2 cores: 6.3-6.4 GB/s with 2 copy threads, 6.5-7.0 GB/s with the caller alone).
        return _block_copy.copy_blocks(
            src.bases, src.capacities, src.stride, src_ids, src.name,
            dst.bases, dst.capacities, dst.stride, dst_ids, dst.name,
            plan.block_bytes, 1 if bulk else self.copy_threads, bulk,
        )

    def run_plan_digested(self, plan: CopyPlan, device_ids: BlockIds, host_ids: BlockIds, mode: int, xxh3: int,
                          out: np.ndarray) -> None:
        """``run_plan``, one block at a time, each destination block hashed right after it was
        stored: ``out`` (uint64 or int64, layers x blocks) gets XXH3-64 of every block written;
        ``xxh3`` is the bound XXH3's address (``transfer_factory.file._records.xxh3_address``)."""
        c = orient(plan, device_ids, host_ids, check_mode(mode))
        _block_copy.copy_blocks_digest(c.src.bases, c.src.capacities, c.src.stride, c.src_ids, c.src.name,
                                       c.dst.bases, c.dst.capacities, c.dst.stride, c.dst_ids, c.dst.name,
                                       plan.block_bytes, self.copy_threads, int(xxh3), out)

    def memory_allocated(self, device_id: int | None = None) -> int:
        with self._lock:
            return sum(a.segment.size for a in self._device.values() if a.owned)
