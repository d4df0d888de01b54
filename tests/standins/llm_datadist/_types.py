"""Value types of the LLM-DataDist stand-in (tests only): roles, placements, data types, the
exception, ``CacheDesc``, ``BlocksCacheKey`` and ``Cache`` (``KvCache`` in older releases).

Argument checks follow the published Python layer of ``llm_datadist``: a wrong type is
``TypeError``, a wrong value ``ValueError``; what the runtime below refuses is ``LLMException``.
"""
from __future__ import annotations

import math
from enum import Enum
from typing import Any, List, Optional

INT64_MAX = (1 << 63) - 1
UINT32_MAX = (1 << 32) - 1


class LLMRole(Enum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(Enum):
    HOST = 0
    DEVICE = 1


class DataType(Enum):
    """GE's data type codes (``ge::DataType``) for the types a KV cache uses."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_BF16 = 27


ITEMSIZE = {
    DataType.DT_FLOAT: 4, DataType.DT_FLOAT16: 2, DataType.DT_INT8: 1, DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1, DataType.DT_INT16: 2, DataType.DT_UINT16: 2, DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8, DataType.DT_UINT64: 8, DataType.DT_DOUBLE: 8, DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}


class LLMStatusCode(Enum):
    """Status names of the stand-in's refusals (the vendor's numeric codes are not reproduced)."""

    LLM_SUCCESS = 0
    LLM_FAILED = 1
    LLM_PARAM_INVALID = 2
    LLM_NOT_INITIALIZED = 3
    LLM_DEVICE_OUT_OF_MEMORY = 4
    LLM_EXCEED_LIMIT = 5
    LLM_INJECTED_FAULT = 6
    # The documented names of the P/D calls (LLMStatusCode.md); the numbers are the stand-in's own.
    LLM_KV_CACHE_NOT_EXIST = 7
    LLM_REPEAT_REQUEST = 8
    LLM_NOT_YET_LINK = 9
    LLM_ALREADY_LINK = 10
    LLM_LINK_FAILED = 11
    LLM_UNLINK_FAILED = 12
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 13
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 14
    LLM_PROCESSING_LINK = 15
    LLM_FEATURE_NOT_ENABLED = 16
    LLM_TIMEOUT = 17
    LLM_LINK_BUSY = 18
    LLM_OUT_OF_MEMORY = 19


class LLMException(RuntimeError):
    """What the runtime under the Python layer refuses; ``status_code`` says why."""

    def __init__(self, message: str, status_code: LLMStatusCode = LLMStatusCode.LLM_FAILED):
        super().__init__(f"{message} (status {status_code.name})")
        self.status_code = status_code


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_type(name: str, value: Any, types: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, types) or (types is int and isinstance(value, bool)):
        kinds = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise TypeError(f"{name} must be {kinds}, got {type(value).__name__}")


def check_int_list(name: str, values: Any) -> None:
    check_type(name, values, (list, tuple) if name == "shape" else list)
    for i, v in enumerate(values):
        if not is_int(v):
            raise TypeError(f"{name}[{i}] must be int, got {type(v).__name__}")


class CacheDesc:
    """``CacheDesc(num_tensors, shape, data_type, placement=Placement.DEVICE, batch_dim_index=0,
    seq_len_dim_index=-1, kv_tensor_format=None)``: every tensor of a cache has this shape."""

    def __init__(self, num_tensors: int, shape: Any, data_type: DataType, placement: Placement = Placement.DEVICE,
                 batch_dim_index: int = 0, seq_len_dim_index: int = -1, kv_tensor_format: Optional[str] = None):
        check_type("num_tensors", num_tensors, int)
        if not 0 <= num_tensors <= UINT32_MAX:
            raise ValueError(f"num_tensors {num_tensors} must be in [0, 2**32)")
        check_int_list("shape", shape)
        check_type("data_type", data_type, DataType)
        check_type("placement", placement, Placement)
        check_type("batch_dim_index", batch_dim_index, int)
        check_type("seq_len_dim_index", seq_len_dim_index, int)
        check_type("kv_tensor_format", kv_tensor_format, str, allow_none=True)
        if not 0 <= batch_dim_index < len(shape):
            raise ValueError(f"batch_dim_index {batch_dim_index} out of range [0, {len(shape)})")
        if seq_len_dim_index != -1 and not 0 <= seq_len_dim_index < len(shape):
            raise ValueError(f"seq_len_dim_index {seq_len_dim_index} must be -1 or in [0, {len(shape)})")
        if any(not 0 <= d <= INT64_MAX for d in shape):
            raise ValueError(f"shape {list(shape)} has a dimension outside [0, 2**63)")
        self._num_tensors = num_tensors
        self._shape = list(shape)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    num_tensors = property(lambda self: self._num_tensors)
    shape = property(lambda self: list(self._shape))
    data_type = property(lambda self: self._data_type)
    placement = property(lambda self: self._placement)
    batch_dim = property(lambda self: self._batch_dim)
    seq_len_dim_index = property(lambda self: self._seq_len_dim_index)
    kv_tensor_format = property(lambda self: self._kv_tensor_format)

    @property
    def batch_size(self) -> int:
        return self._shape[self._batch_dim]

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        return math.prod(self._shape) * ITEMSIZE[self._data_type]

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, data_type={self._data_type}, "
                f"placement={self._placement})")


class BlocksCacheKey:
    """``BlocksCacheKey(prompt_cluster_id, model_id=0)`` (also ``cluster_id=``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        if len(args) + len(kwargs) > 2:
            raise ValueError("BlocksCacheKey takes at most 2 parameters")
        if args:
            kwargs["cluster_id"] = args[0]
        if len(args) > 1:
            kwargs["model_id"] = args[1]
        unknown = set(kwargs) - {"prompt_cluster_id", "cluster_id", "model_id"}
        if unknown:
            raise ValueError(f"unsupported BlocksCacheKey parameter {sorted(unknown)[0]!r}")
        if "cluster_id" not in kwargs and "prompt_cluster_id" not in kwargs:
            raise ValueError("BlocksCacheKey needs prompt_cluster_id (or cluster_id)")
        self.cluster_id = kwargs.get("cluster_id", kwargs.get("prompt_cluster_id"))
        self.model_id = kwargs.get("model_id", 0)
        check_type("cluster_id", self.cluster_id, int)
        check_type("model_id", self.model_id, int)

    @property
    def prompt_cluster_id(self) -> int:
        return self.cluster_id


class Cache:
    """A blocks cache: registered device (or host) memory from ``register_blocks_cache``, or host
    memory wrapped by ``Cache.create_cpu_cache``.  Users do not construct it."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: List[int], owner: Any,
                 is_registered: bool, is_blocks_cache: bool = True):
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._owner = owner  # the CacheManager that registered it; None for a wrapped cpu cache
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache
        self._valid = True
        # Set by the registering CacheManager (the P/D calls): when it was registered (monotonic ns),
        # whether peers may use it, where each tensor's bytes are, and the keys that name it.
        self._seq = 0
        self._remote_accessible = cache_desc.placement == Placement.DEVICE
        self._locations: List[dict] = []
        self._blocks_key: Optional["BlocksCacheKey"] = None
        self._cache_keys: List[Any] = []

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    tensor_addrs = property(lambda self: list(self._tensor_addrs))
    is_blocks_cache = property(lambda self: self._is_blocks_cache)

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: List[int]) -> "Cache":
        """Wrap host memory the caller allocated (one address per tensor) as a swap target."""
        from ._state import counted

        with counted("create_cpu_cache"):
            check_type("cache_desc", cache_desc, CacheDesc)
            check_int_list("addrs", addrs)
            if cache_desc.placement != Placement.HOST:
                raise ValueError("cache_desc placement must be HOST")
            if cache_desc.num_tensors != len(addrs):
                raise ValueError(f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}")
            check_blocks_desc(cache_desc)
            for i, addr in enumerate(addrs):
                if addr <= 0:
                    raise ValueError(f"addrs[{i}] {addr:#x} is not a host address")
            return cls(-1, cache_desc, addrs, None, False, True)

    def __repr__(self) -> str:
        return f"Cache(cache_id = {self._cache_id}, tensor_addrs = {len(self._tensor_addrs)}, blocks = {self._is_blocks_cache})"


KvCache = Cache  # the name in CANN 8.0 / 8.1 releases


def check_blocks_desc(desc: CacheDesc) -> None:
    """PagedAttention only: ``[num_blocks, ...]`` with blocks on dim 0 and no empty dimension."""
    if desc.num_tensors <= 0:
        raise ValueError("num_tensors should be bigger than zero")
    if desc.batch_dim != 0:
        raise ValueError(f"a blocks cache has its blocks on dim 0, batch_dim_index is {desc.batch_dim}")
    if len(desc.shape) < 1 or any(d <= 0 for d in desc.shape):
        raise ValueError(f"a blocks cache needs shape [num_blocks, ...] with positive dimensions, got {desc.shape}")
