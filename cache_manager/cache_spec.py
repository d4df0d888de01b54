"""CacheSpec: FastDeploy's description of one rank's caches (its ``--key_cache_shape`` family of
flags): K, V unless MLA, fp8 scales when ``block_wise_fp8``, speculative extra layers with their
own block count.

Every path works on the ``CacheLayout`` it stands for (``layout()``, ``as_layout``): groups with
exactly these caches' IPC names and storage keys.  Layouts FastDeploy's flags cannot say (MLA
latent + rope, indexers, sliding windows, state) are ``CacheLayout`` objects themselves.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from transfer_factory.keys import Namespace

from cache_manager.cache_layout import CacheLayout, TensorGroup


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
    value_block_shape: tuple[int, int, int] | None = None  # [H, B, D] of V where it differs from K

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "kv_heads", "block_size", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} {getattr(self, name)!r} must be a positive integer")
        if self.cache_dtype not in ("bfloat16", "uint8", "block_wise_fp8"):
            raise ValueError(f"cache_dtype {self.cache_dtype!r} must be bfloat16, uint8 or block_wise_fp8")
        if self.num_extra_layers < 0 or self.extra_block_ratio <= 0:
            raise ValueError("num_extra_layers must be >= 0 and extra_block_ratio > 0")
        if self.value_block_shape is not None and (
                len(self.value_block_shape) != 3 or any(not isinstance(d, int) or d <= 0 for d in self.value_block_shape)):
            raise ValueError(f"value_block_shape {self.value_block_shape!r} must be 3 positive integers [H, B, D]")

    @property
    def cache_shape(self) -> list[int]:
        return [self.num_blocks, self.kv_heads, self.block_size, self.head_dim]

    @property
    def value_cache_shape(self) -> list[int]:
        """[N, H, B, D] of the V cache; empty for MLA."""
        if self.mla:
            return []
        return [self.num_blocks, *(self.value_block_shape or self.cache_shape[1:])]

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == "block_wise_fp8"

    def kinds(self) -> list[tuple[str, list[int], str]]:
        """(kind, per-block shape, dtype) of every cache kind."""
        dtype = "uint8" if self.fp8 else self.cache_dtype
        key = [self.kv_heads, self.block_size, self.head_dim]
        value = self.value_cache_shape[1:]
        out = [("key_caches", key, dtype)]
        if value:
            out.append(("value_caches", value, dtype))
        if self.fp8:
            out.append(("key_cache_scales", key[:2], self.default_dtype))
            if value:
                out.append(("value_cache_scales", value[:2], self.default_dtype))
        return out

    def layer_blocks(self) -> list[int]:
        extra = int(self.num_blocks * self.extra_block_ratio)
        return [self.num_blocks] * self.num_layers + [extra] * self.num_extra_layers

    def speculative_config(self) -> dict:
        if not self.num_extra_layers:
            return {}
        return {"num_extra_cache_layer": self.num_extra_layers, "num_gpu_block_expand_ratio": self.extra_block_ratio}

    def storage_namespace(self, model_id: str, model_version: str, tp_size: int) -> Namespace:
        """The namespace of this model's storage keys; the engine and every CTM build it here."""
        return self.layout().storage_namespace(model_id, model_version, tp_size)

    def layout(self) -> CacheLayout:
        """The groups these flags describe: one per cache kind, every layer, FastDeploy's names."""
        layers = range(self.num_layers + self.num_extra_layers)
        tp = "replicated" if self.mla else "split"
        groups = tuple(TensorGroup(name=kind, dtype=dtype, block_shape=tuple(shape), layers=layers,
                                   kind="scale" if kind.endswith("_scales") else "full", tp=tp)
                       for kind, shape, dtype in self.kinds())
        return CacheLayout(groups=groups, num_blocks=self.num_blocks, block_size=self.block_size,
                           num_layers=self.num_layers, num_extra_layers=self.num_extra_layers,
                           extra_block_ratio=self.extra_block_ratio, legacy={"cache_dtype": self.cache_dtype})


def as_layout(spec: "CacheSpec | CacheLayout") -> CacheLayout:
    """The layout every path works on, from either form the engine API takes."""
    if isinstance(spec, CacheLayout):
        return spec
    if isinstance(spec, CacheSpec):
        return spec.layout()
    raise ValueError(f"a cache spec must be a CacheSpec or a CacheLayout, got {type(spec).__name__}")


def key_prefix_from_version(model_path: str) -> str:
    """FastDeploy's storage key prefix: ``version: RL-STEP12-<time>-<uuid>`` in
    ``<model_path>/version.yaml`` gives ``RL-STEP12``.  A missing file or key is an error naming it."""
    path = os.path.join(model_path, "version.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the model version from {path}: {exc}") from None
    for line in lines:
        key, sep, value = line.partition(":")
        if sep and key.strip() == "version":
            version = value.split("#", 1)[0].strip().strip("'\"")
            if version:
                return "-".join(version.split("-", 2)[:2])
    raise ValueError(f"{path} has no 'version:' entry")
