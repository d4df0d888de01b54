"""The NPU platform (ops/npu.py) over the pyACL contract stand-in: device memory the host cannot
reach, IPC export and import, swap copies batched where the runtime can and async otherwise."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ops.modes import DEVICE_TO_HOST, HOST_TO_DEVICE
from tests.npu_helpers import LAYERS, STANDINS, Rig, forget_standin_modules, use_acl_standin


@pytest.fixture
def acl(tmp_path, monkeypatch):
    use_acl_standin(tmp_path, monkeypatch)
    import acl as module

    yield module
    forget_standin_modules()


@pytest.fixture
def rig(acl):
    made = Rig()
    yield made
    made.close()


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "async-fallback"])
def test_swap_round_trip_is_bit_exact_with_a_constant_number_of_runtime_calls(acl, tmp_path, batch):
    if not batch:
        (tmp_path / "acl" / "faults.json").write_text(json.dumps({"batch_not_supported": True}))
    rig = Rig()
    try:
        want = rig.read()
        gpu, cpu = [1, 3, 4, 9, 12], [0, 1, 2, 3, 4]  # scattered: runs (1), (3,4), (9), (12)
        acl.standin_reset_calls()
        rig.ctm.run_plan(rig.plan, gpu, cpu, DEVICE_TO_HOST)
        calls = acl.standin_calls()
        assert calls.get("memcpy", 0) == 0, "no synchronous copy per run per layer"
        assert calls.get("synchronize_stream") == 1
        if batch:
            assert calls.get("memcpy_batch_async") == 1 and calls.get("memcpy_async", 0) == 0
        else:
            assert calls.get("memcpy_async") == 4 * LAYERS  # one per run per layer, queued on one stream
        rig.zero()  # the engine reuses the blocks
        rig.ctm.run_plan(rig.plan, [2, 5, 6, 7, 15], cpu, HOST_TO_DEVICE)
        for got, w in zip(rig.read(), want):
            assert np.array_equal(got[[2, 5, 6, 7, 15]], w[gpu])
            assert not got[[0, 1, 3, 4]].any()
    finally:
        rig.close()


def test_a_bad_block_id_copies_nothing(acl, rig):
    acl.standin_reset_calls()
    with pytest.raises(ValueError, match="16"):
        rig.ctm.run_plan(rig.plan, [1, 16], [0, 1], DEVICE_TO_HOST)
    assert not acl.standin_calls().get("memcpy_batch_async")


def test_check_npu_script_verifies_round_trips_over_the_standin(tmp_path):
    """scripts/check_npu.py, the check an Ascend host runs, end to end over the pyACL stand-in."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "acl").mkdir()
    env = {**os.environ, "PYTHONPATH": STANDINS, "ACL_STANDIN_DIR": str(tmp_path / "acl")}
    proc = subprocess.run([sys.executable, str(repo / "scripts" / "check_npu.py"), "--blocks", "16",
                           "--block-bytes", "4096", "--layers", "2", "--repeat", "1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bit_exact"] is True and result["d2h_gbps"] > 0 and result["h2d_ratio"] > 0
    assert "bit-exact" in proc.stdout
