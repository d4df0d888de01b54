"""``acl.rt`` of the pyACL stand-in (tests only): devices, memory, copies, streams, IPC.

Every function returns pyACL's way: ``ret`` or ``(value, ret)``, ``ret`` 0 = ACL_SUCCESS.  See the
package docstring (``acl.__doc__``) for the contract each one enforces and the codes it returns.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from ._batch import MEM_LOC_DEVICE, MEM_LOC_HOST, MemcpyBatchAttr, memcpy_batch_async
from ._copy import KIND_LOCATIONS, check_copy, execute, is_int, run_task
from ._errors import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    ACL_ERROR_RT_INVALID_DEVICEID,
    ACL_ERROR_RT_INVALID_HANDLE,
    ACL_ERROR_RT_MEMORY_ALLOCATION,
    ACL_ERROR_RT_MEMORY_FREE,
    ACL_ERROR_RT_PARAM_INVALID,
    ACL_SUCCESS,
)
from ._ipc import (
    ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT,
    ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
    ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT,
    ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS,
    ipc_mem_close,
    ipc_mem_get_export_key,
    ipc_mem_import_by_key,
    ipc_mem_set_import_pid,
)
from ._local import Copy, Local, Region, Stream, api, knobs, local
from ._shared import DEVICE_PAGE, POISON, device_base, round_up

__all__ = [
    "ACL_MEMCPY_HOST_TO_HOST", "ACL_MEMCPY_HOST_TO_DEVICE", "ACL_MEMCPY_DEVICE_TO_HOST", "ACL_MEMCPY_DEVICE_TO_DEVICE",
    "ACL_MEM_MALLOC_HUGE_FIRST", "ACL_MEM_MALLOC_HUGE_ONLY", "ACL_MEM_MALLOC_NORMAL_ONLY",
    "ACL_MEM_MALLOC_HUGE_FIRST_P2P", "ACL_MEM_MALLOC_HUGE_ONLY_P2P", "ACL_MEM_MALLOC_NORMAL_ONLY_P2P",
    "ACL_MEM_MALLOC_HUGE1G_ONLY", "ACL_MEM_MALLOC_HUGE1G_ONLY_P2P",
    "ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT", "ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION",
    "ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT", "ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS",
    "MEM_LOC_HOST", "MEM_LOC_DEVICE", "MemcpyBatchAttr",
    "set_device", "reset_device", "get_device", "get_device_count", "device_get_bare_tgid",
    "malloc", "free", "malloc_host", "free_host", "memcpy", "memcpy_async", "memcpy_batch_async",
    "create_stream", "destroy_stream", "synchronize_stream", "synchronize_device",
    "ipc_mem_get_export_key", "ipc_mem_set_import_pid", "ipc_mem_import_by_key", "ipc_mem_close",
]

ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3

# aclrtMemMallocPolicy (acl_rt.h); the stand-in accepts these and treats them alike
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEM_MALLOC_HUGE_ONLY = 1
ACL_MEM_MALLOC_NORMAL_ONLY = 2
ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3
ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4
ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5
ACL_MEM_MALLOC_HUGE1G_ONLY = 6
ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7
_POLICIES = range(8)

# -- devices -------------------------------------------------------------------------
@api("set_device", needs_context=False)
def set_device(device_id: int) -> int:
    state = local()
    if not is_int(device_id):
        return ACL_ERROR_INVALID_PARAM
    shared = state.shared()
    if not 0 <= device_id < shared.config()[1]:
        return ACL_ERROR_RT_INVALID_DEVICEID
    shared.fd(device_id)
    state.tls.device = device_id
    return ACL_SUCCESS


@api("reset_device", needs_context=False)
def reset_device(device_id: int) -> int:
    state = local()
    if not is_int(device_id):
        return ACL_ERROR_INVALID_PARAM
    if not 0 <= device_id < state.shared().config()[1]:
        return ACL_ERROR_RT_INVALID_DEVICEID
    if state.device() == device_id:
        del state.tls.device
    return ACL_SUCCESS


@api("get_device", on_error=lambda ret: (-1, ret))
def get_device() -> tuple[int, int]:
    return local().device(), ACL_SUCCESS  # type: ignore[return-value]


@api("get_device_count", on_error=lambda ret: (0, ret), needs_context=False)
def get_device_count() -> tuple[int, int]:
    return local().shared().config()[1], ACL_SUCCESS


@api("device_get_bare_tgid", on_error=lambda ret: (0, ret), needs_context=False)
def device_get_bare_tgid() -> tuple[int, int]:
    return os.getpid(), ACL_SUCCESS


# -- device memory -------------------------------------------------------------------
@api("malloc", on_error=lambda ret: (0, ret))
def malloc(size: int, policy: int) -> tuple[int, int]:
    if not is_int(size) or size <= 0 or not is_int(policy) or policy not in _POLICIES:
        return 0, ACL_ERROR_INVALID_PARAM
    state = local()
    dev, shared = state.device(), state.shared()
    assert dev is not None
    nbytes = round_up(size, DEVICE_PAGE)
    with shared.table() as table:
        off = shared.allocate(table, dev, nbytes, state.pid)
    if off is None:
        return 0, ACL_ERROR_RT_MEMORY_ALLOCATION
    if knobs().get("poison", True):
        shared.fill(dev, off, nbytes, POISON)
    region = Region(device_base(dev) + off, size, dev, off)
    state.add_region(region)
    return region.start, ACL_SUCCESS


@api("free")
def free(dev_ptr: int) -> int:
    if not is_int(dev_ptr):
        return ACL_ERROR_INVALID_PARAM
    state = local()
    region = state.regions.get(dev_ptr)
    if region is None or region.key is not None:  # not an allocation's start (imports close instead)
        return ACL_ERROR_RT_PARAM_INVALID
    with state.shared().table() as table:
        if any(e["dev"] == region.dev and e["alloc_off"] == region.file_off for e in table["exports"].values()):
            return ACL_ERROR_RT_MEMORY_FREE  # an export is still open: ipc_mem_close it first
        table["allocs"] = [a for a in table["allocs"] if (a["dev"], a["off"]) != (region.dev, region.file_off)]
    state.remove_region(region)
    return ACL_SUCCESS


# -- pinned host memory --------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


@api("malloc_host", on_error=lambda ret: (0, ret))
def malloc_host(size: int) -> tuple[int, int]:
    if not is_int(size) or size <= 0:
        return 0, ACL_ERROR_INVALID_PARAM
    ptr = _libc.mmap(None, round_up(size, mmap.PAGESIZE), mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if ptr is None or ptr == _MAP_FAILED:
        return 0, ACL_ERROR_RT_MEMORY_ALLOCATION
    local().add_host(ptr, size)
    return ptr, ACL_SUCCESS


@api("free_host", needs_context=False)
def free_host(ptr: int) -> int:
    if not is_int(ptr):
        return ACL_ERROR_INVALID_PARAM
    state = local()
    size = state.hosts.get(ptr)
    if size is None:
        return ACL_ERROR_RT_PARAM_INVALID
    state.remove_host(ptr)
    _libc.munmap(ptr, round_up(size, mmap.PAGESIZE))
    return ACL_SUCCESS


# -- copies --------------------------------------------------------------------------
def _copy_args(dest_max: Any, count: Any, kind: Any) -> int:
    if not (is_int(dest_max) and is_int(count) and is_int(kind)) or dest_max < 0 or count < 0:
        return ACL_ERROR_INVALID_PARAM
    if kind not in KIND_LOCATIONS or count > dest_max:
        return ACL_ERROR_INVALID_PARAM
    return ACL_SUCCESS


@api("memcpy")
def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    code = _copy_args(dest_max, count, kind)
    if code:
        return code
    state = local()
    dst_loc, src_loc = KIND_LOCATIONS[kind]
    checked = check_copy(state, Copy(dst, dst_loc, src, src_loc, count), state.device(), pinned_only=False)  # type: ignore[arg-type]
    if isinstance(checked, int):
        return checked
    execute(state.shared(), checked[0], checked[1], count)
    return ACL_SUCCESS


@api("memcpy_async")
def memcpy_async(dst: int, dest_max: int, src: int, count: int, kind: int, stream: int) -> int:
    code = _copy_args(dest_max, count, kind)
    if code:
        return code
    if kind == ACL_MEMCPY_HOST_TO_HOST:
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT  # documented: no asynchronous host-to-host copy
    state = local()
    target = state.queue_stream(stream)
    if isinstance(target, int):
        return target
    dst_loc, src_loc = KIND_LOCATIONS[kind]
    copy = Copy(dst, dst_loc, src, src_loc, count)
    checked = check_copy(state, copy, target.dev, pinned_only=True)
    if isinstance(checked, int):
        return checked
    with target.lock:
        target.tasks.append([copy])
    return ACL_SUCCESS


# -- streams -------------------------------------------------------------------------
def _drain(state: Local, stream: Stream) -> int:
    """Run a stream's queued copies in order; the first failure drops the rest and is returned."""
    with stream.lock:
        tasks, stream.tasks = stream.tasks, []
        shared = state.shared()
        for copies in tasks:
            code = run_task(state, shared, copies, stream.dev)
            if code:
                return code
    return ACL_SUCCESS


@api("create_stream", on_error=lambda ret: (0, ret))
def create_stream() -> tuple[int, int]:
    state = local()
    return state.new_stream(state.device()).handle, ACL_SUCCESS  # type: ignore[arg-type]


@api("destroy_stream")
def destroy_stream(stream: int) -> int:
    """Runs what is still queued first (as CANN >= 8 documents), then forgets the handle."""
    state = local()
    target = state.streams.get(stream) if is_int(stream) else None
    if target is None:
        return ACL_ERROR_RT_INVALID_HANDLE
    code = _drain(state, target)
    with state.lock:
        state.streams.pop(stream, None)
    return code


@api("synchronize_stream")
def synchronize_stream(stream: int) -> int:
    state = local()
    target = state.stream(stream, state.device())
    if target is None:
        return ACL_ERROR_RT_INVALID_HANDLE
    return _drain(state, target)


@api("synchronize_device")
def synchronize_device() -> int:
    state = local()
    with state.lock:
        streams = [s for s in [*state.streams.values(), *state.default_streams.values()] if s.dev == state.device()]
    for stream in streams:
        code = _drain(state, stream)
        if code:
            return code
    return ACL_SUCCESS
