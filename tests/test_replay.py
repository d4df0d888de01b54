"""The main job end to end: a replay of real trace requests through TP=2 CTMs and file storage."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TRACE = os.path.join(REPO, "..", "shared", "traces", "synthetic_trace.jsonl")
sys.path.insert(0, os.path.join(REPO, "scripts"))

import replay_trace  # noqa: E402


def run_replay(*args: str, timeout: int = 600) -> tuple[dict | None, subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "replay_trace.py"), "--json", "--no-progress",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), proc


def trace_slice(tmp_path, n: int) -> str:
    """The first ``n`` requests of the shared trace (or of the generated workload if it is absent)."""
    path = tmp_path / "slice.jsonl"
    if os.path.exists(SHARED_TRACE):
        with open(SHARED_TRACE) as f:
            path.write_text("".join(next(f) for _ in range(n)))
    else:
        path.write_text("".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                            "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                                for r in replay_trace.generate_workload(n, seed=3)))
    return str(path)


def independent_ceiling(path: str) -> tuple[int, int]:
    """(blocks whose whole prefix of trace block ids was seen in an earlier request, all blocks):
    computed from the raw ids, without the project's hashing."""
    seen, hits, total = set(), 0, 0
    with open(path) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            prefixes = [tuple(ids[:i + 1]) for i in range(len(ids))]
            hits += sum(p in seen for p in prefixes)
            total += len(prefixes)
            seen.update(prefixes)
    return hits, total


def test_unbounded_replay_reaches_the_trace_ceiling_and_verifies_every_byte(tmp_path):
    path = trace_slice(tmp_path, 300)
    result, proc = run_replay("--trace", path, "--unbounded", "--host-blocks", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits, total = independent_ceiling(path)
    assert hits > 0.02 * total, "the slice should contain reuse"
    assert (result["hit_blocks"], result["blocks"]) == (hits, total)
    assert result["corrupt_blocks"] == 0
    assert result["verified_blocks"] == result["hit_blocks"]
    assert "hit ratio, all tiers" in proc.stdout


def test_bounded_replay_uses_every_tier_and_never_beats_the_ceiling(tmp_path):
    path = trace_slice(tmp_path, 400)
    result, proc = run_replay("--trace", path, "--device-blocks", "128", "--host-blocks", "256",
                              "--plot", str(tmp_path / "plot.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits, total = independent_ceiling(path)
    assert result["blocks"] == total and result["hit_blocks"] <= hits
    assert result["corrupt_blocks"] == 0
    assert result["verified_blocks"] == result["hit_blocks"]
    assert result["host_hit_ratio"] > 0 and result["storage_hit_ratio"] > 0
    assert result["bytes_d2h"] > 0 and result["bytes_to_storage"] > 0 and result["bytes_from_storage"] > 0
    for key in ("requests", "blocks", "device_hit_ratio", "bytes_h2d", "transfer_gbps", "task_p50_ms", "task_p99_ms"):
        assert key in result
    with open(tmp_path / "plot.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_generated_workload_without_a_trace(tmp_path):
    result, proc = run_replay("--max-requests", "120", "--storage", "none", "--tp", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["requests"] == 120 and result["hit_ratio"] > 0.2 and result["corrupt_blocks"] == 0


BAD_LINES = [
    "not json at all",
    json.dumps({"timestamp": 1, "input_length": 512, "output_length": 1}),
    json.dumps({"timestamp": 2, "input_length": -5, "output_length": 1, "hash_ids": [1]}),
    json.dumps([1, 2, 3]),
]


def test_bad_trace_lines_are_reported_by_line_number_and_skipped(tmp_path):
    good = [json.dumps({"timestamp": i, "input_length": 1024, "output_length": 4, "hash_ids": [0, i + 1]})
            for i in range(6)]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(good[:2] + BAD_LINES + good[2:]) + "\n")
    result, proc = run_replay("--trace", str(path), "--storage", "none", "--tp", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["requests"] == 6
    for line, reason in ((3, "not JSON"), (4, "missing field 'hash_ids'"), (5, "input_length -5"),
                         (6, "expected a JSON object")):
        assert f"line {line}: {reason}" in proc.stderr, proc.stderr
    _, strict = run_replay("--trace", str(path), "--storage", "none", "--on-bad-line", "error")
    assert strict.returncode == 2 and "line 3: not JSON" in strict.stderr


def test_parse_line_rejects_each_bad_field():
    with pytest.raises(replay_trace.BadTraceLine, match="line 9: output_length 'x'"):
        replay_trace.parse_line(json.dumps({"timestamp": 0, "input_length": 1, "output_length": "x",
                                            "hash_ids": []}), 9)
    with pytest.raises(replay_trace.BadTraceLine, match="line 2: hash_ids must be a list"):
        replay_trace.parse_line(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1,
                                            "hash_ids": "abc"}), 2)


def test_replay_with_mooncake_starts_and_stops_its_own_master(tmp_path):
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    path = trace_slice(tmp_path, 250)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "replay_trace.py"), "--json", "--no-progress",
                           "--trace", path, "--storage", "mooncake", "--device-blocks", "64", "--host-blocks", "0"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env_free)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started a local mooncake_master at 127.0.0.1:" in proc.stdout
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    hits, total = independent_ceiling(path)
    assert result["blocks"] == total and 0 < result["hit_blocks"] <= hits
    assert result["storage_hit_ratio"] > 0 and result["corrupt_blocks"] == 0
    assert result["verified_blocks"] == result["hit_blocks"]
    port = proc.stdout.split("started a local mooncake_master at 127.0.0.1:")[1].split()[0]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--rpc_port {port}" not in ps and f"--rpc_port={port}" not in ps, "the replay left its master running"
