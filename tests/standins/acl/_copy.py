"""Copy checks and copy execution of the pyACL stand-in (tests only).

Every copy names where each pointer lives (through the memcpy kind or a batch attribute); the
stand-in checks that against where the pointer really is:

* a *device* pointer must lie in a region of this process (an ``acl.rt.malloc`` allocation or an
  imported export) on the device the copy runs on, with the whole range inside that region;
  a host address named as device is ``ACL_ERROR_RT_INVALID_MEMORY_TYPE``, an address in the
  device window outside every region, or a range running past its region, ``ACL_ERROR_RT_PARAM_INVALID``;
* a *host* pointer in the device window is ``ACL_ERROR_RT_INVALID_MEMORY_TYPE``; one inside an
  ``acl.rt.malloc_host`` allocation must have its whole range in it; any other host range is
  accepted by the synchronous ``memcpy`` only if ``/proc/self/maps`` maps all of it (readable for a
  source, writable for a destination) and refused (``ACL_ERROR_RT_PARAM_INVALID``) by the
  asynchronous copies, which take page-locked memory only (assumption: CANN 8.5 runs pageable
  memory synchronously, older CANN calls it unpredictable; the stand-in holds code to malloc_host).

Bytes move between the device files and host memory with ``os.preadv``/``os.pwrite`` and
``ctypes.memmove`` (host to host); the stand-in never maps device memory.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Union

from ._errors import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_INVALID_MEMORY_TYPE,
    ACL_ERROR_RT_PARAM_INVALID,
)
from ._local import Copy, Local
from ._shared import Shared, is_device_address

HOST, DEVICE = 0, 1
# aclrtMemcpyKind -> (dst location, src location)
KIND_LOCATIONS = {0: (HOST, HOST), 1: (DEVICE, HOST), 2: (HOST, DEVICE), 3: (DEVICE, DEVICE)}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Side:
    """A checked end of a copy: host memory at ``addr``, or ``dev``'s file at ``file_off``."""

    loc: int
    addr: int
    dev: Optional[int] = None
    file_off: Optional[int] = None


def _mapped(addr: int, count: int, perm: str) -> bool:
    """Whether ``/proc/self/maps`` maps all of ``[addr, addr + count)`` with ``perm`` ('r' or 'w')."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 2 and perm in fields[1]:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
    at, end = addr, addr + max(count, 1)
    for lo, hi in sorted(spans):
        if lo <= at < hi:
            at = hi
            if at >= end:
                return True
    return False


def resolve(state: Local, addr: Any, count: int, loc: int, dev: int, *, writable: bool,
            pinned_only: bool) -> Union[Side, int]:
    """Check one end of a copy on device ``dev``; the checked ``Side`` or an aclError code."""
    if not is_int(addr) or addr <= 0:
        return ACL_ERROR_INVALID_PARAM
    if loc == DEVICE:
        if not is_device_address(addr):
            return ACL_ERROR_RT_INVALID_MEMORY_TYPE  # a host pointer named as device
        region = state.region_at(addr)
        if region is None or addr + count > region.end or region.dev != dev:
            return ACL_ERROR_RT_PARAM_INVALID
        return Side(DEVICE, addr, region.dev, region.file_off + (addr - region.start))
    if is_device_address(addr):
        return ACL_ERROR_RT_INVALID_MEMORY_TYPE  # a device pointer named as host
    pinned = state.host_at(addr)
    if pinned is not None:
        start, size = pinned
        return Side(HOST, addr) if addr + count <= start + size else ACL_ERROR_RT_PARAM_INVALID
    if pinned_only or not _mapped(addr, count, "w" if writable else "r"):
        return ACL_ERROR_RT_PARAM_INVALID
    return Side(HOST, addr)


def check_copy(state: Local, copy: Copy, dev: int, *, pinned_only: bool) -> Union[tuple[Side, Side], int]:
    dst = resolve(state, copy.dst, copy.count, copy.dst_loc, dev, writable=True, pinned_only=pinned_only)
    if isinstance(dst, int):
        return dst
    src = resolve(state, copy.src, copy.count, copy.src_loc, dev, writable=False, pinned_only=pinned_only)
    if isinstance(src, int):
        return src
    return dst, src


def _host_view(addr: int, count: int) -> memoryview:
    return memoryview((ctypes.c_char * count).from_address(addr)).cast("B")


def execute(shared: Shared, dst: Side, src: Side, count: int) -> None:
    """Move ``count`` bytes between two checked ends."""
    if count == 0:
        return
    if dst.loc == HOST and src.loc == HOST:
        ctypes.memmove(dst.addr, src.addr, count)
    elif dst.loc == HOST:
        assert src.dev is not None and src.file_off is not None
        shared.read_into(src.dev, src.file_off, _host_view(dst.addr, count))
    elif src.loc == HOST:
        assert dst.dev is not None and dst.file_off is not None
        shared.write_from(dst.dev, dst.file_off, _host_view(src.addr, count))
    else:
        assert src.dev is not None and src.file_off is not None
        assert dst.dev is not None and dst.file_off is not None
        buf = bytearray(count)
        shared.read_into(src.dev, src.file_off, memoryview(buf))
        shared.write_from(dst.dev, dst.file_off, memoryview(buf))


def run_task(state: Local, shared: Shared, copies: list[Copy], dev: int) -> int:
    """Run queued copies at synchronize time, checking each again (its memory may be gone by now)."""
    for copy in copies:
        checked = check_copy(state, copy, dev, pinned_only=True)
        if isinstance(checked, int):
            return checked
        execute(shared, checked[0], checked[1], copy.count)
    return 0
