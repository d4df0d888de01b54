"""Where a registered tensor's bytes are, and how the stand-in's "fabric" moves them (tests only).

A registered tensor gets a *location* at registration, plain data another process can use:

* device memory: ``{"t": "dev", "dev": d, "off": o}``, the offset in the pyACL stand-in's device
  file ``dev<d>.mem`` (an allocation of this process or an IPC import of another's);
* host memory: ``{"t": "host", "pid": p, "addr": a, "path": f | None, "off": o}``: its address in the
  registering process and, when it lies in a shared file mapping (a POSIX shared-memory segment
  such as an engine's exposure or layer board), that file and offset, so that another process can
  reach it.  Anonymous host memory (``acl.rt.malloc_host``) is reachable only by its own process:
  the stand-in cannot model an RDMA read of another process's private pages, and says so.

The stand-in itself plays the NIC: it reads and writes the device files and the shared files
directly, never through the host-visible pointers of device memory.  An aligned 8-byte move is one
8-byte load or store (ctypes ``c_int64`` on the mapping), as a DMA write of one word is on
hardware, so a reader's acquire load never sees half a word.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from acl._local import local as _acl_local  # the device files of the pyACL stand-in

from ._types import LLMException, LLMStatusCode

PAGE = mmap.PAGESIZE


def device_location(addr: int, size: int, device_id: int) -> dict[str, Any] | None:
    """The device file range of ``[addr, addr + size)`` on ``device_id``, or None if it is not all
    device memory this process may name there."""
    region = _acl_local().region_at(addr)
    if region is None or region.dev != device_id or addr + size > region.end:
        return None
    return {"t": "dev", "dev": region.dev, "off": region.file_off + (addr - region.start)}


def _maps() -> list[tuple[int, int, str, int, str]]:
    rows = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) == 6 else ""
            rows.append((start, end, parts[1], int(parts[2], 16), path))
    return rows


def host_location(addr: int, size: int) -> dict[str, Any]:
    """Host memory of this process; with its backing file when a shared mapping of a regular file
    covers the whole range (what another process can open)."""
    loc: dict[str, Any] = {"t": "host", "pid": os.getpid(), "addr": addr, "path": None, "off": 0}
    for start, end, perms, offset, path in _maps():
        if start <= addr < end:
            if (addr + size <= end and len(perms) > 3 and perms[3] == "s" and path.startswith("/")
                    and not path.endswith("(deleted)") and os.path.isfile(path)):
                loc["path"], loc["off"] = path, offset + (addr - start)
            break
    return loc


def reachable(loc: dict[str, Any]) -> bool:
    return loc["t"] == "dev" or loc["pid"] == os.getpid() or loc["path"] is not None


def _file_io(path: str, off: int, n: int, data: bytes | None) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise LLMException(f"the peer's host memory {path} is gone ({exc.strerror})",
                           LLMStatusCode.LLM_LINK_FAILED) from None
    base = off - off % PAGE
    try:
        length = off + n - base
        if os.fstat(fd).st_size < off + n:
            raise LLMException(f"the peer's host memory {path} is shorter than {off + n} bytes",
                               LLMStatusCode.LLM_LINK_FAILED)
        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, offset=base)
    finally:
        os.close(fd)
    try:
        at = off - base
        if n == 8 and off % 8 == 0:  # one aligned word: one load or store
            word = ctypes.c_int64.from_buffer(mm, at)
            try:
                if data is None:
                    return int(word.value).to_bytes(8, "little", signed=True)
                word.value = int.from_bytes(data, "little", signed=True)
                return None
            finally:
                del word
        if data is None:
            return bytes(mm[at:at + n])
        mm[at:at + n] = data
        return None
    finally:
        mm.close()


def read(loc: dict[str, Any], off: int, n: int) -> bytes:
    """``n`` bytes at ``off`` of the tensor at ``loc``."""
    if loc["t"] == "dev":
        buf = bytearray(n)
        _acl_local().shared().read_into(loc["dev"], loc["off"] + off, memoryview(buf))
        return bytes(buf)
    if loc["pid"] == os.getpid():
        return ctypes.string_at(loc["addr"] + off, n)
    if loc["path"] is None:
        raise LLMException(f"stand-in limit: host memory at {loc['addr']:#x} of process {loc['pid']} is not in a "
                           "shared file mapping, so another process cannot reach it", LLMStatusCode.LLM_FAILED)
    out = _file_io(loc["path"], loc["off"] + off, n, None)
    assert out is not None
    return out


def write(loc: dict[str, Any], off: int, data: bytes) -> None:
    """Store ``data`` at ``off`` of the tensor at ``loc``."""
    if loc["t"] == "dev":
        _acl_local().shared().write_from(loc["dev"], loc["off"] + off, memoryview(data))
    elif loc["pid"] == os.getpid():
        if len(data) == 8 and (loc["addr"] + off) % 8 == 0:
            ctypes.c_int64.from_address(loc["addr"] + off).value = int.from_bytes(data, "little", signed=True)
        else:
            ctypes.memmove(loc["addr"] + off, data, len(data))
    elif loc["path"] is None:
        raise LLMException(f"stand-in limit: host memory at {loc['addr']:#x} of process {loc['pid']} is not in a "
                           "shared file mapping, so another process cannot reach it", LLMStatusCode.LLM_FAILED)
    else:
        _file_io(loc["path"], loc["off"] + off, len(data), data)
