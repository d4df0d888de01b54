"""The whole system on each platform, with real CTM processes: ``cpu`` (the embedded default) and
``npu`` over the pyACL contract stand-in (``tests/standins/acl``; device memory the host cannot
reach through its pointers, so every byte goes through the runtime's copies).

Device bytes are read and written through ``platform.read_bytes``/``write_bytes``, which on the NPU
platform are runtime copies, never host views.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine_hooks import RankDiedError
from tests.npu_helpers import (blocks, clear, fill, forget_standin_modules, leftovers, same,
                               scattered_swaps_are_bit_exact, use_acl_standin)
from tests.service_helpers import SMALL, process_gone, start_service
from transfer_factory.keys import chain_hash_ids

REPO = str(Path(__file__).resolve().parents[3])


@pytest.fixture(params=["cpu", "npu"])
def platform(request, tmp_path, monkeypatch):
    """The platform's name, with the stand-in on the path of this process and of its CTMs for npu."""
    if request.param == "npu":
        use_acl_standin(tmp_path, monkeypatch)
    yield request.param
    forget_standin_modules()


def swap_round_trip(svc, src: int, dst: int, slot: int) -> bool:
    want = blocks(svc, [src])
    svc.swap_to_cpu([src], [slot]).result(timeout=30)
    clear(svc, [src, dst])
    svc.swap_to_gpu([dst], [slot]).result(timeout=30)
    return same(blocks(svc, [dst]), want)


def test_swaps_are_bit_exact(platform):
    svc = start_service(SMALL, platform=platform)
    port = svc.port
    try:
        assert scattered_swaps_are_bit_exact(svc, seed=1)
    finally:
        svc.shutdown()
    assert leftovers(port) == []


def test_staged_storage_round_trip_with_the_file_store(platform, tmp_path):
    svc = start_service(SMALL, platform=platform, storage_backend="file",
                        storage_options={"root": str(tmp_path / "kv"), "fsync": False})
    try:
        fill(svc, seed=2)
        keys = chain_hash_ids([f"npu-{i}" for i in range(3)])
        want = blocks(svc, [2, 3, 8])
        assert svc.write_storage(keys, [2, 3, 8]).result(timeout=30) == [2, 3, 8]
        clear(svc, range(SMALL.num_blocks))
        assert svc.read_storage(keys, [12, 13, 14]).result(timeout=30) == [12, 13, 14]
        assert same(blocks(svc, [12, 13, 14]), want)
    finally:
        svc.shutdown()


def test_a_killed_rank_fails_its_tasks_and_restarts(platform):
    svc = start_service(SMALL, platform=platform)
    port = svc.port
    try:
        fill(svc, seed=3)
        pending = svc.control("sleep", seconds=10.0)
        os.kill(svc.pids()[1], signal.SIGKILL)
        with pytest.raises(RankDiedError, match="rank 1"):
            pending.result(timeout=15)
        svc.restart_rank(1)
        assert swap_round_trip(svc, src=6, dst=7, slot=1)
    finally:
        svc.shutdown()
    assert leftovers(port) == []


ENGINE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, %r)
    from tests.service_helpers import start_service
    svc = start_service(platform=sys.argv[1])
    svc.swap_to_cpu([1, 2], [0, 1]).result(timeout=30)
    print(json.dumps({"port": svc.port, "pids": list(svc.pids().values())}), flush=True)
    time.sleep(600)
""") % REPO


def test_a_killed_engine_leaves_no_process_segment_or_handle(platform, tmp_path):
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, platform], stdout=subprocess.PIPE, text=True,
                              stderr=open(tmp_path / "err", "wb"),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join((REPO, os.environ.get("PYTHONPATH", "")))})
    try:
        line = engine.stdout.readline()
        assert line, (tmp_path / "err").read_text()[-3000:]
        info = json.loads(line)
        assert leftovers(info["port"]), "the engine should have exported its caches"
        engine.kill()
        engine.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (leftovers(info["port"]) or
                                               not all(process_gone(p) for p in info["pids"])):
            time.sleep(0.1)
        assert all(process_gone(p) for p in info["pids"]), "a CTM outlived its engine by 10 s"
        assert leftovers(info["port"]) == []
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_two_engines_on_one_host_do_not_collide(platform):
    a = start_service(SMALL, platform=platform)
    b = start_service(SMALL, platform=platform)
    try:
        fill(a, seed=4)
        fill(b, seed=5)
        want_a, want_b = blocks(a, [3]), blocks(b, [3])
        a.swap_to_cpu([3], [0]).result(timeout=30)
        b.swap_to_cpu([3], [0]).result(timeout=30)  # same slot number, another engine's swap space
        clear(a, [3, 4])
        clear(b, [3, 4])
        a.swap_to_gpu([4], [0]).result(timeout=30)
        b.swap_to_gpu([4], [0]).result(timeout=30)
        assert same(blocks(a, [4]), want_a) and same(blocks(b, [4]), want_b)
    finally:
        a.shutdown()
        b.shutdown()
