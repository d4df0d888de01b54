"""How the LLM-DataDist stand-in moves bytes (tests only): every byte through the pyACL stand-in.

* swap out (device -> host): ``acl.rt.memcpy(..., ACL_MEMCPY_DEVICE_TO_HOST)`` per block per tensor;
* swap in (host -> device), in two stages as the vendor documents: ``acl.rt.malloc`` of a device
  staging area of ``staging_blocks`` (default 4) blocks of every tensor, then per group of up to
  4 blocks ``ACL_MEMCPY_HOST_TO_DEVICE`` into the staging area and ``ACL_MEMCPY_DEVICE_TO_DEVICE``
  from there into the destination blocks; ``acl.rt.free`` of the staging area at the end.  The
  staging area is allocated before any byte moves, so a swap-in refused for lack of device memory
  leaves every destination block as it was.

Device memory stays unreachable from the host: the stand-in never reads or writes it itself, and
every pyACL error code becomes an ``LLMException`` naming the call.
"""
from __future__ import annotations

from typing import Any

import acl

from ._state import count
from ._types import LLMException, LLMStatusCode

ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
DEFAULT_STAGING_BLOCKS = 4


def _memcpy(dst: int, dest_max: int, src: int, nbytes: int, kind: int) -> None:
    count("acl.rt.memcpy")
    ret = acl.rt.memcpy(dst, dest_max, src, nbytes, kind)
    if ret != 0:
        raise LLMException(f"[swap_blocks] acl.rt.memcpy(kind {kind}) failed with aclError {ret}")


def swap_out(src: Any, dst: Any, pairs: list[tuple[int, int]], block: int) -> None:
    """Device cache ``src`` -> host cache ``dst``, block by block, tensor by tensor."""
    dst_size = dst.cache_desc.size
    for s_addr, d_addr in zip(src.tensor_addrs, dst.tensor_addrs):
        for s, d in pairs:
            _memcpy(d_addr + d * block, dst_size - d * block, s_addr + s * block, block, ACL_MEMCPY_DEVICE_TO_HOST)


def swap_in(src: Any, dst: Any, pairs: list[tuple[int, int]], block: int, staging_blocks: int) -> None:
    """Host cache ``src`` -> device cache ``dst`` through a device staging area."""
    tensors = src.cache_desc.num_tensors
    staging_bytes = staging_blocks * tensors * block
    count("acl.rt.malloc")
    staging, ret = acl.rt.malloc(staging_bytes, ACL_MEM_MALLOC_HUGE_FIRST)
    if ret != 0:
        status = (LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY if ret == ACL_ERROR_RT_MEMORY_ALLOCATION
                  else LLMStatusCode.LLM_FAILED)
        raise LLMException(f"[swap_blocks] swap in needs a device staging area of {staging_bytes} bytes "
                           f"({staging_blocks} blocks x {tensors} tensors): acl.rt.malloc failed with aclError {ret}",
                           status)
    failed = True
    try:
        dst_size = dst.cache_desc.size
        for start in range(0, len(pairs), staging_blocks):
            group = pairs[start:start + staging_blocks]
            for t, s_addr in enumerate(src.tensor_addrs):  # stage 1: host -> staging
                for slot, (s, _) in enumerate(group):
                    at = (t * staging_blocks + slot) * block
                    _memcpy(staging + at, staging_bytes - at, s_addr + s * block, block, ACL_MEMCPY_HOST_TO_DEVICE)
            for t, d_addr in enumerate(dst.tensor_addrs):  # stage 2: staging -> destination blocks
                for slot, (_, d) in enumerate(group):
                    at = (t * staging_blocks + slot) * block
                    _memcpy(d_addr + d * block, dst_size - d * block, staging + at, block, ACL_MEMCPY_DEVICE_TO_DEVICE)
        failed = False
    finally:
        count("acl.rt.free")
        ret = acl.rt.free(staging)
        if ret != 0 and not failed:  # a copy's error is the one to report
            raise LLMException(f"[swap_blocks] acl.rt.free of the staging area failed with aclError {ret}")
