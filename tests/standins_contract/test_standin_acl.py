"""Unit tests of the pyACL contract stand-in (tests/standins/acl), fast and in-process.

The stand-in must behave as documented pyACL does and refuse what CANN forbids; these tests pin
that contract: bit-exact H2D/D2H/D2D round trips, asynchronous copies that land only at
synchronize, the batched copy and its not-supported knob, device pointers the host cannot
dereference, the kind/range/dest_max/alignment checks, the per-thread device and the per-process
call counts.  IPC across two processes is in test_standin_acl_ipc.py.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

from tests.standin_acl_helpers import D2D, D2H, DEVICE_BYTES, H2D, H2H, N, acl_standin, get, ok, pattern, put


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "acl"


@pytest.fixture
def acl(monkeypatch: pytest.MonkeyPatch, root: Path) -> Iterator[ModuleType]:
    """The stand-in as ``acl``, initialised, this thread on device 0; forgotten after the test."""
    yield from acl_standin(monkeypatch, root)


def knobs(root: Path, **values: Any) -> None:
    (root / "faults.json").write_text(json.dumps(values))


def mapped(addr: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


# -- copies ------------------------------------------------------------------------------
def test_round_trips_are_bit_exact(acl: ModuleType) -> None:
    data = pattern(N)
    host, back = ok(acl.rt.malloc_host(N)), ok(acl.rt.malloc_host(N))
    dev, dev2 = ok(acl.rt.malloc(N, 0)), ok(acl.rt.malloc(2 * N, 0))
    put(host, data)
    assert acl.rt.memcpy(dev, N, host, N, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert acl.rt.memcpy(dev2 + N, N, dev, N, acl.ACL_MEMCPY_DEVICE_TO_DEVICE) == 0
    assert acl.rt.memcpy(back, N, dev2 + N, N, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
    assert get(back, N) == data
    pageable = ctypes.create_string_buffer(N)  # the synchronous copy takes any mapped host memory
    assert acl.rt.memcpy(ctypes.addressof(pageable), N, dev, N, D2H) == 0
    assert pageable.raw == data
    assert acl.rt.memcpy(back, N, host, N, acl.ACL_MEMCPY_HOST_TO_HOST) == 0


def test_fresh_device_memory_is_poisoned_not_zeroed(acl: ModuleType) -> None:
    dev, host = ok(acl.rt.malloc(4096, 0)), ok(acl.rt.malloc_host(4096))
    assert acl.rt.memcpy(host, 4096, dev, 4096, D2H) == 0
    assert get(host, 4096) == b"\xa5" * 4096


def test_async_copies_land_only_at_synchronize(acl: ModuleType) -> None:
    data = pattern(N, seed=2)
    src, dst = ok(acl.rt.malloc_host(N)), ok(acl.rt.malloc_host(N))
    put(src, data)
    put(dst, bytes(N))
    dev = ok(acl.rt.malloc(N, 0))
    stream = ok(acl.rt.create_stream())
    assert acl.rt.memcpy_async(dev, N, src, N, H2D, stream) == 0
    assert acl.rt.memcpy_async(dst, N, dev, N, D2H, stream) == 0
    assert get(dst, N) == bytes(N)  # nothing moved yet
    assert acl.rt.memcpy(dst, N, dev, N, D2H) == 0  # the synchronous copy does not wait for the stream
    assert get(dst, N) == b"\xa5" * N
    assert acl.rt.synchronize_stream(stream) == 0
    assert get(dst, N) == data
    assert acl.rt.destroy_stream(stream) == 0
    assert acl.rt.synchronize_stream(stream) == acl.ACL_ERROR_RT_INVALID_HANDLE


def test_async_copies_refuse_host_to_host_and_pageable_memory(acl: ModuleType) -> None:
    host, dev = ok(acl.rt.malloc_host(N)), ok(acl.rt.malloc(N, 0))
    stream = ok(acl.rt.create_stream())
    assert acl.rt.memcpy_async(host, N, host, N, H2H, stream) == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    pageable = ctypes.create_string_buffer(N)
    assert acl.rt.memcpy_async(ctypes.addressof(pageable), N, dev, N, D2H, stream) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.memcpy_async(host, N, dev, N, D2H, 12345) == acl.ACL_ERROR_RT_INVALID_HANDLE


def test_destroy_stream_runs_queued_copies_and_freed_memory_fails_synchronize(acl: ModuleType) -> None:
    host, dev = ok(acl.rt.malloc_host(N)), ok(acl.rt.malloc(N, 0))
    put(host, pattern(N))
    stream = ok(acl.rt.create_stream())
    assert acl.rt.memcpy_async(dev, N, host, N, H2D, stream) == 0
    assert acl.rt.destroy_stream(stream) == 0
    back = ok(acl.rt.malloc_host(N))
    assert acl.rt.memcpy(back, N, dev, N, D2H) == 0 and get(back, N) == pattern(N)
    stream = ok(acl.rt.create_stream())
    assert acl.rt.memcpy_async(back, N, dev, N, D2H, stream) == 0
    assert acl.rt.free(dev) == 0
    assert acl.rt.synchronize_stream(stream) == acl.ACL_ERROR_RT_PARAM_INVALID  # its memory is gone


def batch_args(pairs: list[tuple[int, int]], sizes: list[int]) -> tuple[list[int], ...]:
    dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
    return dsts, list(sizes), srcs, list(sizes)


def test_batched_copy_queues_all_then_lands_at_synchronize(acl: ModuleType) -> None:
    blk = 4096
    host, back = ok(acl.rt.malloc_host(4 * blk)), ok(acl.rt.malloc_host(4 * blk))
    dev = ok(acl.rt.malloc(4 * blk, 0))
    data = pattern(4 * blk, seed=3)
    put(host, data)
    put(back, bytes(4 * blk))
    stream = ok(acl.rt.create_stream())
    h2d, d2h = (acl.rt.MemcpyBatchAttr(acl.rt.MEM_LOC_DEVICE, acl.rt.MEM_LOC_HOST),
                acl.rt.MemcpyBatchAttr(acl.rt.MEM_LOC_HOST, acl.rt.MEM_LOC_DEVICE))
    # copies 0..3 host->device (blocks in reverse), copies 4..5 device->host of two of them
    pairs = [(dev + i * blk, host + (3 - i) * blk) for i in range(4)] + [(back, dev), (back + blk, dev + 3 * blk)]
    dsts, maxs, srcs, sizes = batch_args(pairs, [blk] * 6)
    assert acl.rt.memcpy_batch_async(dsts, maxs, srcs, sizes, [h2d, d2h], [0, 4], stream) == (acl.SIZE_MAX, 0)
    assert get(back, 2 * blk) == bytes(2 * blk)
    assert acl.rt.synchronize_stream(stream) == 0
    assert get(back, blk) == data[3 * blk:] and get(back + blk, blk) == data[:blk]
    assert acl.standin_calls()["memcpy_batch_async"] == 1


def test_batched_copy_names_the_bad_copy_and_queues_nothing(acl: ModuleType) -> None:
    blk = 4096
    host, dev = ok(acl.rt.malloc_host(2 * blk)), ok(acl.rt.malloc(2 * blk, 0))
    stream = ok(acl.rt.create_stream())
    h2d = acl.rt.MemcpyBatchAttr(acl.rt.MEM_LOC_DEVICE, acl.rt.MEM_LOC_HOST)
    pairs = [(dev, host), (dev + blk, host + blk), (dev + 2 * blk, host)]  # the third runs past the allocation
    dsts, maxs, srcs, sizes = batch_args(pairs, [blk] * 3)
    assert acl.rt.memcpy_batch_async(dsts, maxs, srcs, sizes, [h2d], [0], stream) == (2, acl.ACL_ERROR_RT_PARAM_INVALID)
    assert acl.rt.memcpy_batch_async(dsts[:2], maxs[:2], [host, dev], sizes[:2], [h2d], [0], stream) == (
        1, acl.ACL_ERROR_RT_INVALID_MEMORY_TYPE)
    assert acl.rt.memcpy_batch_async(dsts[:2], [blk, blk - 1], srcs[:2], sizes[:2], [h2d], [0], stream) == (
        1, acl.ACL_ERROR_INVALID_PARAM)
    bad = (acl.SIZE_MAX, acl.ACL_ERROR_INVALID_PARAM)
    assert acl.rt.memcpy_batch_async(dsts[:2], maxs[:2], srcs[:2], sizes[:2], [h2d], [1], stream) == bad
    assert acl.rt.memcpy_batch_async(dsts[:2], maxs[:2], srcs[:2], sizes[:2], [h2d, h2d], [0, 0], stream) == bad
    assert acl.rt.memcpy_batch_async(dsts[:2], maxs[:2], srcs, sizes[:2], [h2d], [0], stream) == bad
    assert acl.rt.memcpy_batch_async([], [], [], [], [h2d], [0], stream) == bad
    assert not acl._local.local().streams[stream].tasks  # nothing was queued


def test_batch_not_supported_knob(acl: ModuleType, root: Path) -> None:
    host, dev = ok(acl.rt.malloc_host(4096)), ok(acl.rt.malloc(4096, 0))
    stream = ok(acl.rt.create_stream())
    args = ([dev], [4096], [host], [4096], [acl.rt.MemcpyBatchAttr(acl.rt.MEM_LOC_DEVICE, acl.rt.MEM_LOC_HOST)], [0],
            stream)
    knobs(root, batch_not_supported=True)
    assert acl.rt.memcpy_batch_async(*args) == (acl.SIZE_MAX, acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    knobs(root)  # re-read at every call
    assert acl.rt.memcpy_batch_async(*args) == (acl.SIZE_MAX, 0)


# -- what is refused ---------------------------------------------------------------------
def test_device_pointers_are_not_host_mapped(acl: ModuleType) -> None:
    dev, host = ok(acl.rt.malloc(N, 0)), ok(acl.rt.malloc_host(N))
    assert mapped(host) and host % os.sysconf("SC_PAGE_SIZE") == 0
    assert not any(mapped(a) for a in (dev, dev + N // 2, dev + N - 1))  # a host memmove to it would fault


def test_kind_must_match_where_pointers_live(acl: ModuleType) -> None:
    host, dev = ok(acl.rt.malloc_host(N)), ok(acl.rt.malloc(N, 0))
    wrong = acl.ACL_ERROR_RT_INVALID_MEMORY_TYPE
    assert acl.rt.memcpy(host, N, host, N, H2D) == wrong  # destination is host memory
    assert acl.rt.memcpy(host, N, host, N, D2H) == wrong  # source is host memory
    assert acl.rt.memcpy(dev, N, dev, N, H2H) == wrong
    assert acl.rt.memcpy(dev, N, host, N, D2D) == wrong
    assert acl.rt.memcpy(dev, N, host, N, 4) == acl.ACL_ERROR_INVALID_PARAM


def test_dest_max_and_ranges_are_checked(acl: ModuleType) -> None:
    host, dev = ok(acl.rt.malloc_host(N)), ok(acl.rt.malloc(N, 0))
    assert acl.rt.memcpy(dev, N - 1, host, N, H2D) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.rt.memcpy(dev + 1, N, host, N, H2D) == acl.ACL_ERROR_RT_PARAM_INVALID  # runs past the allocation
    assert acl.rt.memcpy(dev + N + 4096, N, host, N, H2D) == acl.ACL_ERROR_RT_PARAM_INVALID  # no allocation there
    assert acl.rt.memcpy(host + 1, N, dev, N, D2H) == acl.ACL_ERROR_RT_PARAM_INVALID  # past the pinned buffer
    assert acl.rt.memcpy(0x10, N, dev, N, D2H) == acl.ACL_ERROR_RT_PARAM_INVALID  # not mapped at all
    assert acl.rt.memcpy(dev, N, host, -1, H2D) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.rt.free(dev + 4096) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.free(dev) == 0
    assert acl.rt.memcpy(dev, N, host, N, H2D) == acl.ACL_ERROR_RT_PARAM_INVALID  # freed
    assert acl.rt.free(dev) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.free_host(host) == 0 and acl.rt.free_host(host) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.malloc(DEVICE_BYTES + 1, 0) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert acl.rt.malloc(0, 0) == (0, acl.ACL_ERROR_INVALID_PARAM)


def test_exports_must_be_page_aligned_inside_an_allocation(acl: ModuleType, root: Path) -> None:
    dev, host = ok(acl.rt.malloc(4 * 4096, 0)), ok(acl.rt.malloc_host(4096))
    get_key = acl.rt.ipc_mem_get_export_key
    assert get_key(dev + 64, 4096, 65, 1) == ("", acl.ACL_ERROR_RT_ADDR_UNALIGNED)
    assert get_key(dev, 5 * 4096, 65, 1) == ("", acl.ACL_ERROR_RT_PARAM_INVALID)
    assert get_key(host, 4096, 65, 1) == ("", acl.ACL_ERROR_RT_PARAM_INVALID)
    assert get_key(dev, 4096, 64, 1) == ("", acl.ACL_ERROR_INVALID_PARAM)
    key = ok(get_key(dev + 4096, 2 * 4096, 65, 1))  # a page-aligned part of an allocation
    assert isinstance(key, str) and 0 < len(key) < 65
    knobs(root, export_whole_allocation=True)
    assert get_key(dev + 4096, 2 * 4096, 65, 1) == ("", acl.ACL_ERROR_RT_PARAM_INVALID)
    assert ok(get_key(dev, 4 * 4096, 65, 1)) != key
    assert acl.rt.free(dev) == acl.ACL_ERROR_RT_MEMORY_FREE  # exported: close first


def test_the_device_is_per_thread(acl: ModuleType) -> None:
    dev, host = ok(acl.rt.malloc(N, 0)), ok(acl.rt.malloc_host(N))
    stream0 = ok(acl.rt.create_stream())
    seen: dict[str, Any] = {}

    def worker() -> None:
        seen["malloc"] = acl.rt.malloc(N, 0)
        seen["memcpy"] = acl.rt.memcpy(host, N, dev, N, D2H)
        seen["stream"] = acl.rt.create_stream()
        seen["get"] = acl.rt.get_device()
        seen["set"] = acl.rt.set_device(1)
        seen["get1"] = acl.rt.get_device()
        seen["cross"] = acl.rt.memcpy(host, N, dev, N, D2H)  # device 0 memory from a device 1 thread
        seen["stream0"] = acl.rt.memcpy_async(host, N, dev, N, D2H, stream0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    null = acl.ACL_ERROR_RT_CONTEXT_NULL
    assert seen["malloc"] == (0, null) and seen["memcpy"] == null and seen["stream"] == (0, null)
    assert seen["get"] == (-1, null)
    assert seen["set"] == 0 and seen["get1"] == (1, 0)
    assert seen["cross"] == acl.ACL_ERROR_RT_PARAM_INVALID
    assert seen["stream0"] == acl.ACL_ERROR_RT_STREAM_CONTEXT
    assert acl.rt.get_device() == (0, 0)  # this thread is still on device 0
    assert acl.rt.set_device(99) == acl.ACL_ERROR_RT_INVALID_DEVICEID


def test_init_comes_first(acl: ModuleType) -> None:
    assert acl.init() == acl.ACL_ERROR_REPEAT_INITIALIZE
    assert acl.finalize() == 0
    assert acl.rt.malloc(4096, 0) == (0, acl.ACL_ERROR_UNINITIALIZE)
    assert acl.finalize() == acl.ACL_ERROR_REPEAT_FINALIZE
    assert acl.init("/no/such/acl.json") == acl.ACL_ERROR_INVALID_FILE
    assert acl.init() == 0


def test_missing_standin_dir_is_a_setup_error(acl: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACL_STANDIN_DIR")
    with pytest.raises(RuntimeError, match="ACL_STANDIN_DIR"):
        acl.rt.malloc(4096, 0)


# -- counts and knobs --------------------------------------------------------------------
def test_calls_are_counted_and_the_fail_knob_fails_the_nth(acl: ModuleType, root: Path) -> None:
    host, dev = ok(acl.rt.malloc_host(4096)), ok(acl.rt.malloc(4096, 0))
    acl.standin_reset_calls()
    knobs(root, fail={"memcpy": 2})
    results = [acl.rt.memcpy(dev, 4096, host, 4096, H2D) for _ in range(3)]
    assert results == [0, acl.ACL_ERROR_RT_INTERNAL_ERROR, 0]
    assert acl.rt.memcpy(dev, 1, host, 4096, H2D) == acl.ACL_ERROR_INVALID_PARAM  # refused calls count too
    assert acl.standin_calls() == {"memcpy": 4}
    acl.standin_reset_calls()
    assert acl.standin_calls() == {}
    knobs(root, fail={"synchronize_stream": [1]}, fail_code=507899)
    stream = ok(acl.rt.create_stream())
    put(host, b"\x01" * 4096)
    assert acl.rt.memcpy_async(dev, 4096, host, 4096, H2D, stream) == 0
    assert acl.rt.synchronize_stream(stream) == 507899  # the queued copy is dropped
    assert acl.rt.synchronize_stream(stream) == 0
    assert acl.rt.memcpy(host, 4096, dev, 4096, D2H) == 0 and get(host, 4) != b"\x01" * 4


def test_a_broken_faults_file_raises(acl: ModuleType, root: Path) -> None:
    knobs(root, fail={"memcopy": 1})
    with pytest.raises(ValueError, match="memcopy"):
        acl.rt.get_device()
    knobs(root, batch_unsupported=True)
    with pytest.raises(ValueError, match="batch_unsupported"):
        acl.rt.get_device()
