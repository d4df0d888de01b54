"""The NPU platform's default copy engine ("acl"): a CopyPlan's blocks moved with pyACL copies.

Every run of consecutive ids of every layer becomes one copy; the copies go out as one batched
call per ``MAX_BATCH`` where the runtime has it (CANN >= 8.5, ``acl.rt.memcpy_batch_async``,
modelled on ``aclrtMemcpyBatchAsync``), else one ``acl.rt.memcpy_async`` each, on the calling
thread's stream; then one ``acl.rt.synchronize_stream``.  ``ACL_ERROR_RT_FEATURE_NOT_SUPPORT``
from the first batch switches this copier to the async path for good.  Also here: the aclError
check every pyACL call of the platform goes through.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from .layout import CopyPlan, check_side_ids, orient
from .modes import DEVICE_TO_HOST, BlockIds

logger = logging.getLogger(__name__)

ACL_SUCCESS = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_MEM_LOC_HOST, ACL_MEM_LOC_DEVICE = 0, 1  # aclrtMemLocationType, for the batched copy's attributes
MAX_BATCH = 4096  # copies per batched call; longer plans go in several batches


def check_acl(ret: Any, call: str) -> None:
    """Raise ``RuntimeError`` unless ``ret`` is ACL_SUCCESS."""
    if ret != ACL_SUCCESS:
        raise RuntimeError(f"{call} failed with aclError {ret}")


def merge_runs(src_ids: Any, dst_ids: Any) -> list[tuple[int, int, int]]:
    """Maximal runs where both id sequences go up by one: ``[(src_start, dst_start, count)]`` in order."""
    src = np.asarray(src_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        raise ValueError(f"merge_runs: {src.size} source ids but {dst.size} destination ids")
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends)]


class AclCopier:
    """pyACL copies of CopyPlans; ``stream()`` gives the calling thread's stream, already on its device."""

    def __init__(self, acl: Any, stream: Callable[[], Any]) -> None:
        self._acl = acl
        self._stream = stream
        self._batch_supported = hasattr(acl.rt, "memcpy_batch_async")

    def run(self, plan: CopyPlan, device_ids: BlockIds, host_ids: BlockIds, mode: int) -> int:
        """Copy the listed blocks of every layer; every id is checked first.  Returns the copies made."""
        c = orient(plan, device_ids, host_ids, mode)
        src, dst, src_ids, dst_ids = c.src, c.dst, c.src_ids, c.dst_ids
        kind = ACL_MEMCPY_DEVICE_TO_HOST if c.mode == DEVICE_TO_HOST else ACL_MEMCPY_HOST_TO_DEVICE
        check_side_ids(src_ids, src, unique=False)
        check_side_ids(dst_ids, dst, unique=True)
        bb = plan.block_bytes
        if src.stride == bb and dst.stride == bb:
            runs = merge_runs(src_ids, dst_ids)
        else:  # block-major staging: consecutive ids are not adjacent in memory
            runs = [(s, d, 1) for s, d in zip(src_ids.tolist(), dst_ids.tolist())]
        copies = []  # (dst, dest_max, src, count) for every run of every layer
        for layer in range(len(src.bases)):
            sbase, dbase = int(src.bases[layer]), int(dst.bases[layer])
            dend = dbase + (int(dst.capacities[layer]) - 1) * dst.stride + bb  # end of the last valid block
            for s, d, n in runs:
                daddr = dbase + d * dst.stride
                copies.append((daddr, dend - daddr, sbase + s * src.stride, n * bb))
        self._copy(copies, kind, f"{src.name}->{dst.name}")
        return len(copies)

    def _copy(self, copies: list[tuple[int, int, int, int]], kind: int, what: str) -> None:
        """Every copy of a plan, then one synchronize: batched where the runtime can, else async."""
        if not copies:
            return
        stream = self._stream()
        dst_loc, src_loc = ((ACL_MEM_LOC_DEVICE, ACL_MEM_LOC_HOST) if kind == ACL_MEMCPY_HOST_TO_DEVICE
                            else (ACL_MEM_LOC_HOST, ACL_MEM_LOC_DEVICE))
        queued = False
        if self._batch_supported:
            for start in range(0, len(copies), MAX_BATCH):
                part = copies[start:start + MAX_BATCH]
                dsts, maxes, srcs, sizes = (list(c) for c in zip(*part))
                attr = self._acl.rt.MemcpyBatchAttr(dst_loc, src_loc)
                fail, ret = self._acl.rt.memcpy_batch_async(dsts, maxes, srcs, sizes, [attr], [0], stream)
                if ret == ACL_ERROR_RT_FEATURE_NOT_SUPPORT and not queued:
                    logger.warning("this runtime has no batched copy (aclrtMemcpyBatchAsync): async copies instead")
                    self._batch_supported = False
                    break
                check_acl(ret, f"acl.rt.memcpy_batch_async({what}, copy {fail})")
                queued = True
        if not self._batch_supported:
            for dst, dest_max, src, count in copies:
                check_acl(self._acl.rt.memcpy_async(dst, dest_max, src, count, kind, stream),
                          f"acl.rt.memcpy_async({what})")
        check_acl(self._acl.rt.synchronize_stream(stream), f"acl.rt.synchronize_stream({what})")
