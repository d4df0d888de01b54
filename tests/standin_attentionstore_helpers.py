"""Shared pieces of the AttentionStore SDK stand-in tests (test_standin_attentionstore*.py): the
stand-in's modules imported fresh, an SDK of the default identity, numpy "device caches" and tokens."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

STANDINS = Path(__file__).resolve().parent / "standins"
BTS = 4  # block_token_size
BPB = 16  # bytes_per_shard_layer_per_block
LAYERS = 2
GPU_BLOCKS = 8


def _purge() -> None:
    for name in list(sys.modules):
        if name == "attentionstore_sdk" or name.startswith("attentionstore_sdk."):
            del sys.modules[name]


def attentionstore_standin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SimpleNamespace]:
    """Body of the ``m`` fixture: the stand-in's modules, freshly imported (per-process call counters
    start at 0), with ``tmp_path`` as the stand-in's directory."""
    _purge()
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.setenv("ATTENTIONSTORE_STANDIN_DIR", str(tmp_path))
    import attentionstore_sdk.api.common.common_pb2 as common_pb2
    import attentionstore_sdk.sdk as sdk
    from attentionstore_sdk.utils.err import AttentionStoreSDKError

    yield SimpleNamespace(sdk=sdk, Tokens=sdk.Tokens, SDK=sdk.AttentionStoreSDK, Error=AttentionStoreSDKError,
                          pb2=common_pb2, root=tmp_path)
    _purge()


ARGS = {"namespace": "ns", "pod_name": "pod-a", "model_version": "v1", "shard_id": 0, "shard_num": 1,
        "layer_num": LAYERS, "block_token_size": BTS, "bytes_per_shard_layer_per_block": BPB, "device_id": 0,
        "dp_id": 0}


def make(m: SimpleNamespace, **overrides: Any) -> Any:
    return m.SDK(*{**ARGS, **overrides}.values())


def caches(fill: int | None = None, seed: int = 0, layers: int = LAYERS, bpb: int = BPB) -> list[np.ndarray]:
    """One "device cache" per layer: GPU_BLOCKS blocks of ``bpb`` bytes, random or filled."""
    if fill is not None:
        return [np.full((GPU_BLOCKS, bpb), fill, dtype=np.uint8) for _ in range(layers)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(GPU_BLOCKS, bpb), dtype=np.uint8) for _ in range(layers)]


def ptrs(arrs: list[np.ndarray]) -> list[int]:
    return [int(a.ctypes.data) for a in arrs]


def toks(m: SimpleNamespace, n_blocks: int, base: int = 100, extra: int = 0, bts: int = BTS) -> Any:
    return m.Tokens(list(range(base, base + n_blocks * bts + extra)), bts)
