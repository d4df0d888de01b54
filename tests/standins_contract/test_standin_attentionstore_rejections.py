"""Unit tests of the AttentionStore SDK contract stand-in (``tests/standins/attentionstore_sdk``): what
it rejects.

Fast and in-process: numpy buffers play the device caches (a pointer is ``arr.ctypes.data``), the
stand-in's directory is the test's ``tmp_path``.  They pin the documented API's rejections: every
bad argument named in the error and nothing stored, positional-only calls, the constructor's and
``Tokens``' checks, and ``flush_token_index``.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tests.standin_attentionstore_helpers import (ARGS, BTS, LAYERS, attentionstore_standin, caches, make, ptrs,
                                                  toks)


@pytest.fixture
def m(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SimpleNamespace]:
    """The stand-in's modules, freshly imported (per-process call counters start at 0)."""
    yield from attentionstore_standin(monkeypatch, tmp_path)


# ---------------------------------------------------------------------------------------- rejections
def _rejections(m: SimpleNamespace, sdk: Any, k: list[int], v: list[int]) -> list[tuple[str, str, Callable[[], Any]]]:
    """(case, the argument the message must name, the call); ``k``/``v`` are valid cache pointers."""
    t3 = toks(m, 3, extra=1)

    def rd(layer_ids: Any = (0, 1), tokens: Any = t3, start: Any = 0, kp: Any = None, vp: Any = None,
           ids: Any = (0, 1, 2), timeout: Any = 5.0) -> list[Any]:
        args = [list(layer_ids) if isinstance(layer_ids, tuple) else layer_ids, tokens, start,
                k if kp is None else kp, v if vp is None else vp, list(ids) if isinstance(ids, tuple) else ids,
                timeout]
        return args

    transfers = [
        ("k_ptrs short", "k_ptrs", rd(kp=k[:1])),
        ("k_ptrs empty", "k_ptrs", rd(kp=[])),
        ("k_ptrs tuple", "k_ptrs", rd(kp=tuple(k))),
        ("k_ptr zero", "k_ptrs", rd(kp=[0, k[1]])),
        ("v_ptrs short", "v_ptrs", rd(vp=v[:1])),
        ("v_ptrs long", "v_ptrs", rd(vp=v + v[:1])),
        ("v_ptr negative", "v_ptrs", rd(vp=[v[0], -1])),
        ("layer out of range", "layer_ids", rd(layer_ids=[0, LAYERS])),
        ("layer negative", "layer_ids", rd(layer_ids=[-1, 0])),
        ("layer bool", "layer_ids", rd(layer_ids=[False, True])),
        ("duplicate layers", "layer_ids", rd(layer_ids=[1, 1])),
        ("no layers", "layer_ids", rd(layer_ids=[], kp=[], vp=[])),
        ("layer_ids tuple", "layer_ids", rd(layer_ids=range(2))),
        ("start+n past the tokens", "start_block_idx", rd(start=1)),
        ("n past the tokens", "start_block_idx", rd(ids=(0, 1, 2, 3))),
        ("start negative", "start_block_idx", rd(start=-1)),
        ("start float", "start_block_idx", rd(start=0.0)),
        ("tokens a list", "tokens", rd(tokens=list(range(12)))),
        ("block_token_size mismatch", "tokens", rd(tokens=m.Tokens(list(range(24)), 2 * BTS))),
        ("gpu_block_ids empty", "gpu_block_ids", rd(ids=())),
        ("gpu_block_id negative", "gpu_block_ids", rd(ids=(0, -1, 2))),
        ("gpu_block_ids numpy", "gpu_block_ids", rd(ids=np.arange(3))),
        ("timeout zero", "timeout", rd(timeout=0)),
        ("timeout nan", "timeout", rd(timeout=math.nan)),
        ("timeout inf", "timeout", rd(timeout=math.inf)),
        ("timeout bool", "timeout", rd(timeout=True)),
        ("timeout str", "timeout", rd(timeout="5")),
    ]
    cases = [(f"{method} {case}", argument, lambda f=getattr(sdk, method), a=args: f(*a))
             for case, argument, args in transfers for method in ("read", "write")]
    return cases + [
        ("match non-Tokens", "tokens", lambda: sdk.match([1, 2, 3, 4], 0, 5)),
        ("match bts mismatch", "tokens", lambda: sdk.match(m.Tokens(list(range(8)), 2), 0, 5)),
        ("match start past the tokens", "start_block_idx", lambda: sdk.match(t3, 4, 5)),
        ("match start negative", "start_block_idx", lambda: sdk.match(t3, -1, 5)),
        ("match timeout negative", "timeout", lambda: sdk.match(t3, 0, -1.0)),
    ]


def test_every_rejection_names_its_argument_and_stores_nothing(m: SimpleNamespace) -> None:
    sdk = make(m)
    k, v = caches(fill=0), caches(fill=0)
    cases = _rejections(m, sdk, ptrs(k), ptrs(v))
    for case, argument, call in cases:
        with pytest.raises(m.Error) as info:
            call()
        assert argument in str(info.value), (case, str(info.value))
    assert not [p for p in (m.root / "data").rglob("*") if p.is_file()]


def test_positional_only_and_no_extra_arguments(m: SimpleNamespace) -> None:
    with pytest.raises(TypeError):
        m.SDK(**ARGS)
    with pytest.raises(TypeError):
        m.SDK(*ARGS.values(), 0)  # the CUDA build's extra arguments are not this SDK's
    sdk = make(m)
    tokens = toks(m, 1)
    with pytest.raises(TypeError):
        sdk.match(tokens=tokens, start_block_idx=0, timeout=1)
    with pytest.raises(TypeError):
        sdk.read([0], tokens, 0, [1], [], [0], 1, remote_addrs=None)


@pytest.mark.parametrize(("name", "value"), [
    ("namespace", ""), ("namespace", "n" * 128), ("namespace", b"ns"), ("pod_name", ""), ("pod_name", None),
    ("model_version", "v" * 200), ("model_version", 1), ("shard_id", -1), ("shard_id", 1), ("shard_id", True),
    ("shard_num", 0), ("shard_num", 1.0), ("layer_num", 0), ("layer_num", "2"), ("block_token_size", 0),
    ("block_token_size", -4), ("bytes_per_shard_layer_per_block", 0), ("device_id", -1), ("device_id", None),
    ("dp_id", -1), ("dp_id", False),
])
def test_constructor_rejects(m: SimpleNamespace, name: str, value: Any) -> None:
    with pytest.raises(m.Error) as info:
        make(m, **{name: value})
    assert name in str(info.value)


def test_constructor_limits_and_directory(m: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    make(m, namespace="n" * 127, pod_name="p" * 127, model_version="v" * 127, shard_id=3, shard_num=4)
    monkeypatch.delenv("ATTENTIONSTORE_STANDIN_DIR")
    with pytest.raises(m.Error, match="ATTENTIONSTORE_STANDIN_DIR"):
        make(m)


@pytest.mark.parametrize(("ids", "bts"), [([], 4), ((1, 2, 3, 4), 4), ([1, True], 1), ([1, 2.0], 1),
                                          ([2 ** 63], 1), ([1, 2], 0), ([1, 2], True), ([1, 2], 2.0)])
def test_tokens_rejects(m: SimpleNamespace, ids: Any, bts: Any) -> None:
    with pytest.raises(m.Error, match="token_ids|block_token_size"):
        m.Tokens(ids, bts)


def test_flush_token_index(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 2)
    pb2 = m.pb2
    assert (pb2.MEDIA_HBM, pb2.MEDIA_DRAM, pb2.MEDIA_SSD) == (1, 2, 3)
    assert sdk.flush_token_index([0, 1], tokens, 0, None, pb2.MEDIA_HBM) is None
    assert sdk.flush_token_index([0, 1], tokens, 2, pb2.MEDIA_HBM, None) is None
    assert sdk.flush_token_index([1], tokens, 1, pb2.MEDIA_DRAM, pb2.MEDIA_SSD) is None
    for args, argument in [(([0, 1], tokens, 0, None, None), "src_media"),
                           (([0, 1], tokens, 0, 4, None), "src_media"),
                           (([0, 1], tokens, 0, None, 0), "dst_media"),
                           (([0, 1], tokens, 0, None, "HBM"), "dst_media"),
                           (([0, 2], tokens, 0, None, 1), "layer_ids"),
                           (([0, 0], tokens, 0, None, 1), "layer_ids"),
                           (([0, 1], tokens, 3, None, 1), "start_idx"),
                           (([0, 1], tokens, -1, None, 1), "start_idx"),
                           (([0, 1], list(range(8)), 0, None, 1), "tokens")]:
        with pytest.raises(m.Error) as info:
            sdk.flush_token_index(*args)
        assert argument in str(info.value)
    assert sdk.match(tokens, 0, 1) == 0  # a flush stores nothing
