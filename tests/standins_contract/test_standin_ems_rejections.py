"""Unit tests of the EMS contract stand-in (tests/standins/ems): what it rejects, in-process and fast.

The stand-in must reject what the documented Huawei EMS SDK (ContextCaching V1) rejects: every
``EMS_INVALID_ARGUMENT`` case of transfers, ``exists``, options, registration and configuration,
the missing stand-in directory, and the singleton's life cycle and error codes.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Iterator

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from tests.standin_ems_helpers import (BLOCK_SIZE, BLOCKS, HEAD_SIZE, HEADS, block_bytes, ems_standin,  # noqa: E402
                                       kv_config, setup_cc, slots_of, status, transfer_args)


@pytest.fixture
def ems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """The stand-in as ``ems``, with its data in a fresh directory; the singleton reset after."""
    yield from ems_standin(monkeypatch, tmp_path)


# ---------------------------------------------------------------------- rejections
def _bad_transfers(ems: ModuleType) -> dict[str, tuple]:
    ok = ems.CcKvOption()
    slots = slots_of([0, 1])
    return {
        "sum(offsets) mismatch": (slots, [1, 2], [2, 1], ok),
        "len(offsets) != len(hashes)": (slots, [1, 2], [2, 1, 1], ok),
        "empty slot_mapping": ([], [1], [2], ok),
        "empty hashes": (slots, [], [], ok),
        "empty offsets": (slots, [1, 2], [], ok),
        "slot_mapping not a list": (tuple(slots), [1, 2], [2, 2], ok),
        "float slot": ([0.0, 1, 2, 3], [1, 2], [2, 2], ok),
        "numpy slot": ([np.int64(0), 1, 2, 3], [1, 2], [2, 2], ok),
        "bool hash": (slots, [True, 2], [2, 2], ok),
        "str hash": (slots, ["1", 2], [2, 2], ok),
        "hash >= 2**64": (slots, [2**64, 2], [2, 2], ok),
        "hash < -2**63": (slots, [-(2**63) - 1, 2], [2, 2], ok),
        "negative slot": ([-1, 1, 2, 3], [1, 2], [2, 2], ok),
        "slot past the caches": ([0, 1, 2, BLOCKS * BLOCK_SIZE], [1, 2], [2, 2], ok),
        "offset 0": (slots, [1, 2, 3], [2, 2, 0], ok),
        "offset > block_size": (slots, [1], [4], ok),
        "option None": (slots, [1, 2], [2, 2], None),
        "option dict": (slots, [1, 2], [2, 2], {"timeout": 5000}),
    }


@pytest.mark.parametrize("method", ["save", "load", "async_save", "async_load"])
def test_transfer_rejections(ems: ModuleType, method: str) -> None:
    cc, kv = setup_cc(ems)
    before = block_bytes(kv, 0)
    for case, args in _bad_transfers(ems).items():
        with pytest.raises(ems.EmsException) as exc:
            getattr(cc, method)(*args)
        assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT, case
    assert block_bytes(kv, 0) == before
    assert cc.exists([1, 2], ems.CcKvOption()).success == 0


def test_exists_rejections(ems: ModuleType) -> None:
    cc, _ = setup_cc(ems)
    for hashes, option in (([], ems.CcKvOption()), ((1,), ems.CcKvOption()), ([1.0], ems.CcKvOption()),
                           ([2**64], ems.CcKvOption()), ([1], None)):
        with pytest.raises(ems.EmsException) as exc:
            cc.exists(hashes, option)
        assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT


def test_option_validated_when_built_and_when_used(ems: ModuleType) -> None:
    for kwargs in ({"timeout": 0}, {"timeout": 1.5}, {"timeout": True}, {"timeout": -5}, {"write_rcache": 1},
                   {"read_local_only": "no"}):
        with pytest.raises(ems.EmsException) as exc:
            ems.CcKvOption(**kwargs)
        assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT, kwargs
    cc, _ = setup_cc(ems)
    option = ems.CcKvOption()
    option.timeout = 0
    with pytest.raises(ems.EmsException) as exc:
        cc.exists([1], option)
    assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT


def test_register_rejections(ems: ModuleType) -> None:
    cc_config = kv_config(ems)
    ems.Ems.init(ems.EmsConfig(cc_config_v1=ems.CcConfig_v1(0, 0, "m")))
    cc = ems.Ems.get_cc()
    good = paddle.zeros([BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE], dtype="float32")
    bad = {
        "empty": [],
        "not a list": ([good, good],),
        "inner tuple": [(good, good)],
        "one tensor for MHA": [[good]],
        "three tensors": [[good, good, good]],
        "3-D": [[paddle.zeros([BLOCKS, BLOCK_SIZE, HEADS * HEAD_SIZE]), paddle.zeros([BLOCKS, BLOCK_SIZE, 12])]],
        "shapes differ": [[good, good], [good, paddle.zeros([BLOCKS, BLOCK_SIZE, HEADS, 8], dtype="float32")]],
        "dtypes differ": [[good, paddle.zeros([BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE], dtype="int32")]],
        "element sizes differ": [[good, paddle.zeros([BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE], dtype="float16")]],
        "not a tensor": [[good, np.zeros([BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE], dtype=np.float32)]],
    }
    for case, kvcache in bad.items():
        with pytest.raises(ems.EmsException) as exc:
            cc.register_kvcache(kvcache)
        assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT, case
    cc.register_kvcache([[good, good]])
    with pytest.raises(ems.EmsException) as exc:
        cc.register_kvcache([[good, good]])
    assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT
    ems.Ems._reset()
    config = ems.CcConfig_v1(0, 0, "m")
    config.kvcache_type = cc_config.KVCacheType.MLA
    ems.Ems.init(ems.EmsConfig("", "", config))
    with pytest.raises(ems.EmsException) as exc:
        ems.Ems.get_cc().register_kvcache([[good, good]])
    assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT


def test_config_rejections(ems: ModuleType) -> None:
    bad = [((True, 0, "m"), {}), ((-1, 0, "m"), {}), ((0, 0, ""), {}), ((0, 0, 7), {}),
           ((0, 0, "m"), {"tp_world_size": 2, "rank_in_tp_group": 2}),
           ((0, 0, "m"), {"pp_world_size": 1, "rank_in_pp_group": 1}), ((0, 0, "m"), {"tp_world_size": 0}),
           ((0, 0.0, "m"), {}), ((0, 0, "m"), {"llm_engine": None})]
    for args, kwargs in bad:
        with pytest.raises(ems.EmsException) as exc:
            ems.CcConfig_v1(*args, **kwargs)
        assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT, (args, kwargs)
    config = ems.CcConfig_v1(0, 0, "m")
    config.kvcache_type = "MLA"
    for cfg in (config, None, "m"):
        with pytest.raises(ems.EmsException) as exc:
            ems.Ems.init(ems.EmsConfig("", "", cfg))
        assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(ems.EmsException) as exc:
        ems.Ems.init(ems.CcConfig_v1(0, 0, "m"))
    assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT
    assert ems.Ems.get_cc() is None


def test_init_needs_the_standin_dir(ems: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMS_STANDIN_DIR")
    with pytest.raises(ems.EmsException) as exc:
        ems.Ems.init(ems.EmsConfig("", "", ems.CcConfig_v1(0, 0, "m")))
    assert status(exc) == ems.EmsErrorCode.EMS_INIT_FAILED and "EMS_STANDIN_DIR not set" in str(exc.value)
    assert ems.Ems.get_cc() is None and ems.Ems.check_health() is False


def test_singleton_lifecycle(ems: ModuleType) -> None:
    assert ems.Ems.get_cc() is None and ems.Ems.check_health() is False
    config = ems.CcConfig_v1(0, 0, "m")
    ems.Ems.init(ems.EmsConfig(cc_config=config))
    cc = ems.Ems.get_cc()
    assert isinstance(cc, ems.ContextCache_v1) and ems.Ems.check_health() is True
    with pytest.raises(ems.EmsException) as exc:
        cc.save(*transfer_args(ems, [0], [1]))
    assert status(exc) == ems.EmsErrorCode.EMS_NOT_REGISTERED
    ems.Ems.init(ems.EmsConfig("", "", ems.CcConfig_v1(0, 0, "m")))   # same configuration: same handle
    assert ems.Ems.get_cc() is cc
    with pytest.raises(ems.EmsException) as exc:
        ems.Ems.init(ems.EmsConfig("", "", ems.CcConfig_v1(0, 0, "other")))
    assert status(exc) == ems.EmsErrorCode.EMS_INIT_FAILED
    ems.Ems._reset()
    with pytest.raises(ems.EmsException) as exc:
        cc.exists([1], ems.CcKvOption())
    assert status(exc) == ems.EmsErrorCode.EMS_NOT_INITIALIZED
    with pytest.raises(ems.EmsException) as exc:
        ems.EmsConfig(cc_config=ems.CcConfig_v1(0, 0, "a"), cc_config_v1=ems.CcConfig_v1(0, 0, "b"))
    assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT


def test_error_codes_and_exception(ems: ModuleType) -> None:
    codes = ems.EmsErrorCode
    assert codes.EMS_OK.value == 0
    for name in ("EMS_INVALID_ARGUMENT", "EMS_TIMEOUT", "EMS_INTERNAL_ERROR", "EMS_INIT_FAILED",
                 "EMS_NOT_INITIALIZED", "EMS_NOT_REGISTERED", "EMS_UNHEALTHY", "EMS_RECOVERD_ERROR"):
        assert getattr(codes, name).name == name
    exc = ems.EmsException(codes.EMS_TIMEOUT, "slow")
    assert exc.status_code() is codes.EMS_TIMEOUT and "slow" in str(exc) and isinstance(exc, Exception)
    assert not hasattr(ems, "KVCacheType")   # documented only at ems.cc_v1.cc_config
    assert kv_config(ems).KVCacheType.MHA != kv_config(ems).KVCacheType.MLA
    assert ems.CcConfig_v1(0, 0, "m").kvcache_type is kv_config(ems).KVCacheType.MHA
