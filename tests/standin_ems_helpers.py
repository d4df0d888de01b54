"""Shared pieces of the EMS contract stand-in tests (test_standin_ems*.py): the stand-in imported
fresh as ``ems``, registered paddle CPU caches and the arguments of a transfer of whole blocks."""
from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

paddle = pytest.importorskip("paddle")

STANDINS = Path(__file__).parent / "standins"
BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 5, 2, 3, 4


def _purge_ems() -> None:
    for name in list(sys.modules):
        if name == "ems" or name.startswith("ems."):
            del sys.modules[name]


def ems_standin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """Body of the ``ems`` fixture: the stand-in as ``ems``, with its data in a fresh directory; the
    singleton reset after."""
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.setenv("EMS_STANDIN_DIR", str(tmp_path / "ems"))
    _purge_ems()
    import ems as module
    try:
        yield module
    finally:
        module.Ems._reset()
        _purge_ems()


def kv_config(ems: ModuleType) -> Any:
    import ems.cc_v1.cc_config as cc_config
    return cc_config


def tensors(layers: int, per_layer: int, seed: int = 1) -> list[list[Any]]:
    """Distinct float32 contents in every tensor, [blocks, block_size, heads, head_size]."""
    n = BLOCKS * BLOCK_SIZE * HEADS * HEAD_SIZE
    out = []
    for layer in range(layers):
        row = []
        for j in range(per_layer):
            base = float(seed * 100000 + (layer * per_layer + j) * n)
            row.append(paddle.arange(base, base + n, dtype="float32").reshape([BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE]))
        out.append(row)
    return out


def setup_cc(ems: ModuleType, *, model_id: str = "m", mla: bool = False, layers: int = 2, tp: int = 1,
             rank: int = 0) -> tuple[Any, list[list[Any]]]:
    config = ems.CcConfig_v1(rank, rank, model_id, tp, 1, rank, 0, "fastdeploy")
    if mla:
        config.kvcache_type = kv_config(ems).KVCacheType.MLA
    ems.Ems.init(ems.EmsConfig("", "", config))
    cc = ems.Ems.get_cc()
    kv = tensors(layers, 1 if mla else 2)
    cc.register_kvcache(kv)
    return cc, kv


def slots_of(block_ids: list[int]) -> list[int]:
    return [b * BLOCK_SIZE + o for b in block_ids for o in range(BLOCK_SIZE)]


def transfer_args(ems: ModuleType, block_ids: list[int], hashes: list[int], **option: Any) -> tuple:
    return slots_of(block_ids), hashes, [BLOCK_SIZE] * len(block_ids), ems.CcKvOption(**option)


def block_bytes(kv: list[list[Any]], block: int) -> bytes:
    """A block's bytes as the stand-in stores them: layer-major, K then V, token order."""
    return b"".join(t.numpy()[block].tobytes() for layer in kv for t in layer)


def status(exc_info: Any) -> Any:
    return exc_info.value.status_code()
