"""The Ascend NPU platform: CANN's pyACL (memory, IPC, copies), with PaddlePaddle's NPU plugin where installed.

How each primitive maps to a vendor call (pyACL, the ``acl`` Python module of the CANN toolkit).
Every pyACL call returns an ``aclError`` int (0 = ACL_SUCCESS); any other code raises
``RuntimeError`` naming the call and the code.

``set_device``            ``acl.rt.set_device(device_id)`` -> ``ret`` (binds the calling *thread*, so it
                          runs once per thread) and, with paddle-custom-npu, ``paddle.device.set_device``.
``empty`` / ``free``      ``acl.rt.malloc(size, ACL_MEM_MALLOC_HUGE_FIRST)`` -> ``(dev_ptr, ret)`` /
                          ``acl.rt.free``: the documented export flow exports aclrtMalloc memory (an
                          interior range of paddle's pool is not documented as exportable).  The result
                          is an ``NpuDeviceView``; a model runner with its own paddle tensors exports
                          those instead.
``set_data_ipc``          ``acl.rt.ipc_mem_get_export_key(dev_ptr, size, 65, flags)`` -> ``(key, ret)``;
                          the key goes into a small shared-memory handle ``ctm.npu.<instance>.<name>``
                          (``ops.shm``), so the CTM finds it by the FastDeploy cache name.
``share_external_data_``  ``acl.rt.ipc_mem_import_by_key(key, flags)`` -> ``(dev_ptr, ret)``; the result is
                          an ``NpuDeviceView`` (pointer, shape, dtype).  Paddle documents no API that
                          wraps a foreign NPU pointer as a tensor, and the copies need nothing more.
``unset_data_ipc``        ``acl.rt.ipc_mem_close(key)``: importers first, the exporter last (CANN docs).
``host_alloc``/``free``   ``acl.rt.malloc_host(size)`` -> ``(ptr, ret)`` (page-locked, 64-byte aligned) /
                          ``acl.rt.free_host(ptr)`` -> ``ret``.
``swap_cache_*``          one batched copy per plan where the runtime has it (CANN >= 8.5,
                          ``acl.rt.memcpy_batch_async(dsts, dest_maxs, srcs, sizes, attrs, attrs_indexes,
                          stream)``, modelled on ``aclrtMemcpyBatchAsync``), else ``acl.rt.memcpy_async``
                          per run of consecutive ids on the thread's stream (``ops.acl_copy``); then one
                          ``acl.rt.synchronize_stream``.  ``ACL_ERROR_RT_FEATURE_NOT_SUPPORT`` from the
                          batch switches the platform to the async path for good.  Neither waits for the
                          engine's compute streams: a block must be written before its swap-out is asked.
``memory_allocated``      bytes of live ``empty`` allocations (``paddle.device.memory_allocated("npu:N")``
                          would count every tensor of the process, not only the caches).

Copy engines (``copy_engine``, CTM flag ``--npu_copy_engine``): ``"acl"`` (default) runs every plan as
above; ``"llm_datadist"`` routes the swap-space plans that ``plan_all_layers`` returned to LLM-DataDist's
``swap_blocks`` (``ops.npu_datadist.DataDistCopier``, built on the first such plan, which registers its
device caches at once so a documented limit fails a CTM at start), on the calling thread's device; the
block-major storage staging plans keep the pyACL copies.  Freeing memory (``free``, closing an import,
``host_free``) unregisters it from LLM-DataDist first, and the last one finalises it.
"""
from __future__ import annotations

import logging
import math
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .acl_copy import (ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_SUCCESS, AclCopier,
                       check_acl)
from .dtypes import cache_dtype
from .layout import CopyPlan, HostAllocations, tensor_info
from .platform import BlockIds, Platform
from .shm import SharedMemorySegment

logger = logging.getLogger(__name__)

ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEM_MALLOC_HUGE_FIRST = 0
IPC_KEY_LEN = 65  # "key的长度，固定配置为65" (aclrtIpcMemGetExportKey)
# 1 = ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION.  Ambiguous across CANN versions: 8.2 documents
# the flag as reserved ("固定配置为0", importers must be whitelisted with acl.rt.ipc_mem_set_import_pid);
# 8.3+ documents 0 = whitelist required, 1 = no whitelist.  On 8.2, pass export_flags=0 and call
# allow_import_pids() with the CTMs' pids (from aclrtDeviceGetBareTgid in the importer).
IPC_EXPORT_DISABLE_PID_VALIDATION = 1
IPC_IMPORT_FLAG_DEFAULT = 0  # same device: no peer access needed
COPY_ENGINES = ("acl", "llm_datadist")  # pyACL copies; LLM-DataDist's swap_blocks for swap space

SEGMENT_PREFIX = "ctm.npu."
# magic, format version, export key, nbytes, dtype name, exporter device id
_HANDLE = struct.Struct("<8sI80sQ16si")
_HANDLE_MAGIC = b"CTMNPU\x00\x01"
_HANDLE_VERSION = 1


@dataclass(frozen=True)
class NpuDeviceView:
    """An attached device cache: what ``tensor_info`` and the copies need, no paddle tensor."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    name: str

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return cache_dtype(self.dtype).itemsize

    def is_contiguous(self) -> bool:
        return True


def _import_vendor() -> tuple[Any, Any]:
    """pyACL (required) and paddle with its NPU plugin (None where paddle-custom-npu is absent)."""
    hint = "the embedded default platform is 'cpu' (CTM_PLATFORM=cpu)"
    try:
        import acl  # CANN pyACL: source <cann>/set_env.sh
    except ImportError as exc:
        raise RuntimeError(
            f"the NPU platform needs Ascend CANN's pyACL module 'acl', which cannot be imported ({exc}); {hint}"
        ) from exc
    try:
        import paddle
    except ImportError:
        return acl, None
    return acl, paddle if "npu" in (paddle.device.get_all_custom_device_type() or []) else None


class NpuPlatform(Platform):
    """Ascend NPU through paddle-custom-npu (allocation) and pyACL (memcpy, pinned host memory, IPC)."""

    name = "npu"
    takes_instance = True
    copy_engines = COPY_ENGINES

    def __init__(self, instance: str | None = None, export_flags: int = IPC_EXPORT_DISABLE_PID_VALIDATION,
                 copy_engine: str = "acl"):
        if copy_engine not in self.copy_engines:
            raise ValueError(f"copy_engine {copy_engine!r} is not one of the NPU platform's: {', '.join(self.copy_engines)}")
        self.copy_engine = copy_engine
        self._acl, self._paddle = _import_vendor()
        ret = self._acl.init()
        if ret not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):  # the paddle plugin may have initialised ACL
            check_acl(ret, "acl.init")
        self.instance = instance or os.environ.get("CTM_INSTANCE", "0")
        self.export_flags = int(export_flags)
        self.device_id = 0
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._hosts = HostAllocations()
        self._device: dict[int, tuple[Any, int, int]] = {}  # data_ptr -> (tensor, nbytes, device id)
        self._exports: dict[str, tuple[str, int]] = {}  # name -> (key, data_ptr)
        self._attached: dict[int, str] = {}  # imported data_ptr -> key
        self._acl_copier = AclCopier(self._acl, self._stream)
        self._datadist: Any = None  # DataDistCopier, built on the first swap-space plan (copy_engine llm_datadist)
        self._swap_plans: dict[int, weakref.ref] = {}  # id(plan) -> plan, for plans of plan_all_layers

    def segment_name(self, name: str) -> str:
        return f"{SEGMENT_PREFIX}{self.instance}.{name}"

    @property
    def segment_prefix(self) -> str:
        """Every IPC handle segment this platform instance publishes starts with this."""
        return f"{SEGMENT_PREFIX}{self.instance}."

    # -- device ------------------------------------------------------------
    def set_device(self, device_id: int) -> None:
        if not isinstance(device_id, (int, np.integer)) or isinstance(device_id, bool) or device_id < 0:
            raise ValueError(f"device_id {device_id!r} must be a non-negative integer")
        device_id = int(device_id)
        if getattr(self._tls, "device", None) != device_id:
            check_acl(self._acl.rt.set_device(device_id), f"acl.rt.set_device({device_id})")
            if self._paddle is not None:
                self._paddle.device.set_device(f"npu:{device_id}")
            self._tls.device = device_id
            self._tls.stream = None
        self.device_id = device_id

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        shape = [int(d) for d in shape]
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"shape {shape} must have positive dimensions")
        dt = cache_dtype(dtype)
        self.set_device(self.device_id)
        nbytes = math.prod(shape) * dt.itemsize
        ptr, ret = self._acl.rt.malloc(nbytes, ACL_MEM_MALLOC_HUGE_FIRST)
        check_acl(ret, f"acl.rt.malloc({nbytes})")
        tensor = NpuDeviceView(int(ptr), tuple(shape), dt.name, f"npu:{self.device_id}")
        with self._lock:
            self._device[int(ptr)] = (tensor, nbytes, self.device_id)
        return tensor

    def free(self, tensor: Any) -> None:
        ptr = int(tensor.data_ptr())
        with self._lock:
            entry = self._device.pop(ptr, None)
            if entry is None:
                raise ValueError(f"tensor at {ptr:#x} was not allocated by empty()")
            device = entry[2]
            names = [n for n, (_, p) in self._exports.items() if p == ptr]
        for name in names:
            logger.warning("freeing %r while exported; withdrawing the export", name)
            self.unset_data_ipc(None, name, close_ipc=False, unlink_shm=True)
        self._forget(ptr)
        self.set_device(device)
        check_acl(self._acl.rt.free(ptr), "acl.rt.free")  # exports are closed first, as the docs order

    # -- IPC ---------------------------------------------------------------
    def set_data_ipc(self, tensor: Any, name: str) -> None:
        info = tensor_info(tensor, f"tensor exported as {name!r}")
        handle = SharedMemorySegment(self.segment_name(name), _HANDLE.size, create=True)  # FileExistsError
        exported = None
        try:
            # The docs' flow exports memory from aclrtMalloc; whether an interior range of paddle's
            # allocator pool may be exported is not documented: a refusal surfaces as an aclError here.
            key, ret = self._acl.rt.ipc_mem_get_export_key(info.ptr, info.nbytes, IPC_KEY_LEN, self.export_flags)
            check_acl(ret, f"acl.rt.ipc_mem_get_export_key({name!r})")
            exported = str(key)
            raw_key = exported.encode()
            if not raw_key or len(raw_key) >= 80:
                raise RuntimeError(f"acl.rt.ipc_mem_get_export_key({name!r}) returned an unusable key")
            handle.buf[: _HANDLE.size] = _HANDLE.pack(
                _HANDLE_MAGIC, _HANDLE_VERSION, raw_key, info.nbytes, info.dtype.name.encode(), self.device_id
            )
        except BaseException:
            handle.unlink()
            if exported is not None:
                self._acl.rt.ipc_mem_close(exported)  # best effort; the original error is what matters
            raise
        finally:
            handle.close()
        with self._lock:
            self._exports[name] = (exported, info.ptr)

    def allow_import_pids(self, name: str, pids: Sequence[int]) -> None:
        """Whitelist importers of an export (needed when ``export_flags`` is 0)."""
        key = self._exports[name][0]
        check_acl(self._acl.rt.ipc_mem_set_import_pid(key, [int(p) for p in pids]), "acl.rt.ipc_mem_set_import_pid")

    def _read_handle(self, name: str) -> tuple[str, int, str, int]:
        try:
            handle = SharedMemorySegment(self.segment_name(name))
        except FileNotFoundError:
            raise FileNotFoundError(f"no cache exported as {name!r} ({self.segment_name(name)} is missing)") from None
        try:
            magic, version, key, nbytes, dtype, device = _HANDLE.unpack(bytes(handle.buf[: _HANDLE.size]))
        finally:
            handle.close()
        if magic != _HANDLE_MAGIC or version != _HANDLE_VERSION:
            raise ValueError(f"segment {self.segment_name(name)} is not an NPU cache IPC handle")
        return key.rstrip(b"\0").decode(), nbytes, dtype.rstrip(b"\0").decode(), device

    def share_external_data_(self, tensor: Any, name: str, shape: Sequence[int], use_ipc: bool = True) -> Any:
        if not use_ipc:
            raise ValueError("the NPU platform attaches device caches only through IPC (use_ipc=True)")
        dt = cache_dtype(tensor.dtype)
        shape = tuple(int(d) for d in shape)
        key, nbytes, exported_dtype, device = self._read_handle(name)
        if exported_dtype != dt.name:
            raise ValueError(f"cache {name!r} was exported as {exported_dtype}, attached as {dt.name}")
        if math.prod(shape) * dt.itemsize != nbytes:
            raise ValueError(f"cache {name!r} holds {nbytes} bytes; shape {list(shape)} of {dt.name} does not")
        if device != self.device_id:
            # Across devices the docs forbid host<->device memcpy on imported memory.
            raise ValueError(f"cache {name!r} lives on npu:{device}, this process is on npu:{self.device_id}")
        self.set_device(self.device_id)
        ptr, ret = self._acl.rt.ipc_mem_import_by_key(key, IPC_IMPORT_FLAG_DEFAULT)
        check_acl(ret, f"acl.rt.ipc_mem_import_by_key({name!r})")
        with self._lock:
            self._attached[int(ptr)] = key
        return NpuDeviceView(int(ptr), shape, dt.name, name)

    def unset_data_ipc(self, tensor: Any, name: str, close_ipc: bool = True, unlink_shm: bool = False) -> None:
        if close_ipc and tensor is not None:
            with self._lock:
                key = self._attached.pop(int(tensor.data_ptr()), None)
            if key is not None:
                self._forget(int(tensor.data_ptr()))
                check_acl(self._acl.rt.ipc_mem_close(key), f"acl.rt.ipc_mem_close({name!r})")
        if unlink_shm:
            SharedMemorySegment.unlink_name(self.segment_name(name))
            with self._lock:
                export = self._exports.pop(name, None)
            if export is not None:  # every importer must have closed first (CANN docs)
                check_acl(self._acl.rt.ipc_mem_close(export[0]), f"acl.rt.ipc_mem_close({name!r})")

    # -- host --------------------------------------------------------------
    def host_alloc(self, nbytes: int) -> int:
        if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"host_alloc size {nbytes!r} must be a positive integer")
        self.set_device(self.device_id)
        ptr, ret = self._acl.rt.malloc_host(int(nbytes))
        check_acl(ret, f"acl.rt.malloc_host({int(nbytes)})")
        self._hosts.add(int(ptr), int(nbytes))
        return int(ptr)

    def host_free(self, ptr: int) -> None:
        self._hosts.pop(ptr)
        self._forget(ptr)
        check_acl(self._acl.rt.free_host(ptr), "acl.rt.free_host")

    # -- copies ------------------------------------------------------------
    @property
    def host_allocations(self) -> HostAllocations:
        return self._hosts

    def plan_all_layers(self, caches: Sequence[Any], host_ptrs: Sequence[int], num_cpu_blocks: int) -> CopyPlan:
        plan = super().plan_all_layers(caches, host_ptrs, num_cpu_blocks)
        if self.copy_engine == "llm_datadist":
            self._datadist_copier().prepare(plan)  # registers now: a documented limit fails a CTM at start
            key, plans = id(plan), self._swap_plans
            plans[key] = weakref.ref(plan, lambda _ref: plans.pop(key, None))
        return plan

    @property
    def merges_swap_plans(self) -> bool:  # type: ignore[override]
        # LLM-DataDist copies only the plans plan_all_layers returned (registered); a merged plan
        # would fall back to the pyACL copies.
        return self.copy_engine != "llm_datadist"

    def _datadist_copier(self) -> Any:
        """The LLM-DataDist copier of this process's device, built on first use on the calling thread."""
        self.set_device(self.device_id)
        with self._lock:
            if self._datadist is None:
                from .npu_datadist import DataDistCopier

                self._datadist = DataDistCopier(self.device_id)
            elif self._datadist.device_id != self.device_id:
                raise RuntimeError(f"LLM-DataDist was initialised on npu:{self._datadist.device_id}; "
                                   f"this platform now runs on npu:{self.device_id}")
            return self._datadist

    def _forget(self, ptr: int) -> None:
        """Memory at ``ptr`` is being freed: unregister it from LLM-DataDist; finalise it when nothing is left."""
        copier = self._datadist
        if copier is None or copier.forget(ptr):
            return
        with self._lock:
            if self._datadist is copier:
                self._datadist = None
        copier.close()

    def _is_swap_plan(self, plan: CopyPlan) -> bool:
        ref = self._swap_plans.get(id(plan))
        return ref is not None and ref() is plan

    def run_plan(self, plan: CopyPlan, device_ids: BlockIds, host_ids: BlockIds, mode: int,
                 bulk: bool = False) -> int:  # aclrtMemcpy's DMA does not pass through the CPU caches
        if self.copy_engine == "llm_datadist" and self._is_swap_plan(plan):
            return self._datadist_copier().run(plan, device_ids, host_ids, mode)  # binds the thread to the device
        return self._acl_copier.run(plan, device_ids, host_ids, mode)

    def _stream(self) -> Any:
        """The calling thread's stream on its device (streams belong to a device, as set_device does)."""
        self.set_device(self.device_id)
        stream = getattr(self._tls, "stream", None)
        if stream is None:
            stream, ret = self._acl.rt.create_stream()
            check_acl(ret, "acl.rt.create_stream")
            self._tls.stream = stream
        return stream

    def _device_of(self, ptr: int) -> int:
        """The device an allocation of ``empty`` lives on (copies must run on it); else the current one."""
        with self._lock:
            entry = self._device.get(ptr)
        return entry[2] if entry is not None else self.device_id

    def read_bytes(self, tensor: Any) -> np.ndarray:
        """A host copy of a device cache's bytes, ``[num_blocks, block_bytes]`` (tests, diagnostics)."""
        info = tensor_info(tensor, "tensor")
        out = np.empty(info.nbytes, dtype=np.uint8)
        self.set_device(self._device_of(info.ptr))
        check_acl(self._acl.rt.memcpy(out.ctypes.data, out.nbytes, info.ptr, info.nbytes, ACL_MEMCPY_DEVICE_TO_HOST),
                  "acl.rt.memcpy(read_bytes)")
        return out.reshape(info.shape[0], -1)

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """Overwrite a device cache with ``data`` (its exact size in bytes)."""
        info = tensor_info(tensor, "tensor")
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if data.nbytes != info.nbytes:
            raise ValueError(f"write_bytes: {data.nbytes} bytes for a cache of {info.nbytes}")
        self.set_device(self._device_of(info.ptr))
        check_acl(self._acl.rt.memcpy(info.ptr, info.nbytes, data.ctypes.data, data.nbytes, ACL_MEMCPY_HOST_TO_DEVICE),
                  "acl.rt.memcpy(write_bytes)")

    def memory_allocated(self, device_id: int | None = None) -> int:
        with self._lock:
            return sum(n for _, n, d in self._device.values() if device_id is None or d == device_id)
