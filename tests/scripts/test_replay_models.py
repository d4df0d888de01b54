"""The replay over a 2026 model's cache layout (``replay_trace.py --model PRESET``): every block
group of every layer on every rank written and checked bit-exact through the tiers and over P/D (a
request's state slot too), the bytes each tier moved per request against a naive all-layers-full
layout, and a P/D replay of a layout with a state group between TP sizes refused naming the group."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_TRACE = os.path.join(REPO, "..", "shared", "traces", "synthetic_trace.jsonl")
sys.path.insert(0, os.path.join(REPO, "scripts"))

import replay_workload  # noqa: E402
from cache_manager.cache_presets import preset  # noqa: E402
from tests.scripts.test_replay import trace_slice  # noqa: E402  (the shared trace's first requests)

REPLAY = [sys.executable, os.path.join(REPO, "scripts", "replay_trace.py"), "--json", "--no-progress"]
TIERS = {"device_to_host": ("bytes_d2h", "swap_out_blocks"), "host_to_device": ("bytes_h2d", "swap_in_blocks"),
         "to_storage": ("bytes_to_storage", "storage_write_blocks"),
         "from_storage": ("bytes_from_storage", "storage_read_blocks")}


def run_replay(tmp_path, *args: str, timeout: int = 300) -> tuple[dict | None, subprocess.CompletedProcess]:
    tmpdir = tmp_path / "systmp"
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmpdir), "CTM_LOG_DIR": str(tmp_path / "log")}
    proc = subprocess.run([*REPLAY, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert not os.listdir(tmpdir), f"the replay left {os.listdir(tmpdir)} in the system temp dir"
    return (json.loads(lines[-1]) if lines else None), proc


def naive_per_rank(layout) -> int:
    """The naive layout, computed apart from the replay: every layer holds the widest layer's
    block groups with compress 1 (an entry per token) and no window."""
    per_layer = []
    for layer in range(layout.total_layers):
        per_layer.append(sum(g.block_bytes * (layout.block_size // (g.block_shape[-2] if g.compress > 1 else
                                                                      layout.block_size))
                             for g in layout.block_groups() if layer in g.layers))
    return max(per_layer) * layout.total_layers


def test_the_naive_layout_is_every_layer_full_and_uncompressed():
    for name in ("deepseek-v3", "glm-5", "qwen3-235b"):  # full attention on every layer: naive is itself
        layout = preset(name, layers=4, dim_scale=32, tp=2)
        assert replay_workload.naive_block_bytes(layout) == layout.bytes_per_block() == naive_per_rank(layout)
    v4 = preset("deepseek-v4", layers=4, dim_scale=32)
    # the widest layer: the 128-token window, the 4:1 latent and its indexer, both uncompressed
    assert replay_workload.naive_block_bytes(v4) == 4 * 128 * 2 * (16 + 16 + 4) == naive_per_rank(v4)
    assert v4.bytes_per_block() < replay_workload.naive_block_bytes(v4)
    # qwen3-next: K/V on one layer of four, the three linear-attention layers counted as full ones
    nxt = preset("qwen3-next", layers=8, dim_scale=32, tp=2)
    assert replay_workload.naive_block_bytes(nxt) == 4 * nxt.bytes_per_block() == naive_per_rank(nxt)
    gpt = preset("gpt-oss", layers=4, dim_scale=32, tp=2)  # a window layer holds as much as a full one
    assert replay_workload.naive_block_bytes(gpt) == gpt.bytes_per_block()


def test_the_ledger_counts_each_request_and_ends_at_the_runs_totals():
    ledger = replay_workload.ByteLedger(naive_block_bytes=100, naive_pd_block_bytes=10)
    stats = {f: 0 for pair in TIERS.values() for f in pair}
    for moved, blocks in ((60, 1), (0, 0), (180, 3)):
        stats.update(bytes_d2h=stats["bytes_d2h"] + moved, swap_out_blocks=stats["swap_out_blocks"] + blocks)
        ledger.add(stats, pd=(blocks * 4, blocks))
    stats.update(bytes_to_storage=50, storage_write_blocks=1)  # a write that landed after the last request
    ledger.close(stats)
    r = ledger.result()
    got, naive = r["bytes_per_request"], r["naive_bytes_per_request"]
    assert got["device_to_host"] == {"median": 60.0, "mean": 80.0, "total": 240}
    assert naive["device_to_host"] == {"median": 100.0, "mean": pytest.approx(400 / 3), "total": 400}
    assert got["to_storage"]["total"] == 50 and naive["to_storage"]["total"] == 100
    assert got["pd"]["total"] == 16 and naive["pd"]["total"] == 40
    assert got["all"]["total"] == 240 + 50 + 16 and got["all"]["median"] == 64.0


@pytest.mark.parametrize("name", ["deepseek-v4", "gpt-oss", "qwen3-next"])
def test_a_model_replays_bit_exact_and_reports_its_bytes_against_the_naive_layout(tmp_path, name):
    path = trace_slice(tmp_path, 150)
    r, proc = run_replay(tmp_path, "--trace", path, "--model", name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["corrupt_blocks"] == 0 and r["skipped_requests"] == 0 and r["requests"] == 150
    assert r["verified_blocks"] > 0, "host or storage hits were transferred and checked"
    assert r["hit_ratio"] <= r["theoretical_hit_ratio"]
    layout = preset(name, layers=4, dim_scale=32, tp=2)
    assert (r["model"], r["model_layers"], r["model_dim_scale"]) == (name, 4, 32)
    assert (r["kv_blocks_per_hash"], r["layout_block_tokens"]) == (4, 128), "a 512-token trace block is 4 pages"
    assert r["layout_digest"] == layout.digest()
    assert r["bytes_per_block"] == r["block_bytes"] == 2 * layout.bytes_per_block()
    assert r["naive_bytes_per_block"] == 2 * naive_per_rank(layout)
    got, naive = r["bytes_per_request"], r["naive_bytes_per_request"]
    assert set(got) == set(naive) == {*TIERS, "all"}
    for tier, (moved, blocks) in TIERS.items():
        assert got[tier]["total"] == r[moved], tier  # per request, they add up to the run's
        assert naive[tier]["total"] == r[blocks] * r["naive_bytes_per_block"], tier
        assert got[tier]["mean"] == pytest.approx(r[moved] / r["requests"])
    # swaps move every group of every block
    assert r["bytes_d2h"] == r["swap_out_blocks"] * r["block_bytes"] > 0
    if name == "gpt-oss":  # a window layer is as wide as a full one: writes store every block, reads the window
        assert got["device_to_host"]["total"] == naive["device_to_host"]["total"]
        assert 0 < got["to_storage"]["total"] == naive["to_storage"]["total"]
        if r["bytes_from_storage"]:
            assert got["from_storage"]["total"] < naive["from_storage"]["total"]
    else:  # compressed caches (deepseek-v4), linear-attention layers (qwen3-next): less on every tier
        for tier in ("device_to_host", "to_storage", "all"):
            assert 0 < got[tier]["total"] < naive[tier]["total"], tier
            assert got[tier]["median"] <= naive[tier]["median"], tier
    if name == "qwen3-next":  # K/V on one layer of four
        assert 4 * got["all"]["total"] == naive["all"]["total"]
    assert "per request, device->host" in proc.stdout and f"{name}: 4 layers" in proc.stdout


@pytest.mark.parametrize("name,mode", [("deepseek-v4", "push"), ("qwen3-next", "pull")])
def test_a_model_over_pd_reaches_decode_bit_exact(tmp_path, name, mode):
    """deepseek-v4 pushed layer by layer: its window group moves only the request's last blocks, its
    compressed groups every block.  qwen3-next pulled: its K/V blocks, and each request's state
    (conv + SSM) from the prefill side's slot into one the decode side takes.  Decode checks both."""
    path = trace_slice(tmp_path, 40)
    r, proc = run_replay(tmp_path, "--trace", path, "--model", name, "--pd", "1:1", "--pd-mode", mode,
                         "--device-blocks", "2048", "--host-blocks", "256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["pd_corrupt_blocks"] == 0 and r["corrupt_blocks"] == 0 and r["pd_failed_transfers"] == 0
    assert r["pd_blocks"] == r["blocks"] > 0 and r["pd_requests"] == r["requests"] == 40
    got, naive = r["bytes_per_request"]["pd"], r["naive_bytes_per_request"]["pd"]
    assert got["total"] == r["pd_bytes"] and naive["total"] == r["pd_blocks"] * r["naive_bytes_per_block"]
    layout = preset(name, layers=4, dim_scale=32, tp=2)
    if name == "deepseek-v4":
        assert "pd_state_slots" not in r
        assert 0 < r["pd_bytes"] < r["pd_blocks"] * r["block_bytes"] < naive["total"]
    else:  # every block whole, and one state slot per request: every state group's layers on every rank
        state = 2 * sum(g.block_bytes * len(g.layers) for g in layout.groups if g.per_request)
        assert (r["pd_state_slots"], r["pd_corrupt_state_slots"]) == (40, 0)
        assert r["pd_bytes"] == r["pd_blocks"] * r["block_bytes"] + 40 * state
        assert r["pd_bytes"] < naive["total"]
        assert "40 request states bit-exact, 0 corrupt" in proc.stdout


def test_a_model_with_a_state_group_is_refused_between_tp_sizes_naming_the_group(tmp_path):
    path = trace_slice(tmp_path, 5)
    r, proc = run_replay(tmp_path, "--trace", path, "--model", "qwen3-next", "--pd", "1:1", "--prefill-tp", "1")
    assert proc.returncode == 2 and r is None
    assert "--pd with --model qwen3-next: cannot link TP 1 to TP 2" in proc.stderr
    assert "cache group 'conv_state' is a state group" in proc.stderr and "Traceback" not in proc.stderr
