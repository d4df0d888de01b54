"""``CacheManager`` in the stand-in (tests only): registration with the documented limits,
``swap_blocks``, and the P/D transfers of ``_transfer`` (see the package docstring for the contract)."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import acl
from acl._shared import is_device_address

from . import _memory, _registry, _swap, _transfer
from ._pd_types import CacheKey
from ._state import counted, knobs
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    check_blocks_desc,
    check_int_list,
    check_type,
    is_int,
)

MAX_REGISTERED_ADDRESSES = 256  # register_cache + register_blocks_cache, per LLMDataDist (240 in some releases)
MAX_DEVICE_BYTES = 50 * 10**9  # "50 GB" of registered device memory (decimal: the stricter reading)
MAX_HOST_BYTES = 20 * 10**9  # "20 GB" of registered host memory


def _none(name: str, value: Any) -> None:
    """The vendor's Python layer dereferences before it checks types: None is an AttributeError."""
    if value is None:
        raise AttributeError(f"'NoneType' object ({name}) has no attribute to read")


class CacheManager:
    """What ``LLMDataDist.cache_manager`` returns once init enabled it."""

    def __init__(self, owner: Any):
        self._owner = owner
        self._lock = threading.RLock()
        self._caches: Dict[int, Cache] = {}
        self._next_id = 1
        self._live = True

    # -- registration ----------------------------------------------------------------
    def _check_live(self, call: str) -> None:
        if not self._live:
            raise LLMException(f"[{call}] LLMDataDist was finalised", LLMStatusCode.LLM_NOT_INITIALIZED)

    def registered(self) -> tuple[int, int, int]:
        """(addresses, device bytes, host bytes) registered now."""
        with self._lock:
            caches = list(self._caches.values())
        n = sum(len(c.tensor_addrs) for c in caches)
        dev = sum(c.cache_desc.size * c.cache_desc.num_tensors for c in caches if c.cache_desc.placement == Placement.DEVICE)
        host = sum(c.cache_desc.size * c.cache_desc.num_tensors for c in caches if c.cache_desc.placement == Placement.HOST)
        return n, dev, host

    def caches(self) -> List[Cache]:
        with self._lock:
            return list(self._caches.values())

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: List[int],
                              blocks_cache_key: Optional[BlocksCacheKey] = None,
                              remote_accessible: Optional[bool] = None) -> Cache:
        with counted("register_blocks_cache"):
            check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
            if blocks_cache_key is not None and self._owner.role != LLMRole.PROMPT:
                raise ValueError("blocks_cache_key may be set only when the LLMRole is PROMPT")
            return self._register("register_blocks_cache", cache_desc, addrs, remote_accessible, True,
                                  blocks_cache_key, [])

    def register_cache(self, cache_desc: CacheDesc, addrs: List[int], cache_keys: Any = (),
                       remote_accessible: Optional[bool] = None) -> Cache:
        """A contiguous (non-PagedAttention) cache, optionally bound to ``CacheKey`` s."""
        with counted("register_cache"):
            check_type("cache_keys", cache_keys, (list, tuple))
            for i, key in enumerate(cache_keys):
                if not isinstance(key, CacheKey):
                    raise TypeError(f"cache_keys[{i}] must be CacheKey, got {type(key).__name__}")
            bound = {tuple(k.wire()) for c in self.caches() for k in c._cache_keys}
            for key in cache_keys:
                if tuple(key.wire()) in bound:
                    raise LLMException(f"[register_cache] {key} is already bound to a cache",
                                       LLMStatusCode.LLM_REPEAT_REQUEST)
            return self._register("register_cache", cache_desc, addrs, remote_accessible, False, None,
                                  list(cache_keys))

    def _register(self, call: str, cache_desc: CacheDesc, addrs: List[int], remote_accessible: Optional[bool],
                  blocks: bool, blocks_key: Optional[BlocksCacheKey], cache_keys: List[CacheKey]) -> Cache:
        self._check_live(call)
        _none("cache_desc", cache_desc)
        _none("addrs", addrs)
        check_type("cache_desc", cache_desc, CacheDesc)
        check_int_list("addrs", addrs)
        check_type("remote_accessible", remote_accessible, bool, allow_none=True)
        if not addrs:
            raise ValueError("addrs can not be empty")
        if len(addrs) != cache_desc.num_tensors:
            raise ValueError(f"addrs has {len(addrs)} addresses, cache_desc.num_tensors is {cache_desc.num_tensors}")
        check_blocks_desc(cache_desc)  # contiguous caches too: dim 0 batches, no empty dimension
        for i, addr in enumerate(addrs):
            if addr == 0:
                raise ValueError(f"addrs[{i}] can not be zero")
        with self._lock:
            if blocks_key is not None and any(c._blocks_key is not None and (c._blocks_key.cluster_id, c._blocks_key.model_id)
                                              == (blocks_key.cluster_id, blocks_key.model_id) for c in self._caches.values()):
                raise LLMException(f"[{call}] BlocksCacheKey({blocks_key.cluster_id}, {blocks_key.model_id}) already "
                                   "names a cache", LLMStatusCode.LLM_REPEAT_REQUEST)
            self._check_limits(call, cache_desc)
            locations = self._locations(call, cache_desc, addrs)
            cache = Cache(self._next_id, cache_desc, addrs, self, True, blocks)
            cache._seq = _registry.now()
            cache._locations = locations
            cache._blocks_key, cache._cache_keys = blocks_key, cache_keys
            if remote_accessible is not None:  # default: device memory yes, host memory no
                cache._remote_accessible = remote_accessible
            self._next_id += 1
            self._caches[cache.cache_id] = cache
        if self._owner._published:
            _registry.publish_cache(self._owner.cluster_id, cache)
        return cache

    def _check_limits(self, call: str, desc: CacheDesc) -> None:
        n, dev, host = self.registered()
        limit = knobs().get("max_addresses", MAX_REGISTERED_ADDRESSES)
        if n + desc.num_tensors > limit:
            raise LLMException(f"[{call}] at most {limit} tensor addresses may be registered "
                               f"(register_cache + register_blocks_cache); {n} are, {desc.num_tensors} more asked",
                               LLMStatusCode.LLM_EXCEED_LIMIT)
        nbytes = desc.size * desc.num_tensors
        if desc.placement == Placement.DEVICE and dev + nbytes > MAX_DEVICE_BYTES:
            raise LLMException(f"[{call}] at most 50 GB of device memory may be registered; "
                               f"{dev} bytes are, {nbytes} more asked", LLMStatusCode.LLM_EXCEED_LIMIT)
        if desc.placement == Placement.HOST and host + nbytes > MAX_HOST_BYTES:
            raise LLMException(f"[{call}] at most 20 GB of host memory may be registered; "
                               f"{host} bytes are, {nbytes} more asked", LLMStatusCode.LLM_EXCEED_LIMIT)

    def _locations(self, call: str, desc: CacheDesc, addrs: List[int]) -> List[dict]:
        """Each tensor's whole range must be memory of that placement (device: of this process, on
        the device LLMDataDist was initialised on); where its bytes are, for peers (``_memory``)."""
        size, out = desc.size, []
        for i, addr in enumerate(addrs):
            if desc.placement == Placement.HOST:
                if is_device_address(addr) or addr < 0:
                    raise LLMException(f"[{call}] addrs[{i}] {addr:#x} is not host memory",
                                       LLMStatusCode.LLM_PARAM_INVALID)
                out.append(_memory.host_location(addr, size))
                continue
            loc = _memory.device_location(addr, size, self._owner.device_id)
            if loc is None:
                raise LLMException(f"[{call}] addrs[{i}] {addr:#x}: {size} bytes are not device memory "
                                   f"of this process on device {self._owner.device_id}", LLMStatusCode.LLM_PARAM_INVALID)
            out.append(loc)
        return out

    def unregister_cache(self, cache_id: int) -> None:
        with counted("unregister_cache"):
            self._check_live("unregister_cache")
            check_type("cache_id", cache_id, int)
            with self._lock:
                cache = self._caches.pop(cache_id, None)
            if cache is None:
                raise LLMException(f"[unregister_cache] cache_id {cache_id} is not registered", LLMStatusCode.LLM_PARAM_INVALID)
            cache._valid = False
            if self._owner._published:
                _registry.withdraw_cache(self._owner.cluster_id, cache_id)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind ``cache_key``: ``pull_cache`` no longer finds it (a key not bound is a no-op)."""
        with counted("remove_cache_key"):
            self._check_live("remove_cache_key")
            _none("cache_key", cache_key)
            check_type("cache_key", cache_key, CacheKey)
            if self._owner.role != LLMRole.PROMPT:
                raise LLMException("[remove_cache_key] may be called only when the LLMRole is PROMPT",
                                   LLMStatusCode.LLM_PARAM_INVALID)
            with self._lock:
                hit = [c for c in self._caches.values() if cache_key.wire() in [k.wire() for k in c._cache_keys]]
                for c in hit:
                    c._cache_keys = [k for k in c._cache_keys if k.wire() != cache_key.wire()]
            if hit and self._owner._published:
                for c in hit:
                    _registry.publish_cache(self._owner.cluster_id, c)

    # -- transfers between clusters (``_transfer``) --------------------------------------
    def pull_blocks(self, src_cache_key: Any, dst_cache: Cache, src_blocks: Any = (), dst_blocks: Any = (),
                    **kwargs: Any) -> None:
        with counted("pull_blocks"):
            self._check_live("pull_blocks")
            _transfer.pull_blocks(self, src_cache_key, dst_cache, src_blocks, dst_blocks, **kwargs)

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Any = (), dst_blocks: Any = (),
                    src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
                    tensor_num_per_layer: int = 2) -> None:
        with counted("push_blocks"):
            self._check_live("push_blocks")
            _transfer.push_blocks(self, dst_cache_key, src_cache, src_blocks, dst_blocks, src_layer_range,
                                  dst_layer_range, tensor_num_per_layer)

    def push_cache(self, dst_cache_key: Any, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None, size: int = -1,
                   tensor_num_per_layer: int = 2) -> None:
        with counted("push_cache"):
            self._check_live("push_cache")
            _transfer.push_cache(self, dst_cache_key, src_cache, src_batch_index, src_layer_range, dst_layer_range,
                                 size, tensor_num_per_layer)

    def pull_cache(self, cache_key: Any, cache: Cache, batch_index: int = 0, size: int = -1, **kwargs: Any) -> None:
        with counted("pull_cache"):
            self._check_live("pull_cache")
            _transfer.pull_cache(self, cache_key, cache, batch_index, size, **kwargs)

    def _close(self) -> None:
        with self._lock:
            for cache in self._caches.values():
                cache._valid = False
            self._caches.clear()
            self._live = False

    # -- swap --------------------------------------------------------------------------
    def swap_blocks(self, src: Cache, dst: Cache, src_to_dst: Dict[int, int]) -> None:
        with counted("swap_blocks"):
            self._check_live("swap_blocks")
            pairs = self._verify(src, dst, src_to_dst)
            dev, ret = acl.rt.get_device()
            if ret != 0 or dev != self._owner.device_id:
                raise LLMException(f"[swap_blocks] the calling thread is bound to device {dev if ret == 0 else None} "
                                   f"(aclError {ret}), LLMDataDist to device {self._owner.device_id}: "
                                   f"acl.rt.set_device first", LLMStatusCode.LLM_FAILED)
            block = src.cache_desc.size // src.cache_desc.batch_size
            if src.cache_desc.placement == Placement.DEVICE:
                _swap.swap_out(src, dst, pairs, block)
            else:
                _swap.swap_in(src, dst, pairs, block, knobs().get("staging_blocks", _swap.DEFAULT_STAGING_BLOCKS))

    def _verify(self, src: Cache, dst: Cache, src_to_dst: Dict[int, int]) -> list[tuple[int, int]]:
        for name, cache in (("src", src), ("dst", dst)):
            _none(name, cache)
            check_type(name, cache, Cache)
            if not cache.is_blocks_cache:
                raise ValueError(f"{name} cache should be a blocks cache")
            if not cache._valid:
                raise ValueError(f"{name} cache {cache.cache_id} was unregistered or its LLMDataDist finalised")
            if cache._owner is not None and cache._owner is not self:
                raise ValueError(f"{name} cache {cache.cache_id} was registered on another LLMDataDist")
        _none("src_to_dst", src_to_dst)
        check_type("src_to_dst", src_to_dst, dict)
        for k, v in src_to_dst.items():
            if not is_int(k) or not is_int(v):
                raise TypeError(f"src_to_dst must map int to int, got {k!r} ({type(k).__name__}): "
                                f"{v!r} ({type(v).__name__})")
        sd, dd = src.cache_desc, dst.cache_desc
        src_block, dst_block = sd.size // sd.batch_size, dd.size // dd.batch_size
        if src_block != dst_block:
            raise ValueError(f"src block size:{src_block} and dst block size:{dst_block} must be equal")
        if sd.num_tensors != dd.num_tensors:
            raise ValueError(f"src num_tensors:{sd.num_tensors} and dst num_tensors:{dd.num_tensors} must be equal")
        if sd.data_type != dd.data_type:
            raise ValueError(f"src data_type:{sd.data_type} and dst data_type:{dd.data_type} must be equal")
        swap_in = sd.placement == Placement.HOST and dd.placement == Placement.DEVICE
        swap_out = sd.placement == Placement.DEVICE and dd.placement == Placement.HOST
        if not (swap_in or swap_out):
            raise ValueError(f"swap src placement:{sd.placement} to dst placement:{dd.placement} is not supported")
        seen: dict[int, int] = {}
        for s, d in src_to_dst.items():
            if not 0 <= s < sd.batch_size:
                raise ValueError(f"src_block_index:{s} must be in [0, {sd.batch_size})")
            if not 0 <= d < dd.batch_size:
                raise ValueError(f"dst_block_index:{d} must be in [0, {dd.batch_size})")
            if d in seen:
                raise ValueError(f"dst_block_index:{d} is the destination of src blocks {seen[d]} and {s}")
            seen[d] = s
        return list(src_to_dst.items())
