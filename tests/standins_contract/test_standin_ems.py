"""Unit tests of the EMS contract stand-in (tests/standins/ems), in-process and fast.

The stand-in must behave as the documented Huawei EMS SDK (ContextCaching V1) does; these tests pin
that contract: hash-addressed save/load/exists over registered paddle CPU tensors, the
leading-consecutive ``CcResult``, the async futures and the fault knobs of
``$EMS_STANDIN_DIR/faults.json``.  What it rejects (every ``EMS_INVALID_ARGUMENT`` case, the
singleton's life cycle) is in test_standin_ems_rejections.py.
"""
from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import numpy as np
import pytest

pytest.importorskip("paddle")

from tests.standin_ems_helpers import (BLOCK_SIZE, BLOCKS, block_bytes, ems_standin, setup_cc,  # noqa: E402
                                       slots_of, status, transfer_args)


@pytest.fixture
def ems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """The stand-in as ``ems``, with its data in a fresh directory; the singleton reset after."""
    yield from ems_standin(monkeypatch, tmp_path)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ems"


def zero(kv: list[list[Any]]) -> None:
    for layer in kv:
        for t in layer:
            ctypes.memset(t.data_ptr(), 0, int(t.numel()) * t.element_size())


def faults(root: Path, **knobs: Any) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "faults.json").write_text(json.dumps(knobs))


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
