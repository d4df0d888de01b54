"""``LLMDataDist`` and its ``CacheManager`` in the stand-in (tests only): init, registration with
the documented limits, and ``swap_blocks`` (see the package docstring for the contract)."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import acl
from acl._local import local as _acl_local  # region lookup only: which device memory this process may name
from acl._shared import is_device_address

from . import _swap
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
OPTION_CACHE_MANAGER = "llm.EnableCacheManager"
OPTION_DEVICE_ID = "ge.exec.deviceId"
ACL_ERROR_REPEAT_INITIALIZE = 100002


def _none(name: str, value: Any) -> None:
    """The vendor's Python layer dereferences before it checks types: None is an AttributeError."""
    if value is None:
        raise AttributeError(f"'NoneType' object ({name}) has no attribute to read")


class LLMDataDist:
    """``LLMDataDist(role, cluster_id)``; ``init(options)``; ``cache_manager``; ``finalize()``."""

    def __init__(self, role: LLMRole, cluster_id: int):
        check_type("role", role, LLMRole)
        check_type("cluster_id", cluster_id, int)
        if not 0 <= cluster_id < 1 << 64:
            raise ValueError(f"cluster_id {cluster_id} must be in [0, 2**64)")
        self.role = role
        self.cluster_id = cluster_id
        self.device_id: Optional[int] = None
        self._options: Dict[str, str] = {}
        self._initialized = False
        self._manager: Optional[CacheManager] = None

    def init(self, options: Dict[str, str]) -> None:
        with counted("init"):
            _none("options", options)
            check_type("options", options, dict)
            for k, v in options.items():
                if not isinstance(k, str) or not isinstance(v, str):
                    raise TypeError(f"options must map str to str, got {k!r}: {v!r}")
            if self._initialized:
                raise LLMException("LLMDataDist is already initialised", LLMStatusCode.LLM_FAILED)
            raw = options.get(OPTION_DEVICE_ID)
            if raw is None or not raw.strip().isdigit():
                raise ValueError(f"option {OPTION_DEVICE_ID!r} must name the device (a non-negative integer string), "
                                 f"got {raw!r}")
            if options.get(OPTION_CACHE_MANAGER, "0") not in ("0", "1"):
                raise ValueError(f"option {OPTION_CACHE_MANAGER!r} must be '0' or '1'")
            ret = acl.init()  # the runtime under LLM-DataDist shares the process's ACL
            if ret not in (0, ACL_ERROR_REPEAT_INITIALIZE):
                raise LLMException(f"[init] acl.init failed with aclError {ret}")
            devices, ret = acl.rt.get_device_count()
            if ret != 0 or not 0 <= int(raw) < devices:
                raise LLMException(f"[init] device {raw} does not exist ({devices} devices)", LLMStatusCode.LLM_PARAM_INVALID)
            self.device_id = int(raw)
            self._options = dict(options)
            self._initialized = True
            if options.get(OPTION_CACHE_MANAGER) == "1":
                self._manager = CacheManager(self)

    @property
    def cache_manager(self) -> "CacheManager":
        with counted("cache_manager"):
            if not self._initialized:
                raise LLMException("LLMDataDist.init has not been called", LLMStatusCode.LLM_NOT_INITIALIZED)
            if self._manager is None:
                raise LLMException(f"the cache manager needs option {OPTION_CACHE_MANAGER!r} = '1' at init",
                                   LLMStatusCode.LLM_FAILED)
            return self._manager

    def finalize(self) -> None:
        with counted("finalize"):
            if self._manager is not None:
                self._manager._close()
            self._manager = None
            self._initialized = False


class CacheManager:
    """What ``LLMDataDist.cache_manager`` returns once init enabled it."""

    def __init__(self, owner: LLMDataDist):
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

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: List[int],
                              blocks_cache_key: Optional[BlocksCacheKey] = None,
                              remote_accessible: Optional[bool] = None) -> Cache:
        with counted("register_blocks_cache"):
            self._check_live("register_blocks_cache")
            _none("cache_desc", cache_desc)
            _none("addrs", addrs)
            check_type("cache_desc", cache_desc, CacheDesc)
            check_int_list("addrs", addrs)
            check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
            check_type("remote_accessible", remote_accessible, bool, allow_none=True)
            if blocks_cache_key is not None and self._owner.role != LLMRole.PROMPT:
                raise ValueError("blocks_cache_key may be set only when the LLMRole is PROMPT")
            if not addrs:
                raise ValueError("addrs can not be empty")
            if len(addrs) != cache_desc.num_tensors:
                raise ValueError(f"addrs has {len(addrs)} addresses, cache_desc.num_tensors is {cache_desc.num_tensors}")
            check_blocks_desc(cache_desc)
            for i, addr in enumerate(addrs):
                if addr == 0:
                    raise ValueError(f"addrs[{i}] can not be zero")
            with self._lock:
                self._check_limits(cache_desc)
                self._check_memory(cache_desc, addrs)
                cache = Cache(self._next_id, cache_desc, addrs, self, True, True)
                self._next_id += 1
                self._caches[cache.cache_id] = cache
            return cache

    def _check_limits(self, desc: CacheDesc) -> None:
        n, dev, host = self.registered()
        limit = knobs().get("max_addresses", MAX_REGISTERED_ADDRESSES)
        if n + desc.num_tensors > limit:
            raise LLMException(f"[register_blocks_cache] at most {limit} tensor addresses may be registered "
                               f"(register_cache + register_blocks_cache); {n} are, {desc.num_tensors} more asked",
                               LLMStatusCode.LLM_EXCEED_LIMIT)
        nbytes = desc.size * desc.num_tensors
        if desc.placement == Placement.DEVICE and dev + nbytes > MAX_DEVICE_BYTES:
            raise LLMException(f"[register_blocks_cache] at most 50 GB of device memory may be registered; "
                               f"{dev} bytes are, {nbytes} more asked", LLMStatusCode.LLM_EXCEED_LIMIT)
        if desc.placement == Placement.HOST and host + nbytes > MAX_HOST_BYTES:
            raise LLMException(f"[register_blocks_cache] at most 20 GB of host memory may be registered; "
                               f"{host} bytes are, {nbytes} more asked", LLMStatusCode.LLM_EXCEED_LIMIT)

    def _check_memory(self, desc: CacheDesc, addrs: List[int]) -> None:
        """Each tensor's whole range must be memory of that placement (device: of this process, on
        the device LLMDataDist was initialised on)."""
        size = desc.size
        for i, addr in enumerate(addrs):
            if desc.placement == Placement.HOST:
                if is_device_address(addr) or addr < 0:
                    raise LLMException(f"[register_blocks_cache] addrs[{i}] {addr:#x} is not host memory",
                                       LLMStatusCode.LLM_PARAM_INVALID)
                continue
            region = _acl_local().region_at(addr)
            if region is None or region.dev != self._owner.device_id or addr + size > region.end:
                raise LLMException(f"[register_blocks_cache] addrs[{i}] {addr:#x}: {size} bytes are not device memory "
                                   f"of this process on device {self._owner.device_id}", LLMStatusCode.LLM_PARAM_INVALID)

    def unregister_cache(self, cache_id: int) -> None:
        with counted("unregister_cache"):
            self._check_live("unregister_cache")
            check_type("cache_id", cache_id, int)
            with self._lock:
                cache = self._caches.pop(cache_id, None)
            if cache is None:
                raise LLMException(f"[unregister_cache] cache_id {cache_id} is not registered", LLMStatusCode.LLM_PARAM_INVALID)
            cache._valid = False

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
