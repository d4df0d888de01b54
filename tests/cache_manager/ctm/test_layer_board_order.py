"""The layer board's publication is a release store and its check an acquire load (C11 atomics in
``ops/csrc/shm_atomic.c``), so a reader that sees "layer l landed" also sees layer l's bytes.

On x86 (total store order) plain stores and loads already give that order, so the stress test below
cannot fail there for ordering reasons; it guards the contract (publish only after the bytes, check
before reading them) and runs as is on the aarch64 hosts of Ascend machines, where it can."""
from __future__ import annotations

import itertools
import multiprocessing
import os
import time

import numpy as np
import pytest

from cache_manager import layer_progress
from ops import _shm_atomic
from cache_manager.layer_progress import LayerBoard, LayerPublisher, LayerwiseRef, pack, unpack
from ops.shm import SharedMemorySegment

_names = itertools.count()
GOLDEN = 0x9E3779B97F4A7C15


def _suffix() -> str:
    return f"order{os.getpid()}x{next(_names)}"


class _Spy:
    """The atomics, counting each call by name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        real = getattr(_shm_atomic, name)

        def call(*args):
            self.calls.append(name)
            return real(*args)
        return call


def test_every_board_access_goes_through_the_atomics(monkeypatch):
    spy = _Spy()
    monkeypatch.setattr(layer_progress, "_shm_atomic", spy)
    board = LayerBoard(2, _suffix(), create=True)
    try:
        board.set_landed(3, 1, pack(7, 2))
        board.set_blocks(3, 0, pack(7, 5))
        board.set_computed(3, pack(7, 4))
        assert spy.calls == ["store_release"] * 3
        spy.calls.clear()
        assert unpack(board.landed(3, 1), 7) == 2 and unpack(board.blocks(3, 0), 7) == 5
        assert unpack(board.computed(3), 7) == 4
        assert board.landed_row(3) == [0, pack(7, 2)]
        assert spy.calls == ["load_acquire"] * 3 + ["load_acquire_row"]
        spy.calls.clear()
        pub = LayerPublisher(board, 0, LayerwiseRef(3, 7, await_compute=True))
        pub.layers_done(1)
        pub.wait_computed(4, time.monotonic() + 1.0)
        assert spy.calls == ["store_release", "load_acquire"]
        with pytest.raises(IndexError):
            board.landed(layer_progress.SLOTS, 0)
        with pytest.raises(IndexError):
            board.set_landed(0, layer_progress.board_shape(board.tp)[1], 1)  # past the row: never the next slot's
    finally:
        board.close()


def test_the_atomics_check_bounds_and_alignment():
    words = np.zeros(4, np.int64)
    _shm_atomic.store_release(words, 3, -(1 << 62))
    assert _shm_atomic.load_acquire(words, 3) == -(1 << 62) and words[3] == -(1 << 62)
    assert _shm_atomic.load_acquire_row(words, 1, 3) == [0, 0, -(1 << 62)]
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            _shm_atomic.load_acquire(words, bad)
    with pytest.raises(IndexError):
        _shm_atomic.load_acquire_row(words, 2, 3)
    with pytest.raises(ValueError, match="aligned"):
        _shm_atomic.store_release(memoryview(np.zeros(40, np.uint8))[1:33], 0, 1)
    with pytest.raises(BufferError):
        _shm_atomic.store_release(bytes(8), 0, 1)  # read-only


def _expected(i: int, n: int) -> np.ndarray:
    return np.full(n, (i * GOLDEN) & 0xFFFF_FFFF_FFFF_FFFF, np.uint64)


def _writer(suffix: str, data_name: str, rounds: int, words: int) -> None:
    """Rank 0 of a task: write round i's bytes, publish landed = i, wait for the reader's ack."""
    board = LayerBoard(1, suffix)
    seg = SharedMemorySegment(data_name)
    data = np.ndarray(words, np.uint64, buffer=seg.buf)
    deadline = time.monotonic() + 60
    try:
        for i in range(1, rounds + 1):
            data[:] = _expected(i, words)
            board.set_landed(0, 0, pack(1, i))  # after every byte of the round
            while unpack(board.computed(0), 1) != i:  # the reader has read them: it may be overwritten
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no ack of round {i}")
    finally:
        del data
        seg.close()
        board.close()


def test_a_reader_that_sees_the_publication_sees_every_byte():
    rounds, words = 3000, 2048  # 16 KiB a round
    suffix, data_name = _suffix(), f"ctm.test.order{os.getpid()}x{next(_names)}"
    board = LayerBoard(1, suffix, create=True)
    seg = SharedMemorySegment(data_name, words * 8, create=True)
    data = np.ndarray(words, np.uint64, buffer=seg.buf)
    proc = multiprocessing.get_context("spawn").Process(target=_writer, args=(suffix, data_name, rounds, words))
    proc.start()
    torn = []
    try:
        deadline = time.monotonic() + 60
        for i in range(1, rounds + 1):
            while unpack(board.landed(0, 0), 1) != i:
                assert proc.is_alive() or unpack(board.landed(0, 0), 1) == i, f"writer died at round {i}"
                assert time.monotonic() < deadline, f"round {i} never published"
            if not np.array_equal(data, _expected(i, words)):
                torn.append(i)
            board.set_computed(0, pack(1, i))  # release: our reads of round i come before its overwrite
        proc.join(30)
        assert proc.exitcode == 0
        assert torn == [], f"rounds published before their bytes were visible: {torn[:10]}"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        del data
        seg.close()
        seg.unlink()
        board.close()
