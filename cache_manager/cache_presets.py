"""Cache layouts named after the models users deploy in 2026, each scalable down for tests.

``preset(name)`` gives one rank's layout at the model's real sizes (public model configs; pages of
128 tokens as on Ascend).  ``layers`` keeps the first layers of the pattern and ``dim_scale`` divides
every hidden dimension, so a test runs the same structure and ratios in a few MiB.

| preset | groups per layer | TP rule |
|---|---|---|
| ``deepseek-v3`` | MLA latent 512 + rope 64 (two caches), 61 layers, 1 MTP layer | replicated |
| ``glm-5`` | latent + rope + a DSA indexer cache (128 per token), 78 layers | replicated |
| ``deepseek-v4`` | a 128-token sliding-window latent on every layer; 31 layers compressed 128:1, 30 layers 4:1 with an indexer | replicated |
| ``gpt-oss`` | K/V, 8 kv heads x 64, layers alternating a 128-token sliding window and full attention, 24 layers | split by kv heads |
| ``qwen3-next`` | full-attention K/V (2 kv heads x 256) every fourth layer; the others a conv + SSM state per request | K/V split; state unsplittable |
| ``qwen3-235b`` | K/V, 4 kv heads x 128, 94 layers | split by kv heads |
"""
from __future__ import annotations

from typing import Callable

from cache_manager.cache_layout import CacheLayout, TensorGroup

BLOCK = 128  # tokens per page


def _dim(value: int, scale: int) -> int:
    return max(1, value // scale)


def _layers(default: int, layers: int | None) -> int:
    return default if layers is None else layers


def _mla(name: str, total: int, extra: int, scale: int, indexer: bool) -> list[TensorGroup]:
    every = range(total + extra)
    groups = [TensorGroup("latent_caches", "bfloat16", (1, BLOCK, _dim(512, scale)), every, tp="replicated"),
              TensorGroup("rope_caches", "bfloat16", (1, BLOCK, _dim(64, scale)), every, tp="replicated")]
    if indexer:
        groups.append(TensorGroup("indexer_caches", "bfloat16", (1, BLOCK, _dim(128, scale)), every,
                                  kind="indexer", tp="replicated"))
    return groups


def deepseek_v3(num_blocks: int, layers: int | None, scale: int, tp: int) -> CacheLayout:
    total = _layers(61, layers)
    return CacheLayout(tuple(_mla("deepseek-v3", total, 1, scale, False)), num_blocks, BLOCK, total,
                       num_extra_layers=1, name="deepseek-v3")


def glm_5(num_blocks: int, layers: int | None, scale: int, tp: int) -> CacheLayout:
    total = _layers(78, layers)
    return CacheLayout(tuple(_mla("glm-5", total, 0, scale, True)), num_blocks, BLOCK, total, name="glm-5")


def deepseek_v4(num_blocks: int, layers: int | None, scale: int, tp: int) -> CacheLayout:
    total = _layers(61, layers)
    every = range(total)
    c128 = range(0, total, 2)  # 31 of 61 layers compressed 128:1
    c4 = range(1, total, 2)  # 30 layers 4:1, with an indexer
    latent = _dim(512, scale)
    groups = [TensorGroup("window_caches", "bfloat16", (1, BLOCK, latent), every, kind="sliding_window",
                          window=128, tp="replicated"),
              TensorGroup("c128_caches", "bfloat16", (1, 1, latent), c128, compress=128, tp="replicated")]
    if len(c4):
        groups += [TensorGroup("c4_caches", "bfloat16", (1, BLOCK // 4, latent), c4, compress=4, tp="replicated"),
                   TensorGroup("indexer_caches", "bfloat16", (1, BLOCK // 4, _dim(128, scale)), c4, kind="indexer",
                               compress=4, tp="replicated")]
    return CacheLayout(tuple(groups), num_blocks, BLOCK, total, name="deepseek-v4")


def gpt_oss(num_blocks: int, layers: int | None, scale: int, tp: int) -> CacheLayout:
    total = _layers(24, layers)
    heads = max(1, 8 // tp)
    shape = (heads, BLOCK, _dim(64, scale))
    window, full = range(0, total, 2), range(1, total, 2)
    groups = [TensorGroup("window_key_caches", "bfloat16", shape, window, kind="sliding_window", window=128, heads=8),
              TensorGroup("window_value_caches", "bfloat16", shape, window, kind="sliding_window", window=128, heads=8)]
    if len(full):
        groups += [TensorGroup("key_caches", "bfloat16", shape, full, heads=8),
                   TensorGroup("value_caches", "bfloat16", shape, full, heads=8)]
    return CacheLayout(tuple(groups), num_blocks, BLOCK, total, name="gpt-oss")


def qwen3_next(num_blocks: int, layers: int | None, scale: int, tp: int) -> CacheLayout:
    total = _layers(48, layers)
    full = range(3, total, 4)
    linear = [l for l in range(total) if l % 4 != 3]
    shape = (max(1, 2 // tp), BLOCK, _dim(256, scale))
    groups = []
    if len(full):
        groups += [TensorGroup("key_caches", "bfloat16", shape, full, heads=2),
                   TensorGroup("value_caches", "bfloat16", shape, full, heads=2)]
    if linear:
        groups += [TensorGroup("conv_state", "bfloat16", (_dim(8192, scale), 3), linear, kind="state", tp="unsplittable"),
                   TensorGroup("ssm_state", "float32", (_dim(32, scale), _dim(128, scale), _dim(128, scale)), linear,
                               kind="state", tp="unsplittable")]
    return CacheLayout(tuple(groups), num_blocks, BLOCK, total, state_slots=max(1, num_blocks // 4) if linear else 0,
                       name="qwen3-next")


def qwen3_235b(num_blocks: int, layers: int | None, scale: int, tp: int) -> CacheLayout:
    total = _layers(94, layers)
    shape = (max(1, 4 // tp), BLOCK, _dim(128, scale))
    groups = (TensorGroup("key_caches", "bfloat16", shape, range(total), heads=4),
              TensorGroup("value_caches", "bfloat16", shape, range(total), heads=4))
    return CacheLayout(groups, num_blocks, BLOCK, total, name="qwen3-235b")


PRESETS: dict[str, Callable[[int, int | None, int, int], CacheLayout]] = {
    "deepseek-v3": deepseek_v3, "glm-5": glm_5, "deepseek-v4": deepseek_v4, "gpt-oss": gpt_oss,
    "qwen3-next": qwen3_next, "qwen3-235b": qwen3_235b,
}


def preset(name: str, num_blocks: int = 256, layers: int | None = None, dim_scale: int = 1, tp: int = 1) -> CacheLayout:
    """One rank's layout of model ``name`` at TP ``tp``: ``layers`` and ``dim_scale`` scale it down."""
    if name not in PRESETS:
        raise ValueError(f"cache layout preset {name!r} is not one of {', '.join(PRESETS)}")
    if not isinstance(dim_scale, int) or dim_scale <= 0:
        raise ValueError(f"dim_scale {dim_scale!r} must be a positive integer")
    if layers is not None and (not isinstance(layers, int) or layers <= 0):
        raise ValueError(f"layers {layers!r} must be a positive integer")
    return PRESETS[name](num_blocks, layers, dim_scale, tp)
