"""The LLM-DataDist stand-in's transfers between clusters (tests only): ``pull_blocks``,
``push_blocks``, ``push_cache`` and ``pull_cache`` of ``CacheManager`` (CacheManager.md).

What they enforce, besides the link (``_links.using``):

* argument types: a cache of the wrong type ``TypeError`` (``None``: ``AttributeError``); block lists
  a list or tuple of ints (``TypeError``), non-empty, of equal length, local indices in range, no
  destination twice (``ValueError``); ``size`` only -1 (``ValueError``, "暂不支持其他设置");
  ``tensor_num_per_layer`` an int in [1, the cache's tensor count] (``ValueError``);
* layer ranges (``LLMException``, "layer_range参数异常"): both or neither, ``range`` objects
  (``TypeError``), step 1, the same length, inside the cache's layers (tensors /
  tensor_num_per_layer, which must divide the tensor count); a push needs equal ranges ("当前仅支持
  src_layer_range和dst_layer_range取值一致"); without ranges both caches have the same tensor count;
* the remote cache must exist (``LLM_KV_CACHE_NOT_EXIST``: never registered, unregistered, its key
  removed, or device memory registered after the link, which the link cannot reach: "调用该接口前需
  提前注册所有内存"); the local device cache must also predate the link (``LLM_PARAM_INVALID``);
* placements: host to host is refused; host to device needs two blocks caches for the ``*_blocks``
  calls and two contiguous caches for ``push_cache``/``pull_cache`` (the documented constraint); a
  host cache needs ``remote_accessible=True`` and its cluster a device memory pool of at least
  100 MB (``llm.MemPoolConfig``, "在D2H和H2D传输场景，需要在Host端初始化时配置Device内存池")
  (``LLM_FEATURE_NOT_ENABLED``); equal block (batch) bytes and data types (``LLM_PARAM_INVALID``);
* time: a call lasts at most ``sync_kv_timeout`` (``llm.SyncKvCacheWaitTime``, default 1000 ms); the
  ``stall_ms`` knob adds time to a call, and past the timeout it raises ``LLM_TIMEOUT`` and breaks
  the link ("该链路不可恢复"); a peer that dies while a call runs fails it with ``LLM_LINK_FAILED``
  (checked every 5 ms of a stall and after the bytes moved).
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence, Tuple

from . import _links, _memory, _registry
from ._pd_types import CacheKey, CacheKeyByIdAndIndex
from ._state import count, knobs
from ._types import BlocksCacheKey, Cache, LLMException, LLMStatusCode, check_type, is_int

S = LLMStatusCode
MIN_MEM_POOL = 100 * 2**20  # "内存池大小至少配置为100M"
STALL_SLICE_S = 0.005


class _Side:
    """One side of a transfer, local (a ``Cache``) or remote (a registry entry)."""

    def __init__(self, placement: str, num_tensors: int, shape: list[int], data_type: str, blocks: bool,
                 locations: list[dict], seq: int, remote_accessible: bool, what: str):
        self.placement, self.num_tensors, self.shape = placement, num_tensors, shape
        self.data_type, self.blocks, self.locations = data_type, blocks, locations
        self.seq, self.remote_accessible, self.what = seq, remote_accessible, what
        self.batches = shape[0]
        self.batch_bytes = 0

    @classmethod
    def local(cls, mgr: Any, cache: Any, name: str) -> "_Side":
        if cache is None:
            raise AttributeError(f"'NoneType' object ({name}) has no attribute 'cache_desc'")
        check_type(name, cache, Cache)
        if not cache._valid:
            raise ValueError(f"{name} cache {cache.cache_id} was unregistered or its LLMDataDist finalised")
        if cache._owner is not mgr:
            raise ValueError(f"{name} cache {cache.cache_id} is not a cache registered on this LLMDataDist")
        d = cache.cache_desc
        side = cls(d.placement.name, d.num_tensors, d.shape, d.data_type.name, cache.is_blocks_cache,
                   cache._locations, cache._seq, cache._remote_accessible, f"local {name} cache {cache.cache_id}")
        side.batch_bytes = d.size // d.shape[0]
        return side

    @classmethod
    def remote(cls, entry: Optional[dict], what: str) -> "_Side":
        if entry is None:
            raise LLMException(f"remote cache {what} does not exist", S.LLM_KV_CACHE_NOT_EXIST)
        from ._types import ITEMSIZE, DataType

        side = cls(entry["placement"], entry["num_tensors"], entry["shape"], entry["data_type"], entry["blocks"],
                   entry["tensors"], entry["seq"], entry["remote_accessible"], f"remote cache {what}")
        size = ITEMSIZE[DataType[entry["data_type"]]]
        for d in entry["shape"]:
            size *= d
        side.batch_bytes = size // entry["shape"][0]
        return side


def _ids(name: str, ids: Any) -> List[int]:
    if ids is None:
        raise AttributeError(f"'NoneType' object ({name}) is not a block list")
    check_type(name, ids, (list, tuple))
    for i, v in enumerate(ids):
        if not is_int(v):
            raise TypeError(f"{name}[{i}] must be int, got {type(v).__name__}")
    return list(ids)


def _tnpl(value: Any, *sides: _Side) -> int:
    check_type("tensor_num_per_layer", value, int)
    for side in sides:
        if not 1 <= value <= side.num_tensors:
            raise ValueError(f"tensor_num_per_layer {value} must be in [1, {side.num_tensors}] ({side.what})")
    return value


def _tensors(call: str, src: _Side, dst: _Side, src_range: Any, dst_range: Any, tnpl: int,
             same_range: bool) -> Tuple[List[int], List[int]]:
    """The tensor indices of each side the call moves, from the layer ranges."""
    for name, r in (("src_layer_range", src_range), ("dst_layer_range", dst_range)):
        check_type(name, r, range, allow_none=True)
    if src_range is None and dst_range is None:
        if src.num_tensors != dst.num_tensors:
            raise LLMException(f"[{call}] src has {src.num_tensors} tensors, dst {dst.num_tensors}: they must be equal "
                               "without layer ranges", S.LLM_PARAM_INVALID)
        return list(range(src.num_tensors)), list(range(dst.num_tensors))
    if src_range is None or dst_range is None:
        raise LLMException(f"[{call}] set both src_layer_range and dst_layer_range, or neither", S.LLM_PARAM_INVALID)
    out = []
    for name, r, side in (("src_layer_range", src_range, src), ("dst_layer_range", dst_range, dst)):
        if r.step != 1:
            raise LLMException(f"[{call}] {name} {r} must have step 1", S.LLM_PARAM_INVALID)
        if side.num_tensors % tnpl:
            raise LLMException(f"[{call}] tensor_num_per_layer {tnpl} does not divide the {side.num_tensors} tensors "
                               f"of the {side.what}", S.LLM_PARAM_INVALID)
        layers = side.num_tensors // tnpl
        if not (0 <= r.start < r.stop <= layers):
            raise LLMException(f"[{call}] {name} {r} is not a non-empty range inside the {layers} layers of the "
                               f"{side.what}", S.LLM_PARAM_INVALID)
        out.append(list(range(r.start * tnpl, r.stop * tnpl)))
    if len(src_range) != len(dst_range) or (same_range and src_range != dst_range):
        need = "equal" if same_range else "of equal length"
        raise LLMException(f"[{call}] src_layer_range {src_range} and dst_layer_range {dst_range} must be {need}",
                           S.LLM_PARAM_INVALID)
    return out[0], out[1]


def _pairs(call: str, src: _Side, dst: _Side, src_ids: List[int], dst_ids: List[int], local_is_src: bool) -> None:
    if not src_ids or not dst_ids:
        raise ValueError(f"[{call}] block lists can not be empty")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"[{call}] src_blocks has {len(src_ids)} ids, dst_blocks {len(dst_ids)}")
    for name, ids, side, local in (("src", src_ids, src, local_is_src), ("dst", dst_ids, dst, not local_is_src)):
        bad = next((i for i in ids if not 0 <= i < side.batches), None)
        if bad is not None:
            msg = f"[{call}] {name} index {bad} is outside [0, {side.batches}) of the {side.what}"
            if local:
                raise ValueError(msg)
            raise LLMException(msg, S.LLM_PARAM_INVALID)
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError(f"[{call}] dst names a block twice")


def _placements(dd: Any, call: str, src: _Side, dst: _Side, link: _links.LinkRec, blocks_call: bool,
                local_is_src: bool) -> None:
    if src.placement == "HOST" and dst.placement == "HOST":
        raise LLMException(f"[{call}] host to host is not supported", S.LLM_PARAM_INVALID)
    if src.placement == "HOST" and dst.placement == "DEVICE":
        need = "blocks" if blocks_call else "contiguous"
        if src.blocks != blocks_call or dst.blocks != blocks_call:
            raise LLMException(f"[{call}] host to device moves only between two {need} caches", S.LLM_PARAM_INVALID)
    if src.batch_bytes != dst.batch_bytes or src.data_type != dst.data_type:
        raise LLMException(f"[{call}] src and dst differ: {src.batch_bytes} vs {dst.batch_bytes} bytes per block, "
                           f"{src.data_type} vs {dst.data_type}", S.LLM_PARAM_INVALID)
    for side, local in ((src, local_is_src), (dst, not local_is_src)):
        if side.placement == "HOST":
            if not side.remote_accessible:
                raise LLMException(f"[{call}] the {side.what} is host memory registered without "
                                   "remote_accessible=True", S.LLM_PARAM_INVALID)
            pool = dd._mem_pool if local else _links.peer_mem_pool(link.remote)
            if not pool or pool < MIN_MEM_POOL:
                raise LLMException(f"[{call}] the {side.what} is host memory: its cluster needs a device memory pool of "
                                   f"at least 100 MB (llm.MemPoolConfig), has {pool or 0} bytes",
                                   S.LLM_FEATURE_NOT_ENABLED)
        elif side.seq >= link.seq:
            code = S.LLM_PARAM_INVALID if local else S.LLM_KV_CACHE_NOT_EXIST
            raise LLMException(f"[{call}] the {side.what} is device memory registered after the link: register "
                               "every device cache before link_clusters", code)
        for loc in side.locations:
            if not _memory.reachable(loc):
                raise LLMException(f"[{call}] stand-in limit: the {side.what} is private host memory of process "
                                   f"{loc['pid']}", S.LLM_FAILED)


def _wait(dd: Any, link: _links.LinkRec, call: str) -> None:
    """The injected stall of ``call`` (knob ``stall_ms``), bounded by sync_kv_timeout."""
    stall = knobs().get("stall_ms", {}).get(call, 0) / 1000
    if not stall:
        return
    start = time.monotonic()
    end, timeout_at = start + stall, start + dd._sync_kv_timeout_s
    while True:
        t = time.monotonic()
        if t >= timeout_at:
            link.broken = f"timed out in {call} after {dd._sync_kv_timeout_s * 1000:.0f} ms (sync_kv_timeout)"
            raise LLMException(f"[{call}] link {dd.cluster_id}->{link.remote}: {link.broken}", S.LLM_TIMEOUT)
        if t >= end:
            return
        _links.check_link(dd, link, call)
        time.sleep(min(STALL_SLICE_S, end - t, timeout_at - t))


def _move(dd: Any, link: _links.LinkRec, call: str, src: _Side, dst: _Side, src_t: Sequence[int],
          dst_t: Sequence[int], pairs: Sequence[Tuple[int, int]], nbytes: int) -> None:
    _wait(dd, link, call)
    bb = src.batch_bytes
    for st, dt in zip(src_t, dst_t):
        s_loc, d_loc = src.locations[st], dst.locations[dt]
        for s, d in pairs:
            _memory.write(d_loc, d * bb, _memory.read(s_loc, s * bb, nbytes))
    count("transfer_bytes", len(src_t) * len(pairs) * nbytes)
    _links.check_link(dd, link, call)  # a peer that died meanwhile: nothing it sent counts


def pull_blocks(mgr: Any, src_cache_key: Any, dst_cache: Any, src_blocks: Any = (), dst_blocks: Any = (),
                **kwargs: Any) -> None:
    dd = mgr._owner
    if not isinstance(src_cache_key, BlocksCacheKey):
        if isinstance(src_cache_key, (CacheKey, CacheKeyByIdAndIndex)):
            raise NotImplementedError("stand-in limit: pull_blocks models only a BlocksCacheKey source")
        check_type("src_cache_key", src_cache_key, BlocksCacheKey)
    extra = set(kwargs) - {"src_layer_range", "dst_layer_range", "tensor_num_per_layer"}
    if extra:
        raise ValueError(f"pull_blocks got unsupported arguments {sorted(extra)}")
    dst = _Side.local(mgr, dst_cache, "dst")
    src_ids, dst_ids = _ids("src_blocks", src_blocks), _ids("dst_blocks", dst_blocks)
    with _links.using(dd, src_cache_key.cluster_id, "pull_blocks") as link:
        key = (src_cache_key.cluster_id, src_cache_key.model_id)
        src = _Side.remote(_registry.find_cache(_registry.read(), key[0], blocks_key=key), f"BlocksCacheKey{key}")
        tnpl = _tnpl(kwargs.get("tensor_num_per_layer", 2), src, dst)
        src_t, dst_t = _tensors("pull_blocks", src, dst, kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"),
                                tnpl, same_range=False)
        _pairs("pull_blocks", src, dst, src_ids, dst_ids, local_is_src=False)
        _placements(dd, "pull_blocks", src, dst, link, True, local_is_src=False)
        _move(dd, link, "pull_blocks", src, dst, src_t, dst_t, list(zip(src_ids, dst_ids)), src.batch_bytes)


def push_blocks(mgr: Any, dst_cache_key: Any, src_cache: Any, src_blocks: Any = (), dst_blocks: Any = (),
                src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
                tensor_num_per_layer: int = 2) -> None:
    dd = mgr._owner
    check_type("dst_cache_key", dst_cache_key, BlocksCacheKey)
    src = _Side.local(mgr, src_cache, "src")
    src_ids, dst_ids = _ids("src_blocks", src_blocks), _ids("dst_blocks", dst_blocks)
    with _links.using(dd, dst_cache_key.cluster_id, "push_blocks") as link:
        key = (dst_cache_key.cluster_id, dst_cache_key.model_id)
        dst = _Side.remote(_registry.find_cache(_registry.read(), key[0], blocks_key=key), f"BlocksCacheKey{key}")
        tnpl = _tnpl(tensor_num_per_layer, src, dst)
        src_t, dst_t = _tensors("push_blocks", src, dst, src_layer_range, dst_layer_range, tnpl, same_range=True)
        _pairs("push_blocks", src, dst, src_ids, dst_ids, local_is_src=True)
        _placements(dd, "push_blocks", src, dst, link, True, local_is_src=True)
        _move(dd, link, "push_blocks", src, dst, src_t, dst_t, list(zip(src_ids, dst_ids)), src.batch_bytes)


def _batch(call: str, side: _Side, index: int, local: bool) -> None:
    check_type("batch_index", index, int)
    if not 0 <= index < side.batches:
        msg = f"[{call}] batch index {index} is outside [0, {side.batches}) of the {side.what}"
        if local:
            raise ValueError(msg)
        raise LLMException(msg, S.LLM_PARAM_INVALID)


def push_cache(mgr: Any, dst_cache_key: Any, src_cache: Any, src_batch_index: int = 0,
               src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None, size: int = -1,
               tensor_num_per_layer: int = 2) -> None:
    dd = mgr._owner
    check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
    check_type("size", size, int)
    if size != -1:
        raise ValueError(f"size {size}: push_cache supports only -1 (one whole KV)")
    src = _Side.local(mgr, src_cache, "src")
    _batch("push_cache", src, src_batch_index, local=True)
    key = dst_cache_key
    with _links.using(dd, key.cluster_id, "push_cache") as link:
        dst = _Side.remote(_registry.find_cache(_registry.read(), key.cluster_id, cache_id=key.cache_id),
                           f"{key.cluster_id}/{key.cache_id}")
        tnpl = _tnpl(tensor_num_per_layer, src, dst)
        src_t, dst_t = _tensors("push_cache", src, dst, src_layer_range, dst_layer_range, tnpl, same_range=True)
        _batch("push_cache", dst, key.batch_index, local=False)
        _placements(dd, "push_cache", src, dst, link, False, local_is_src=True)
        _move(dd, link, "push_cache", src, dst, src_t, dst_t, [(src_batch_index, key.batch_index)], src.batch_bytes)


def pull_cache(mgr: Any, cache_key: Any, cache: Any, batch_index: int = 0, size: int = -1, **kwargs: Any) -> None:
    dd = mgr._owner
    check_type("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
    check_type("size", size, int)
    extra = set(kwargs) - {"src_layer_range", "dst_layer_range", "tensor_num_per_layer"}
    if extra:
        raise ValueError(f"pull_cache got unsupported arguments {sorted(extra)}")
    dst = _Side.local(mgr, cache, "dst")
    _batch("pull_cache", dst, batch_index, local=True)
    with _links.using(dd, cache_key.cluster_id, "pull_cache") as link:
        table = _registry.read()
        if isinstance(cache_key, CacheKey):
            entry, remote_batch = _registry.find_cache(table, cache_key.cluster_id, cache_key=cache_key.wire()), 0
        else:
            entry = _registry.find_cache(table, cache_key.cluster_id, cache_id=cache_key.cache_id)
            remote_batch = cache_key.batch_index
        src = _Side.remote(entry, repr(cache_key))
        tnpl = _tnpl(kwargs.get("tensor_num_per_layer", 2), src, dst)
        src_t, dst_t = _tensors("pull_cache", src, dst, kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"),
                                tnpl, same_range=False)
        _batch("pull_cache", src, remote_batch, local=False)
        _placements(dd, "pull_cache", src, dst, link, False, local_is_src=False)
        if size != -1 and not 0 < size <= src.batch_bytes:
            raise ValueError(f"size {size} must be -1 or in (0, {src.batch_bytes}]")
        n = src.batch_bytes if size == -1 else size
        _move(dd, link, "pull_cache", src, dst, src_t, dst_t, [(remote_batch, batch_index)], n)
