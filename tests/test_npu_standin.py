"""The NPU platform (ops/npu.py) over the pyACL contract stand-in: device memory the host cannot
reach, IPC export and import, swap copies batched where the runtime can and async otherwise."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ops.modes import DEVICE_TO_HOST, HOST_TO_DEVICE

STANDINS = str(Path(__file__).resolve().parent / "standins")
SHAPE = (16, 2, 4, 8)  # [blocks, heads, block_size, head_dim]
LAYERS = 3


@pytest.fixture
def acl(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(STANDINS)
    monkeypatch.setenv("ACL_STANDIN_DIR", str(tmp_path / "acl"))
    (tmp_path / "acl").mkdir()
    import acl as module

    yield module
    for name in [m for m in sys.modules if m == "acl" or m.startswith("acl.")]:
        del sys.modules[name]


def _caches(acl, batch: bool, tmp_path):
    from ops.npu import NpuPlatform

    if not batch:
        (tmp_path / "acl" / "faults.json").write_text(json.dumps({"batch_not_supported": True}))
    engine, ctm = NpuPlatform(instance="e1"), NpuPlatform(instance="e1")
    engine.set_device(0)
    ctm.set_device(0)
    rng = np.random.default_rng(0)
    exported, attached = [], []
    for layer in range(LAYERS):
        t = engine.empty(list(SHAPE), "bfloat16")
        engine.write_bytes(t, rng.integers(0, 256, engine.read_bytes(t).shape, dtype=np.uint8))
        engine.set_data_ipc(t, f"key_caches_{layer}_rank0.device0")
        exported.append(t)
        attached.append(ctm.share_external_data_(SimpleNamespace(dtype="bfloat16"),
                                                 f"key_caches_{layer}_rank0.device0", list(SHAPE)))
    return engine, ctm, exported, attached


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "async-fallback"])
def test_swap_round_trip_is_bit_exact_with_a_constant_number_of_runtime_calls(acl, tmp_path, batch):
    engine, ctm, exported, attached = _caches(acl, batch, tmp_path)
    block_bytes = int(np.prod(SHAPE[1:])) * 2
    num_cpu = 8
    host = [ctm.host_alloc(num_cpu * block_bytes) for _ in range(LAYERS)]
    plan = ctm.plan_all_layers(attached, host, num_cpu)
    try:
        want = [engine.read_bytes(t) for t in exported]
        gpu, cpu = [1, 3, 4, 9, 12], [0, 1, 2, 3, 4]  # scattered: runs (1), (3,4), (9), (12)
        acl.standin_reset_calls()
        ctm.run_plan(plan, gpu, cpu, DEVICE_TO_HOST)
        calls = acl.standin_calls()
        assert calls.get("memcpy", 0) == 0, "no synchronous copy per run per layer"
        assert calls.get("synchronize_stream") == 1
        if batch:
            assert calls.get("memcpy_batch_async") == 1 and calls.get("memcpy_async", 0) == 0
        else:
            assert calls.get("memcpy_async") == 4 * LAYERS  # one per run per layer, queued on one stream
        for t in exported:  # the engine reuses the blocks
            engine.write_bytes(t, np.zeros(engine.read_bytes(t).shape, np.uint8))
        ctm.run_plan(plan, [2, 5, 6, 7, 15], cpu, HOST_TO_DEVICE)
        for t, w in zip(exported, want):
            got = engine.read_bytes(t)
            assert np.array_equal(got[[2, 5, 6, 7, 15]], w[gpu])
            assert not got[[0, 1, 3, 4]].any()
    finally:
        for ptr in host:
            ctm.host_free(ptr)
        for layer, (t, view) in enumerate(zip(exported, attached)):
            name = f"key_caches_{layer}_rank0.device0"
            ctm.unset_data_ipc(view, name, close_ipc=True)  # importers close first (CANN docs)
            engine.unset_data_ipc(t, name, close_ipc=False, unlink_shm=True)
            engine.free(t)


def test_a_bad_block_id_copies_nothing(acl, tmp_path):
    engine, ctm, exported, attached = _caches(acl, True, tmp_path)
    block_bytes = int(np.prod(SHAPE[1:])) * 2
    host = [ctm.host_alloc(4 * block_bytes) for _ in range(LAYERS)]
    plan = ctm.plan_all_layers(attached, host, 4)
    try:
        acl.standin_reset_calls()
        with pytest.raises(ValueError, match="16"):
            ctm.run_plan(plan, [1, 16], [0, 1], DEVICE_TO_HOST)
        assert not acl.standin_calls().get("memcpy_batch_async")
    finally:
        for ptr in host:
            ctm.host_free(ptr)
        for layer, (t, view) in enumerate(zip(exported, attached)):
            name = f"key_caches_{layer}_rank0.device0"
            ctm.unset_data_ipc(view, name, close_ipc=True)
            engine.unset_data_ipc(t, name, close_ipc=False, unlink_shm=True)
            engine.free(t)


def test_check_npu_script_verifies_round_trips_over_the_standin(tmp_path):
    """scripts/check_npu.py, the check an Ascend host runs, end to end over the pyACL stand-in."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "acl").mkdir()
    env = {**os.environ, "PYTHONPATH": STANDINS, "ACL_STANDIN_DIR": str(tmp_path / "acl")}
    proc = subprocess.run([sys.executable, str(repo / "scripts" / "check_npu.py"), "--blocks", "16",
                           "--block-bytes", "4096", "--layers", "2", "--repeat", "1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bit_exact"] is True and result["d2h_gbps"] > 0 and result["h2d_ratio"] > 0
    assert "bit-exact" in proc.stdout
