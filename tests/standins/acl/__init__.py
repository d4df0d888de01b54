"""Contract stand-in for pyACL (``acl``, the Python ACL of Huawei CANN), for tests only.

Not the vendor module: importable as ``acl`` only when a test puts ``tests/standins`` on
``sys.path``.  It mirrors the documented pyACL calls ``ops/npu.py`` makes, with pyACL's return
conventions (``ret`` or ``(value, ret)``; 0 = ACL_SUCCESS, else an aclError code, never an
exception), and refuses what the CANN documentation forbids, so code that passes against it is
likely to run on an Ascend NPU.  Calls:

``acl.init(config_path=None)``, ``acl.finalize()``; ``acl.rt``: ``set_device``, ``reset_device``,
``get_device``, ``get_device_count``, ``device_get_bare_tgid``, ``malloc(size, policy)``, ``free``,
``malloc_host(size)``, ``free_host``, ``memcpy(dst, dest_max, src, count, kind)``,
``memcpy_async(..., stream)``, ``memcpy_batch_async(dsts, dest_maxs, srcs, sizes, attrs,
attrs_indexes, stream) -> (fail_index, ret)``, ``create_stream``, ``destroy_stream``,
``synchronize_stream``, ``synchronize_device``, ``ipc_mem_get_export_key(dev_ptr, size, 65,
flags) -> (key, ret)``, ``ipc_mem_set_import_pid(key, pids)``, ``ipc_mem_import_by_key(key,
flags) -> (dev_ptr, ret)``, ``ipc_mem_close(key)``.

What it enforces (code returned):

* ``acl.init`` first (else ACL_ERROR_UNINITIALIZE 100001; twice: ACL_ERROR_REPEAT_INITIALIZE 100002;
  a ``config_path`` that is not a file: ACL_ERROR_INVALID_FILE 100003);
* the device is per *thread*: malloc, free, malloc_host, the copies, streams, get_device and
  IPC export/import on a thread that never called ``set_device`` return ACL_ERROR_RT_CONTEXT_NULL
  107002; a device id out of range is ACL_ERROR_RT_INVALID_DEVICEID 107001;
* arguments of the wrong type or value (sizes <= 0, unknown kind/policy/flags, ``count >
  dest_max``, ``key_len != 65``, a malformed batch) are ACL_ERROR_INVALID_PARAM 100000;
* device memory is not host memory: device pointers are opaque addresses (``0x5A00_0000_0000 +
  device * 2**36 + offset``) mapped nowhere, so dereferencing one on the host faults as on hardware;
* each copy's kind must match where its pointers live (ACL_ERROR_RT_INVALID_MEMORY_TYPE 107016)
  and each range must lie in its allocation, on the calling thread's device
  (ACL_ERROR_RT_PARAM_INVALID 107000); see ``acl._copy`` for host memory;
* ``memcpy_async``/``memcpy_batch_async`` only queue: bytes move at ``synchronize_stream`` (or
  ``destroy_stream``/``synchronize_device``), checked again then; an asynchronous host-to-host copy
  is ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000 (documented for aclrtMemcpyAsync); a stream of another
  device is ACL_ERROR_RT_STREAM_CONTEXT 107003, an unknown handle ACL_ERROR_RT_INVALID_HANDLE 107017;
  the synchronous ``memcpy`` does not wait for streams;
* ``malloc`` beyond the device's size: ACL_ERROR_RT_MEMORY_ALLOCATION 207001; freeing memory with
  an export still open: ACL_ERROR_RT_MEMORY_FREE 207002 (our reading of the documented order
  "close, then free"; importers cannot keep memory alive past that, since the exporter cannot
  close before them); freeing anything but an allocation's start: ACL_ERROR_RT_PARAM_INVALID;
* exports start page-aligned (4 KiB; ACL_ERROR_RT_ADDR_UNALIGNED 107008) inside one allocation
  of the exporter; imports need the importer's pid whitelisted unless the export disabled pid
  validation (ACL_ERROR_RT_NO_PERMISSION 207006); the exporter's close while importers still hold
  the key is ACL_ERROR_RT_IPC_ERROR 507022; an unknown or closed key is ACL_ERROR_RT_INVALID_HANDLE.

Assumed beyond the documentation: the Python names of the batched copy (``memcpy_batch_async``,
``MemcpyBatchAttr(dst_loc, src_loc)``, ``MEM_LOC_HOST``/``MEM_LOC_DEVICE``), modelled on the C
``aclrtMemcpyBatchAsync(dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes, numAttrs,
failIndex, stream)``, with ``fail_index`` SIZE_MAX when no single copy is at fault; asynchronous
copies refuse pageable host memory (see ``acl._copy``); ``malloc_host`` needs a device context;
``reset_device`` only unbinds the calling thread (it frees nothing); a failed ``get_device``
returns ``(-1, ret)``, other failed ``(value, ret)`` calls ``(0, ret)`` or ``("", ret)``; a process
imports a key once; ``acl.init`` again after ``acl.finalize`` is allowed; the exact codes where
the docs name none.

State shared by the processes of a test lives under ``$ACL_STANDIN_DIR`` (required): device
files and the allocation/export table (``acl._shared``); fault knobs in ``faults.json``
(``acl._faults``).  Test-only helpers, not pyACL: ``standin_calls()`` (call name -> count in this
process) and ``standin_reset_calls()``.
"""
from __future__ import annotations

import os
from typing import Optional

from . import rt
from ._errors import (
    ACL_ERROR_INVALID_FILE,
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_REPEAT_FINALIZE,
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_ERROR_RT_ADDR_UNALIGNED,
    ACL_ERROR_RT_CONTEXT_NULL,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    ACL_ERROR_RT_INTERNAL_ERROR,
    ACL_ERROR_RT_INVALID_DEVICEID,
    ACL_ERROR_RT_INVALID_HANDLE,
    ACL_ERROR_RT_INVALID_MEMORY_TYPE,
    ACL_ERROR_RT_IPC_ERROR,
    ACL_ERROR_RT_MEMORY_ALLOCATION,
    ACL_ERROR_RT_MEMORY_FREE,
    ACL_ERROR_RT_NO_PERMISSION,
    ACL_ERROR_RT_PARAM_INVALID,
    ACL_ERROR_RT_STREAM_CONTEXT,
    ACL_ERROR_UNINITIALIZE,
    ACL_SUCCESS,
    SIZE_MAX,
)
from ._local import api, local
from .rt import (
    ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_MEMCPY_HOST_TO_HOST,
    ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT,
    ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
)

__all__ = [
    "rt", "init", "finalize", "standin_calls", "standin_reset_calls", "ACL_MEMCPY_HOST_TO_HOST",
    "ACL_MEMCPY_HOST_TO_DEVICE", "ACL_MEMCPY_DEVICE_TO_HOST", "ACL_MEMCPY_DEVICE_TO_DEVICE",
    "ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT", "ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION", "SIZE_MAX",
    "ACL_ERROR_INVALID_FILE", "ACL_ERROR_INVALID_PARAM", "ACL_ERROR_REPEAT_FINALIZE", "ACL_ERROR_REPEAT_INITIALIZE",
    "ACL_ERROR_RT_ADDR_UNALIGNED", "ACL_ERROR_RT_CONTEXT_NULL", "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    "ACL_ERROR_RT_INTERNAL_ERROR", "ACL_ERROR_RT_INVALID_DEVICEID", "ACL_ERROR_RT_INVALID_HANDLE",
    "ACL_ERROR_RT_INVALID_MEMORY_TYPE", "ACL_ERROR_RT_IPC_ERROR", "ACL_ERROR_RT_MEMORY_ALLOCATION",
    "ACL_ERROR_RT_MEMORY_FREE", "ACL_ERROR_RT_NO_PERMISSION", "ACL_ERROR_RT_PARAM_INVALID",
    "ACL_ERROR_RT_STREAM_CONTEXT", "ACL_ERROR_UNINITIALIZE", "ACL_SUCCESS",
]


@api("init", needs_init=False, needs_context=False)
def init(config_path: Optional[str] = None) -> int:
    state = local()
    state.shared()  # $ACL_STANDIN_DIR must be set: RuntimeError otherwise
    if config_path is not None:
        if not isinstance(config_path, str):
            return ACL_ERROR_INVALID_PARAM
        if not os.path.isfile(config_path):
            return ACL_ERROR_INVALID_FILE
    with state.lock:
        if state.initialized:
            return ACL_ERROR_REPEAT_INITIALIZE
        state.initialized = True
    return ACL_SUCCESS


@api("finalize", needs_init=False, needs_context=False)
def finalize() -> int:
    state = local()
    with state.lock:
        if not state.initialized:
            return ACL_ERROR_REPEAT_FINALIZE if state.finalized else ACL_ERROR_UNINITIALIZE
        state.initialized = False
        state.finalized = True
    state.shared().close()  # the device files; reopened on use after another init
    return ACL_SUCCESS


def standin_calls() -> dict[str, int]:
    """Test-only: how many times this process called each stand-in function (failed calls too)."""
    state = local()
    with state.lock:
        return dict(state.calls)


def standin_reset_calls() -> None:
    """Test-only: zero the counts of ``standin_calls`` (the ``"fail"`` knob counts from here too)."""
    state = local()
    with state.lock:
        state.calls.clear()
