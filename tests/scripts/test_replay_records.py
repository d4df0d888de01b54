"""The replay's per-request transfer records: its JSON line names the slowest requests with the
timeline of their tasks (DESIGN §4.2, issue 36 item 2)."""
import re

from tests.scripts.test_replay import run_replay, trace_slice

KINDS = {"swap_out", "swap_in", "storage_write", "storage_read", "pd_pull", "pd_push"}


def check_timelines(slowest: list, block_bytes: int) -> set:
    """Each timeline is well formed; returns the kinds of task seen."""
    assert len(slowest) == 5
    assert [r["total_ms"] for r in slowest] == sorted((r["total_ms"] for r in slowest), reverse=True)
    assert len({r["request_id"] for r in slowest}) == 5
    kinds = set()
    for req in slowest:
        assert re.fullmatch(r"req-\d+", req["request_id"])
        assert req["tasks"] and req["tasks"][0]["start_ms"] == 0.0
        assert req["bytes"] == sum(t["bytes"] for t in req["tasks"])
        assert max(t["end_ms"] for t in req["tasks"]) == req["total_ms"]
        for task in req["tasks"]:
            assert task["kind"] in KINDS and task["outcome"] == "ok"
            assert 0.0 <= task["start_ms"] <= task["run_ms"] <= task["end_ms"]
            assert task["bytes"] % block_bytes == 0  # the ranks report whole blocks moved
            kinds.add(task["kind"])
    return kinds


def test_the_json_line_has_the_slowest_requests_timelines(tmp_path):
    result, proc = run_replay(tmp_path, "--trace", trace_slice(tmp_path, 60), "--device-blocks", "32",
                              "--host-blocks", "64", "--plot", str(tmp_path / "plot.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = check_timelines(result["slowest_requests"], result["block_bytes"])
    assert {"swap_out", "storage_read", "storage_write"} <= kinds
    with open(tmp_path / "plot.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_pd_requests_timeline_holds_its_transfer_on_the_decode_instance(tmp_path):
    result, proc = run_replay(tmp_path, "--trace", trace_slice(tmp_path, 20), "--pd", "1:1", "--pd-mode", "pull")
    assert proc.returncode == 0 and result["pd_failed_transfers"] == 0, proc.stderr[-3000:]
    check_timelines(result["slowest_requests"], result["block_bytes"])
    pulls = [t for r in result["slowest_requests"] for t in r["tasks"] if t["kind"] == "pd_pull"]
    assert pulls and all(t["instance"] == "decode-0" and t["bytes"] > 0 for t in pulls)
