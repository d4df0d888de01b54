"""Unit tests of the EMS contract stand-in (tests/standins/ems), in-process and fast.

The stand-in must behave as the documented Huawei EMS SDK (ContextCaching V1) does and reject
what it rejects; these tests pin that contract: hash-addressed save/load/exists over registered
paddle CPU tensors, the leading-consecutive ``CcResult``, every ``EMS_INVALID_ARGUMENT`` case, the
async futures and the fault knobs of ``$EMS_STANDIN_DIR/faults.json``.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

STANDINS = Path(__file__).parent / "standins"
BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 5, 2, 3, 4


def _purge_ems() -> None:
    for name in list(sys.modules):
        if name == "ems" or name.startswith("ems."):
            del sys.modules[name]


@pytest.fixture
def ems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """The stand-in as ``ems``, with its data in a fresh directory; the singleton reset after."""
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.setenv("EMS_STANDIN_DIR", str(tmp_path / "ems"))
    _purge_ems()
    import ems as module
    try:
        yield module
    finally:
        module.Ems._reset()
        _purge_ems()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ems"


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


def zero(kv: list[list[Any]]) -> None:
    for layer in kv:
        for t in layer:
            ctypes.memset(t.data_ptr(), 0, int(t.numel()) * t.element_size())


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


def faults(root: Path, **knobs: Any) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "faults.json").write_text(json.dumps(knobs))


def status(exc_info: Any) -> Any:
    return exc_info.value.status_code()


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_round_trip_of_three_blocks(ems: ModuleType, root: Path, mla: bool) -> None:
    cc, kv = setup_cc(ems, mla=mla)
    originals = {b: block_bytes(kv, b) for b in (1, 2, 4)}
    result = cc.save(*transfer_args(ems, [1, 2, 4], [11, 12, 13]))
    assert (result.success, result.total) == (3, 3)
    assert repr(result) == "CcResult(success=3, total=3)"
    files = root / "data" / "m" / "tp1" / "rank0"
    assert sorted(p.name for p in files.iterdir()) == [f"{h:016x}" for h in (11, 12, 13)]
    assert (files / f"{12:016x}").read_bytes()[20:] == originals[2]   # 20-byte header, then the rows
    zero(kv)
    result = cc.load(*transfer_args(ems, [0, 3, 2], [11, 12, 13]))
    assert (result.success, result.total) == (3, 3)
    assert [block_bytes(kv, b) for b in (0, 3, 2)] == [originals[1], originals[2], originals[4]]
    assert block_bytes(kv, 1) == block_bytes(kv, 4) == bytes(len(originals[1]))  # nothing else written
    assert cc.exists([11, 12, 13], ems.CcKvOption()).success == 3


def test_keywords_scattered_slots_and_overwrite(ems: ModuleType) -> None:
    cc, kv = setup_cc(ems)
    rows = [t.numpy().reshape(BLOCKS * BLOCK_SIZE, -1) for layer in kv for t in layer]
    option = ems.CcKvOption()
    assert cc.save(slot_mapping=[5, 2], hashes=[7], offsets=[2], option=option).success == 1
    zero(kv)
    assert cc.load(slot_mapping=[0, 9], hashes=[7], offsets=[2], option=option).success == 1
    for before, t in zip(rows, (t for layer in kv for t in layer)):
        after = t.numpy().reshape(BLOCKS * BLOCK_SIZE, -1)
        assert np.array_equal(after[0], before[5]) and np.array_equal(after[9], before[2])
    # saving a hash again overwrites it (here: the same rows in the other order)
    assert cc.save(slot_mapping=[9, 0], hashes=[7], offsets=[2], option=option).success == 1
    zero(kv)
    assert cc.load(slot_mapping=[4, 6], hashes=[7], offsets=[2], option=option).success == 1
    for before, t in zip(rows, (t for layer in kv for t in layer)):
        after = t.numpy().reshape(BLOCKS * BLOCK_SIZE, -1)
        assert np.array_equal(after[4], before[2]) and np.array_equal(after[6], before[5])


def test_negative_hash_is_named_by_its_low_64_bits(ems: ModuleType, root: Path) -> None:
    cc, _ = setup_cc(ems)
    assert cc.save(*transfer_args(ems, [0], [-1])).success == 1
    assert (root / "data" / "m" / "tp1" / "rank0" / "ffffffffffffffff").is_file()
    assert cc.exists([-1, 2**64 - 1], ems.CcKvOption()).success == 2


def test_partial_save_misses_later(ems: ModuleType, root: Path) -> None:
    cc, kv = setup_cc(ems)
    faults(root, save_first_k=1)
    assert (cc.save(*transfer_args(ems, [1, 2, 3], [1, 2, 3])).success, 3) == (1, 3)
    assert cc.exists([1, 2, 3], ems.CcKvOption()).success == 1
    saved = block_bytes(kv, 1)
    zero(kv)
    result = cc.load(*transfer_args(ems, [1, 2, 3], [1, 2, 3]))
    assert (result.success, result.total) == (1, 3)
    assert block_bytes(kv, 1) == saved and not any(block_bytes(kv, 2))


def test_load_stops_at_first_missing_hash(ems: ModuleType) -> None:
    cc, kv = setup_cc(ems)
    assert cc.save(*transfer_args(ems, [1], [11])).success == 1
    assert cc.save(*transfer_args(ems, [3], [13])).success == 1
    first = block_bytes(kv, 1)
    zero(kv)
    result = cc.load(*transfer_args(ems, [1, 2, 3], [11, 12, 13]))
    assert (result.success, result.total) == (1, 3)
    assert block_bytes(kv, 1) == first
    assert not any(block_bytes(kv, 2)) and not any(block_bytes(kv, 3))   # 13 is stored but comes after the miss
    assert cc.exists([11, 12, 13], ems.CcKvOption()).success == 1
    assert cc.exists([13], ems.CcKvOption()).success == 1


def test_block_stored_with_fewer_tokens_misses(ems: ModuleType) -> None:
    cc, _ = setup_cc(ems)
    option = ems.CcKvOption()
    assert cc.save([2], [5], [1], option).success == 1
    assert cc.load(slots_of([0]), [5], [BLOCK_SIZE], option).success == 0
    assert cc.load([7], [5], [1], option).success == 1


def test_model_ids_do_not_share_blocks(ems: ModuleType) -> None:
    cc, _ = setup_cc(ems, model_id="model-a")
    assert cc.save(*transfer_args(ems, [0, 1], [1, 2])).success == 2
    ems.Ems._reset()
    cc, _ = setup_cc(ems, model_id="model-b")
    assert cc.exists([1, 2], ems.CcKvOption()).success == 0
    assert cc.load(*transfer_args(ems, [0, 1], [1, 2])).success == 0
    ems.Ems._reset()
    cc, _ = setup_cc(ems, model_id="model-a", tp=2, rank=1)   # another TP layout: other files too
    assert cc.exists([1, 2], ems.CcKvOption()).success == 0
    ems.Ems._reset()
    cc, _ = setup_cc(ems, model_id="model-a")
    assert cc.exists([1, 2], ems.CcKvOption()).success == 2


def test_mha_blocks_miss_for_an_mla_registration(ems: ModuleType) -> None:
    cc, _ = setup_cc(ems)
    assert cc.save(*transfer_args(ems, [0], [1])).success == 1
    ems.Ems._reset()
    cc, _ = setup_cc(ems, mla=True)
    assert cc.load(*transfer_args(ems, [0], [1])).success == 0   # other size: a miss, not garbage


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


# ---------------------------------------------------------------------- fault knobs
def calls(root: Path) -> list[str]:
    return [line.split()[1] for line in (root / "calls.log").read_text().splitlines()]


def test_raise_on_call_counts_per_method(ems: ModuleType, root: Path) -> None:
    cc, _ = setup_cc(ems)
    faults(root, raise_on_call={"save": 2, "load": 1})
    assert cc.save(*transfer_args(ems, [0], [1])).success == 1
    with pytest.raises(ems.EmsException) as exc:
        cc.save(*transfer_args(ems, [0], [2]))
    assert status(exc) == ems.EmsErrorCode.EMS_INTERNAL_ERROR
    fut = cc.async_save(*transfer_args(ems, [0], [3]))   # the 3rd save: fine
    assert cc.get_result(fut).success == 1
    with pytest.raises(ems.EmsException):
        cc.load(*transfer_args(ems, [0], [1]))
    assert cc.load(*transfer_args(ems, [0], [1])).success == 1
    assert cc.exists([1, 2, 3], ems.CcKvOption()).success == 1   # the failed save stored nothing
    assert calls(root) == ["save", "save", "async_save", "load", "load", "exists"]


def test_raise_and_unhealthy(ems: ModuleType, root: Path) -> None:
    cc, _ = setup_cc(ems)
    faults(root, **{"raise": ["load", "check_health"]})
    assert cc.save(*transfer_args(ems, [0], [1])).success == 1
    for call in (lambda: cc.load(*transfer_args(ems, [0], [1])), ems.Ems.check_health):
        with pytest.raises(ems.EmsException) as exc:
            call()
        assert status(exc) == ems.EmsErrorCode.EMS_INTERNAL_ERROR
    faults(root, unhealthy=True)
    assert ems.Ems.check_health() is False
    for call in (lambda: cc.save(*transfer_args(ems, [0], [2])), lambda: cc.load(*transfer_args(ems, [0], [1])),
                 lambda: cc.exists([1], ems.CcKvOption())):
        with pytest.raises(ems.EmsException) as exc:
            call()
        assert status(exc) == ems.EmsErrorCode.EMS_UNHEALTHY
    (root / "faults.json").write_text("")   # empty: no faults
    assert ems.Ems.check_health() is True and cc.exists([1, 2], ems.CcKvOption()).success == 1


def test_sleep_ignores_the_option_timeout(ems: ModuleType, root: Path) -> None:
    cc, _ = setup_cc(ems)
    faults(root, sleep_s={"save": 0.2})
    start = time.monotonic()
    assert cc.save(*transfer_args(ems, [0], [1], timeout=1)).success == 1
    assert time.monotonic() - start >= 0.2


def test_timeout_waits_the_option_timeout(ems: ModuleType, root: Path) -> None:
    cc, _ = setup_cc(ems)
    faults(root, timeout=["load", "exists"])
    for call in (lambda: cc.load(*transfer_args(ems, [0], [1], timeout=100)),
                 lambda: cc.exists([1], ems.CcKvOption(timeout=100))):
        start = time.monotonic()
        with pytest.raises(ems.EmsException) as exc:
            call()
        assert status(exc) == ems.EmsErrorCode.EMS_TIMEOUT
        assert 0.1 <= time.monotonic() - start < 2.0
    assert cc.save(*transfer_args(ems, [0], [1], timeout=100)).success == 1


@pytest.mark.parametrize("knobs", [{"rise": ["save"]}, {"raise": ["async_save"]}, {"timeout": ["check_health"]},
                                   {"raise_on_call": {"save": 0}}, {"sleep_s": {"load": "1"}},
                                   {"save_first_k": -1}, {"unhealthy": 1}, [1]])
def test_malformed_knobs_are_test_errors(ems: ModuleType, root: Path, knobs: Any) -> None:
    cc, _ = setup_cc(ems)
    root.mkdir(parents=True, exist_ok=True)
    (root / "faults.json").write_text(json.dumps(knobs))
    with pytest.raises(ValueError):
        cc.exists([1], ems.CcKvOption())


# ---------------------------------------------------------------------- async
def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_async_save_and_load(ems: ModuleType, root: Path) -> None:
    cc, kv = setup_cc(ems)
    saved = [block_bytes(kv, b) for b in (1, 2, 3)]
    slots, hashes, offsets, option = transfer_args(ems, [1, 2, 3], [1, 2, 3])
    fut = cc.async_save(slot_mapping=slots, hashes=hashes, offsets=offsets, option=option)
    slots.clear()   # the call copied its arguments
    result = cc.get_result(fut)
    assert (result.success, result.total) == (3, 3) and cc.is_ready(fut)
    zero(kv)
    faults(root, sleep_s={"load": 0.3})
    fut = cc.async_load(*transfer_args(ems, [1, 2, 3], [1, 2, 3]))
    assert not cc.is_ready(fut)
    assert wait_until(lambda: cc.is_ready(fut))
    assert cc.get_result(fut).success == 3
    assert [block_bytes(kv, b) for b in (1, 2, 3)] == saved
    with pytest.raises(ems.EmsException) as exc:
        cc.is_ready("not a future")
    assert status(exc) == ems.EmsErrorCode.EMS_INVALID_ARGUMENT


def test_async_faults_surface_in_get_result(ems: ModuleType, root: Path) -> None:
    cc, _ = setup_cc(ems)
    faults(root, **{"raise": ["save"], "timeout": ["load"]})
    fut = cc.async_save(*transfer_args(ems, [0], [1]))
    with pytest.raises(ems.EmsException) as exc:
        cc.get_result(fut)
    assert status(exc) == ems.EmsErrorCode.EMS_INTERNAL_ERROR
    fut = cc.async_load(*transfer_args(ems, [0], [1], timeout=50))
    with pytest.raises(ems.EmsException) as exc:
        cc.get_result(fut)
    assert status(exc) == ems.EmsErrorCode.EMS_TIMEOUT
    faults(root, save_first_k=2)
    assert cc.get_result(cc.async_save(*transfer_args(ems, [0, 1, 2], [1, 2, 3]))).success == 2
