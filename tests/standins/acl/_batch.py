"""The batched copy of the pyACL stand-in (tests only): ``acl.rt.memcpy_batch_async``.

Modelled on CANN >= 8.5's C API ``aclrtMemcpyBatchAsync(dsts, destMaxs, srcs, sizes, numBatches,
attrs, attrsIndexes, numAttrs, failIndex, stream)``: ``attrs[k]`` (where the destination and the
source live) applies to copies ``attrs_indexes[k]`` .. ``attrs_indexes[k+1] - 1``, the last one to
the end.  The Python spelling (``memcpy_batch_async(...) -> (fail_index, ret)``,
``MemcpyBatchAttr(dst_loc, src_loc)``, ``MEM_LOC_HOST``/``MEM_LOC_DEVICE``) is our assumption: pyACL
publishes no binding of it as of CANN 8.5.  Asynchronous like ``memcpy_async``: every copy is
checked before any is queued, and the bytes move at ``synchronize_stream``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from ._copy import DEVICE, HOST, check_copy, is_int
from ._errors import ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ACL_SUCCESS, SIZE_MAX
from ._local import Copy, api, knobs, local

# aclrtMemLocationType of aclrtMemcpyBatchAttr's srcLoc/dstLoc (ACL_MEM_LOCATION_TYPE_HOST/DEVICE).
MEM_LOC_HOST = HOST
MEM_LOC_DEVICE = DEVICE


@dataclass(frozen=True)
class MemcpyBatchAttr:
    """``aclrtMemcpyBatchAttr``: where the destination and the source of its copies live (assumed binding)."""

    dst_loc: int
    src_loc: int


@api("memcpy_batch_async", on_error=lambda ret: (SIZE_MAX, ret))
def memcpy_batch_async(dsts: Sequence[int], dest_maxs: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                       attrs: Sequence[MemcpyBatchAttr], attrs_indexes: Sequence[int], stream: int) -> tuple[int, int]:
    """``aclrtMemcpyBatchAsync``: all copies checked before any is queued; ``fail_index`` names the bad one."""
    k = knobs()
    if k.get("batch_not_supported"):
        return SIZE_MAX, ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    bad = (SIZE_MAX, ACL_ERROR_INVALID_PARAM)
    if not all(isinstance(s, (list, tuple)) for s in (dsts, dest_maxs, srcs, sizes, attrs, attrs_indexes)):
        return bad
    n = len(dsts)
    if n == 0 or not len(dest_maxs) == len(srcs) == len(sizes) == n:
        return bad
    if not attrs or len(attrs) != len(attrs_indexes) or len(attrs) > n:
        return bad
    if not all(isinstance(a, MemcpyBatchAttr) and a.dst_loc in (HOST, DEVICE) and a.src_loc in (HOST, DEVICE)
               for a in attrs):
        return bad
    idx = list(attrs_indexes)
    if not all(is_int(i) for i in idx) or idx[0] != 0 or idx[-1] >= n or any(b <= a for a, b in zip(idx, idx[1:])):
        return bad
    if "batch_limit" in k and n > k["batch_limit"]:
        return bad
    state = local()
    target = state.queue_stream(stream)
    if isinstance(target, int):
        return SIZE_MAX, target
    copies = []
    for i in range(n):
        attr = attrs[bisect.bisect_right(idx, i) - 1]
        if attr.dst_loc == HOST and attr.src_loc == HOST:
            return i, ACL_ERROR_RT_FEATURE_NOT_SUPPORT
        size, dest_max = sizes[i], dest_maxs[i]
        if not (is_int(size) and is_int(dest_max)) or size < 0 or size > dest_max:
            return i, ACL_ERROR_INVALID_PARAM
        copy = Copy(dsts[i], attr.dst_loc, srcs[i], attr.src_loc, size)
        checked = check_copy(state, copy, target.dev, pinned_only=True)
        if isinstance(checked, int):
            return i, checked
        copies.append(copy)
    with target.lock:
        target.tasks.append(copies)
    return SIZE_MAX, ACL_SUCCESS
