"""``scripts/bench_layouts.py`` in a tiny configuration: deepseek-v3 (real 128 KiB latent and 16 KiB
rope blocks) through swap, storage and P/D, and qwen3-next (state groups, which block tasks leave
alone) through swap and storage only (``--skip-pd``: one engine instance fewer keeps the test short),
TP 1, 2 blocks, 1 repetition.  Its last line is the JSON the docs quote: every ratio a positive
number, or null with a reason; it leaves nothing in the system temp dir."""
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = [sys.executable, os.path.join(REPO, "scripts", "bench_layouts.py"), "--presets", "deepseek-v3,qwen3-next",
         "--tp", "1", "--layers", "4", "--max-blocks", "2", "--repeats", "1", "--skip-pd", "qwen3-next"]
RATIOS = ("swap_out_ratio", "swap_in_ratio", "storage_write_ratio", "storage_read_ratio", "pd_ipc_ratio",
          "pd_mooncake_ratio")


def test_bench_layouts_prints_a_ratio_or_a_reason_for_every_path(tmp_path):
    tmpdir = tmp_path / "systmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "CTM_LOG_DIR": str(tmp_path / "log")}
    proc = subprocess.run(BENCH, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert out["bench"] == "layouts"
    assert out["floor_gbps"] > 0
    by_preset = {r["preset"]: r for r in out["results"]}
    assert list(by_preset) == ["deepseek-v3", "qwen3-next"]
    for r in out["results"]:
        assert r["tp"] == 1 and r["blocks"] == 2
        for key in RATIOS:
            assert key in r, key
            value = r[key]
            if value is None:
                assert r["reasons"][key], key
            else:
                assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)

    ds = by_preset["deepseek-v3"]
    # 4 layers + 1 MTP layer, each a 128 KiB latent block and a 16 KiB rope block, on one rank
    assert ds["bytes_per_block"] == 5 * (128 + 16) * 1024
    assert ds["bytes_per_task"] == ds["storage_bytes_per_task"] == ds["pd_bytes_per_task"] == 2 * ds["bytes_per_block"]
    assert all(ds[key] is not None for key in RATIOS), ds["reasons"]
    assert {g["name"]: g["block_bytes"] for g in ds["groups"]} == {"latent_caches": 128 << 10, "rope_caches": 16 << 10}
    assert ds["te_runs_per_rank"] > 0 and ds["te_slices_per_rank"] >= ds["te_runs_per_rank"]

    qn = by_preset["qwen3-next"]
    assert qn["bytes_per_block"] == 2 * 128 * 1024  # layer 3's K and V; the state groups are not blocks
    for key in ("swap_out_ratio", "swap_in_ratio", "storage_write_ratio", "storage_read_ratio"):
        assert qn[key] is not None, qn["reasons"]
    for key in ("pd_ipc_ratio", "pd_mooncake_ratio"):
        assert qn[key] is None and qn["reasons"][key] == "not measured (--skip-pd)"
    assert not os.listdir(tmpdir), f"the bench left {os.listdir(tmpdir)} in the system temp dir"
