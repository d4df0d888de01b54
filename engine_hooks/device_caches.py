"""The engine's device caches: allocated per rank, per layer and kind, exported by FastDeploy name.

On the CPU platform this stands in for the model runner, which owns the device caches
on a real accelerator; the CTMs only ever attach to them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cache_manager.cache_data import cache_name
from ops.platform import Platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSpec:
    """Shapes and dtypes of one rank's caches (DESIGN §3.1)."""

    num_layers: int
    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    cache_dtype: str = "bfloat16"  # bfloat16, uint8 or block_wise_fp8
    default_dtype: str = "bfloat16"  # dtype of fp8 scales
    mla: bool = False  # MLA has no V cache
    num_extra_layers: int = 0  # speculative decoding
    extra_block_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "kv_heads", "block_size", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} {getattr(self, name)!r} must be a positive integer")
        if self.cache_dtype not in ("bfloat16", "uint8", "block_wise_fp8"):
            raise ValueError(f"cache_dtype {self.cache_dtype!r} must be bfloat16, uint8 or block_wise_fp8")
        if self.num_extra_layers < 0 or self.extra_block_ratio <= 0:
            raise ValueError("num_extra_layers must be >= 0 and extra_block_ratio > 0")

    @property
    def cache_shape(self) -> list[int]:
        return [self.num_blocks, self.kv_heads, self.block_size, self.head_dim]

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == "block_wise_fp8"

    def kinds(self) -> list[tuple[str, list[int], str]]:
        """(kind, per-block shape, dtype) of every cache kind."""
        dtype = "uint8" if self.fp8 else self.cache_dtype
        block = [self.kv_heads, self.block_size, self.head_dim]
        out = [("key_caches", block, dtype)]
        if not self.mla:
            out.append(("value_caches", block, dtype))
        if self.fp8:
            out.append(("key_cache_scales", block[:2], self.default_dtype))
            if not self.mla:
                out.append(("value_cache_scales", block[:2], self.default_dtype))
        return out

    def layer_blocks(self) -> list[int]:
        extra = int(self.num_blocks * self.extra_block_ratio)
        return [self.num_blocks] * self.num_layers + [extra] * self.num_extra_layers

    def speculative_config(self) -> dict:
        if not self.num_extra_layers:
            return {}
        return {"num_extra_cache_layer": self.num_extra_layers, "num_gpu_block_expand_ratio": self.extra_block_ratio}


@dataclass
class DeviceCaches:
    """Every rank's exported caches: ``tensors[rank][kind][layer]``."""

    platform: Platform
    spec: CacheSpec
    num_ranks: int
    device_ids: list[int]
    tensors: list[dict[str, list[Any]]] = field(default_factory=list)

    def create_rank(self, rank: int) -> None:
        caches: dict[str, list[Any]] = {}
        self.tensors.append(caches)
        for kind, block_shape, dtype in self.spec.kinds():
            caches[kind] = []
            for layer, blocks in enumerate(self.spec.layer_blocks()):
                tensor = self.platform.empty([blocks] + block_shape, dtype)
                caches[kind].append(tensor)
                self.platform.set_data_ipc(tensor, cache_name(kind, layer, rank, self.device_ids[rank]))

    def close(self) -> None:
        for rank, caches in enumerate(self.tensors):
            for kind, layers in caches.items():
                for layer, tensor in enumerate(layers):
                    name = cache_name(kind, layer, rank, self.device_ids[rank])
                    self.platform.unset_data_ipc(tensor, name, close_ipc=False, unlink_shm=True)
                    self.platform.free(tensor)
        self.tensors.clear()
