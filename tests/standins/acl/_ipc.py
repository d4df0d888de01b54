"""IPC of device memory in the pyACL stand-in (tests only): ``acl.rt.ipc_mem_*``.

The documented flow (aclrtIpcMemGetExportKey): the exporter mallocs, exports a key (with or
without pid validation), whitelists importers (``ipc_mem_set_import_pid``) when validation is on;
an importer imports the key and gets a device pointer of its own; importers close, then the
exporter closes, then the exporter frees.  The stand-in keeps exports in the shared table so
every process of a test sees them, and enforces that order.
"""
from __future__ import annotations

import secrets
from typing import Any, Sequence

from ._copy import is_int
from ._errors import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_ADDR_UNALIGNED,
    ACL_ERROR_RT_INVALID_HANDLE,
    ACL_ERROR_RT_IPC_ERROR,
    ACL_ERROR_RT_NO_PERMISSION,
    ACL_ERROR_RT_PARAM_INVALID,
    ACL_SUCCESS,
)
from ._local import Region, api, knobs, local
from ._shared import DEVICE_PAGE, IMPORT_BIAS, device_base, round_up

IPC_KEY_LEN = 65  # "key的长度，固定配置为65": 64 characters and the NUL
ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT = 0  # pid validation on: importers must be whitelisted
ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 1
ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT = 0
ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS = 1


@api("ipc_mem_get_export_key", on_error=lambda ret: ("", ret))
def ipc_mem_get_export_key(dev_ptr: int, size: int, key_len: int, flags: int) -> tuple[str, int]:
    if not all(is_int(v) for v in (dev_ptr, size, key_len, flags)) or size <= 0:
        return "", ACL_ERROR_INVALID_PARAM
    if key_len != IPC_KEY_LEN or flags not in (0, 1):
        return "", ACL_ERROR_INVALID_PARAM
    state = local()
    region = state.region_at(dev_ptr)
    if region is None or region.key is not None:  # not this process's allocation (imports cannot be re-exported)
        return "", ACL_ERROR_RT_PARAM_INVALID
    if region.dev != state.device() or dev_ptr + size > region.end:
        return "", ACL_ERROR_RT_PARAM_INVALID
    if dev_ptr % DEVICE_PAGE:
        return "", ACL_ERROR_RT_ADDR_UNALIGNED
    if knobs().get("export_whole_allocation") and (dev_ptr != region.start or size != region.size):
        return "", ACL_ERROR_RT_PARAM_INVALID
    key = secrets.token_hex((IPC_KEY_LEN - 1) // 2)
    with state.shared().table() as table:
        table["exports"][key] = {
            "dev": region.dev, "off": region.file_off + (dev_ptr - region.start), "size": size,
            "alloc_off": region.file_off, "pid": state.pid, "flags": flags, "pids": [], "importers": {},
        }
    return key, ACL_SUCCESS


@api("ipc_mem_set_import_pid", needs_context=False)
def ipc_mem_set_import_pid(key: str, pids: Sequence[int]) -> int:
    if not isinstance(key, str) or not isinstance(pids, (list, tuple)) or not pids:
        return ACL_ERROR_INVALID_PARAM
    if not all(is_int(p) and p > 0 for p in pids):
        return ACL_ERROR_INVALID_PARAM
    state = local()
    with state.shared().table() as table:
        export = table["exports"].get(key)
        if export is None:
            return ACL_ERROR_RT_INVALID_HANDLE
        if export["pid"] != state.pid:
            return ACL_ERROR_RT_NO_PERMISSION  # only the exporter whitelists
        export["pids"] = sorted(set(export["pids"]) | {int(p) for p in pids})
    return ACL_SUCCESS


@api("ipc_mem_import_by_key", on_error=lambda ret: (0, ret))
def ipc_mem_import_by_key(key: str, flags: int) -> tuple[int, int]:
    if not isinstance(key, str) or not is_int(flags) or flags not in (0, 1):
        return 0, ACL_ERROR_INVALID_PARAM
    state = local()
    dev = state.device()
    assert dev is not None
    with state.lock:
        if key in state.imports:
            return 0, ACL_ERROR_RT_PARAM_INVALID  # one import per key and process (close it first)
    with state.shared().table() as table:
        export = table["exports"].get(key)
        if export is None:
            return 0, ACL_ERROR_RT_INVALID_HANDLE  # unknown, or already closed by its exporter
        if export["flags"] == ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT and state.pid not in export["pids"]:
            return 0, ACL_ERROR_RT_NO_PERMISSION  # pid validation on and this pid not whitelisted
        if export["dev"] != dev and flags != ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS:
            return 0, ACL_ERROR_RT_PARAM_INVALID  # another device needs peer access
        importers = export["importers"]
        importers[str(state.pid)] = importers.get(str(state.pid), 0) + 1
        edev, off, size = export["dev"], export["off"], export["size"]
    with state.lock:
        at = state.import_next.get(edev, 0)
        state.import_next[edev] = at + round_up(size, DEVICE_PAGE)
        region = Region(device_base(edev) + IMPORT_BIAS + at, size, edev, off, key)
        state.imports[key] = region
        state.add_region(region)
    return region.start, ACL_SUCCESS


@api("ipc_mem_close", needs_context=False)
def ipc_mem_close(key: Any) -> int:
    """An importer's close unmaps its import; the exporter's close withdraws the key, but only once
    every importer has closed (refused with ACL_ERROR_RT_IPC_ERROR before: "importers close first")."""
    if not isinstance(key, str):
        return ACL_ERROR_INVALID_PARAM
    state = local()
    with state.lock:
        region = state.imports.pop(key, None)
        if region is not None:
            state.remove_region(region)
    with state.shared().table() as table:
        export = table["exports"].get(key)
        if region is not None:
            if export is not None:
                me = str(state.pid)
                if export["importers"].get(me, 0) > 1:
                    export["importers"][me] -= 1
                else:
                    export["importers"].pop(me, None)
            return ACL_SUCCESS
        if export is None or export["pid"] != state.pid:
            return ACL_ERROR_RT_INVALID_HANDLE  # this process holds no such key
        if export["importers"]:
            return ACL_ERROR_RT_IPC_ERROR
        del table["exports"][key]
    return ACL_SUCCESS
