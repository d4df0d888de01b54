"""The queue's C extensions and local link under misuse and load: an uninitialised seal key, a
body check whose own calls fail, and a large frame arriving in many small pieces."""
from __future__ import annotations

import os
import random
import re
import socket
import time

import pytest

from cache_manager.queue import _wire_check, _wire_seal, wire
from cache_manager.queue.local_link import LENGTH, FrameStream

SESSION = bytes(range(16))


# -- a) wire_seal.Key that skipped __init__ ------------------------------------------------------

def test_an_uninitialised_key_refuses_every_method_with_a_clear_error():
    key = _wire_seal.Key.__new__(_wire_seal.Key)
    frame = wire.seal(b"body", b"s" * 32, SESSION, 1, 1)
    calls = [lambda: key.mac(b"data"), lambda: key.seal(b"body", SESSION, 1, 1), lambda: key.open(frame),
             lambda: key.open(bytearray(frame))]
    for call in calls:
        # Before: mac and seal answered under an all-zero HMAC state, open raised SystemError.
        with pytest.raises(RuntimeError, match="not initialised"):
            call()


def test_a_key_initialised_after_new_works_and_a_failed_reinit_changes_nothing():
    key = _wire_seal.Key.__new__(_wire_seal.Key)
    key.__init__(b"s" * 32, wire.MAGIC, wire.PROTOCOL_VERSION, wire.MAX_FRAME_BYTES, wire.BadFrame)
    frame = key.seal(b"body", SESSION, 3, 4)
    assert frame == wire.seal(b"body", b"s" * 32, SESSION, 3, 4)
    with pytest.raises(TypeError):
        key.__init__(b"other", b"ABCD", 2, wire.MAX_FRAME_BYTES, 5)  # a valid magic, a bad error type
    assert key.open(frame) == (SESSION, 3, 4, b"body")
    with pytest.raises(wire.BadFrame, match="authentication"):
        key.open(frame[:-1] + bytes([frame[-1] ^ 1]))


# -- b) wire_check.c stops at a call that fails --------------------------------------------------

def _check_with_one_failed_allocation(testcapi, body, nth):
    """_wire_check.check(body) (what wire.check_plain raises BadFrame on) with the ``nth`` memory
    allocation from here on failing: its verdict, or the exception it raised."""
    testcapi.set_nomemory(nth, nth + 1)
    try:
        outcome = _wire_check.check(body, wire.MAX_DEPTH, wire.MAX_ITEMS)
    except BaseException as exc:  # the very type is what is checked
        outcome = exc
    finally:
        testcapi.remove_mem_hooks()
    return outcome


@pytest.mark.parametrize("body", [
    [float("inf"), {1, 2}],
    {"a": [1, float("nan")], "b": [object()]},
    [[float("-inf")], 3 + 0j],
    [{1: 2}, [float("inf")]],
])
def test_a_failing_call_inside_the_body_check_raises_its_error_never_a_wrong_verdict(body):
    # The repr of a non-finite float, or a reason's str, can fail (here: one allocation, each in
    # turn).  Before, the check ran on with the exception set: a later reason came back over it,
    # and the user saw "SystemError: ... returned a result with an exception set".  (The check is
    # called directly: with allocations failing, CPython 3.11's own construction of the BadFrame
    # that wire.check_plain raises can end in a SystemError of its own.)
    testcapi = pytest.importorskip("_testcapi")
    if not hasattr(testcapi, "set_nomemory"):
        pytest.skip("_testcapi.set_nomemory is not available")
    reason = _wire_check.check(body, wire.MAX_DEPTH, wire.MAX_ITEMS)
    assert isinstance(reason, str)
    with pytest.raises(wire.BadFrame, match=re.escape(reason)):
        wire.check_plain(body)
    memory_errors = 0
    for nth in range(40):
        outcome = _check_with_one_failed_allocation(testcapi, body, nth)
        assert not isinstance(outcome, SystemError), (nth, outcome)
        if isinstance(outcome, MemoryError):
            memory_errors += 1
        else:  # the allocation that failed was not one the check needed: the clean verdict
            assert outcome == reason, (nth, outcome)
    assert memory_errors > 0


def test_the_body_check_still_gives_its_reasons():
    assert wire.check_plain({"a": [1, 2.5, b"x", None, True, {"b": "c"}]}) is None
    for body, reason in [([float("nan")], "non-finite number nan"), ({1: 2}, "a map key is not a string"),
                         ([set()], "set is not plain data"), ([[[1]]], "nested deeper than 2 levels")]:
        with pytest.raises(wire.BadFrame, match=reason):
            wire.check_plain(body, max_depth=2)
    with pytest.raises(wire.BadFrame, match="more than 3 items"):
        wire.check_plain([1, 2, 3, 4], max_items=3)


# -- c) local_link.FrameStream.recv_frames accumulates a split frame in linear time ---------------

def test_megabyte_frames_in_many_small_writes_arrive_bit_exact_and_are_copied_once():
    sizes = [0, 1, 3, 5, 60_000, 3 * 1024 * 1024 + 7, 70_000, 0, 5 * 1024 * 1024, 2]
    frames = [os.urandom(n) for n in sizes]
    stream = b"".join(LENGTH.pack(len(f)) + f for f in frames)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = FrameStream(b)
    rng = random.Random(24)
    got: list[bytes] = []
    at = 0
    try:
        while at < len(stream):  # length prefixes and bodies cut anywhere, a byte to 70 KB a write
            piece = rng.choice([1, 2, 3, 100, 4096, 8191, 70_000])
            a.sendall(stream[at:at + piece])
            at += piece
            got += receiver.recv_frames(64)
        deadline = time.monotonic() + 10
        while len(got) < len(frames) and time.monotonic() < deadline:
            got += receiver.recv_frames(64)
    finally:
        a.close()
    assert [len(g) for g in got] == sizes
    assert got == frames and all(type(g) is bytes for g in got)
    # Before, every read of a partial frame re-joined all its bytes so far: about 8 MiB * 1,600
    # writes / 2 (gigabytes) for these.  Now each byte is copied into a partial frame at most once.
    assert receiver.partial_bytes_copied <= len(stream)
    receiver.close()
