"""``KVCacheType`` and ``CcConfig_v1`` of the EMS contract stand-in (tests only; not the Huawei SDK).

``CcConfig_v1`` checks its fields when built and again at ``Ems.init`` (its attributes may be
reassigned in between, ``kvcache_type`` always is for MLA models): the rank/device/world-size
fields are ``int`` >= 0 (``bool`` rejected), ``rank_in_tp_group < tp_world_size``,
``rank_in_pp_group < pp_world_size``, ``model_id`` and ``llm_engine`` are non-empty ``str`` and
``kvcache_type`` is a ``KVCacheType``.  A violation raises ``EmsException(EMS_INVALID_ARGUMENT)``.
"""
from __future__ import annotations

from enum import Enum

from ..errors import invalid
from ..options import is_int

_INT_FIELDS = ("rank_id", "device_id", "tp_world_size", "pp_world_size", "rank_in_tp_group", "rank_in_pp_group")


class KVCacheType(Enum):
    """What one registered layer holds: ``[K, V]`` (MHA, the default) or ``[K]`` (MLA)."""

    MHA = 0
    MLA = 1

    @property
    def tensors_per_layer(self) -> int:
        return 2 if self is KVCacheType.MHA else 1


class CcConfig_v1:  # noqa: N801 -- the SDK's spelling
    """ContextCaching V1 configuration of one rank."""

    def __init__(self, rank_id: int, device_id: int, model_id: str, tp_world_size: int = 1, pp_world_size: int = 1,
                 rank_in_tp_group: int = 0, rank_in_pp_group: int = 0, llm_engine: str = "vllm") -> None:
        self.rank_id = rank_id
        self.device_id = device_id
        self.model_id = model_id
        self.tp_world_size = tp_world_size
        self.pp_world_size = pp_world_size
        self.rank_in_tp_group = rank_in_tp_group
        self.rank_in_pp_group = rank_in_pp_group
        self.llm_engine = llm_engine
        self.kvcache_type = KVCacheType.MHA
        self.validate()

    def validate(self) -> None:
        """Raise ``EMS_INVALID_ARGUMENT`` naming the first bad field."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise invalid(f"CcConfig_v1 {name} must be an int >= 0, got {value!r}")
        for name in ("model_id", "llm_engine"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise invalid(f"CcConfig_v1 {name} must be a non-empty str, got {value!r}")
        if not self.rank_in_tp_group < self.tp_world_size:
            raise invalid(f"CcConfig_v1 rank_in_tp_group {self.rank_in_tp_group} must be < tp_world_size "
                          f"{self.tp_world_size}")
        if not self.rank_in_pp_group < self.pp_world_size:
            raise invalid(f"CcConfig_v1 rank_in_pp_group {self.rank_in_pp_group} must be < pp_world_size "
                          f"{self.pp_world_size}")
        if not isinstance(self.kvcache_type, KVCacheType):
            raise invalid(f"CcConfig_v1 kvcache_type must be a KVCacheType, got {self.kvcache_type!r}")

    def key(self) -> tuple:
        """Every field, for comparing two configurations."""
        return tuple(getattr(self, name) for name in _INT_FIELDS + ("model_id", "llm_engine", "kvcache_type"))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in
                           ("rank_id", "device_id", "model_id") + _INT_FIELDS[2:] + ("llm_engine", "kvcache_type"))
        return f"CcConfig_v1({fields})"
