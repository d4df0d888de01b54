"""``replay_trace.py --kv-events`` (DESIGN §4.2): the replay's prefix cache publishes KV events and a
router-like subscriber's index equals the host and storage tiers at the end; with two tenants, no
raw salt is needed for that (the events carry salted hashes and salt tags)."""
from tests.scripts.test_replay import run_replay


def test_replay_with_kv_events_ends_with_the_index_equal_to_the_tiers(tmp_path):
    result, proc = run_replay(tmp_path, "--kv-events", "--max-requests", "20", "--tenants", "2",
                              "--device-blocks", "32", "--host-blocks", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = result["kv_events"]
    assert events["index_equals_tiers"] is True
    assert events["host_blocks"] == 16 and events["storage_blocks"] == result["storage_write_blocks"] > 0
    assert events["lost_batches"] == 0 and events["dropped_batches"] == 0
    assert events["batches"] > 0 and events["events"] >= events["batches"]
    assert "subscriber's index equals the tiers" in proc.stdout


def test_kv_events_is_refused_with_several_instances(tmp_path):
    result, proc = run_replay(tmp_path, "--kv-events", "--instances", "2", "--storage", "mooncake",
                              "--max-requests", "2")
    assert proc.returncode == 2 and result is None
    assert "--kv-events replays one engine's prefix cache" in proc.stderr
