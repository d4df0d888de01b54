"""The main job end to end: a replay of real trace requests through TP=2 CTMs and file storage;
and what it leaves behind (nothing temporary) however it ends."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_TRACE = os.path.join(REPO, "..", "shared", "traces", "synthetic_trace.jsonl")
sys.path.insert(0, os.path.join(REPO, "scripts"))

import replay_workload  # noqa: E402


REPLAY = [sys.executable, os.path.join(REPO, "scripts", "replay_trace.py"), "--json", "--no-progress"]


def private_env(tmp_path, **extra: str) -> dict:
    """The replay's environment with a private system temp dir (so leftovers show) and its CTM
    logs in the test's temp dir."""
    tmpdir = tmp_path / "systmp"
    tmpdir.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmpdir), "CTM_LOG_DIR": str(tmp_path / "log"), **extra}


def run_replay(tmp_path, *args: str, timeout: int = 600, env: dict | None = None
               ) -> tuple[dict | None, subprocess.CompletedProcess]:
    env = env or private_env(tmp_path)
    proc = subprocess.run([*REPLAY, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    left = os.listdir(env["TMPDIR"])
    assert not left, f"the replay left {left} in the system temp dir"
    return (json.loads(lines[-1]) if lines else None), proc


def assert_bytes_from_facts(result: dict) -> None:
    """Every transfer of a healthy run moved whole blocks on every rank: the ranks' byte reports
    agree with the block counts, and the rate is their sum over the busy time."""
    bb = result["block_bytes"]
    assert result["bytes_d2h"] == result["swap_out_blocks"] * bb
    assert result["bytes_h2d"] == result["swap_in_blocks"] * bb
    assert result["bytes_from_storage"] == result["storage_read_blocks"] * bb
    assert result["bytes_to_storage"] == result["storage_write_blocks"] * bb
    moved = sum(result[k] for k in ("bytes_d2h", "bytes_h2d", "bytes_to_storage", "bytes_from_storage"))
    assert result["transfer_gbps"] == pytest.approx(moved / result["transfer_busy_s"] / 1e9, rel=1e-3)


def trace_slice(tmp_path, n: int) -> str:
    """The first ``n`` requests of the shared trace (or of the generated workload if it is absent)."""
    path = tmp_path / "slice.jsonl"
    if os.path.exists(SHARED_TRACE):
        with open(SHARED_TRACE) as f:
            path.write_text("".join(next(f) for _ in range(n)))
    else:
        path.write_text("".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                            "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                                for r in replay_workload.generate_workload(n, seed=3)))
    return str(path)


def trace_window(tmp_path, start: int, n: int) -> str:
    """Requests ``start+1 .. start+n`` of the shared trace (its late part reuses more), or the
    generated workload if the trace is absent."""
    if not os.path.exists(SHARED_TRACE):
        return trace_slice(tmp_path, n)
    path = tmp_path / "window.jsonl"
    with open(SHARED_TRACE) as f:
        lines = f.readlines()[start:start + n]
    path.write_text("".join(lines))
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
    result, proc = run_replay(tmp_path, "--trace", path, "--unbounded", "--host-blocks", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits, total = independent_ceiling(path)
    assert hits > 0.02 * total, "the slice should contain reuse"
    assert (result["hit_blocks"], result["blocks"]) == (hits, total)
    assert result["corrupt_blocks"] == 0
    # nothing is ever evicted: every hit is on device, checked, and moved no bytes
    assert result["device_hits"] == result["hit_blocks"] and result["verified_blocks"] == 0
    assert result["bytes_h2d"] == result["bytes_from_storage"] == 0
    assert "hit ratio, all tiers" in proc.stdout


def test_bounded_replay_uses_every_tier_and_never_beats_the_ceiling(tmp_path):
    path = trace_slice(tmp_path, 400)
    result, proc = run_replay(tmp_path, "--trace", path, "--device-blocks", "128", "--host-blocks", "256",
                              "--plot", str(tmp_path / "plot.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits, total = independent_ceiling(path)
    assert result["blocks"] == total and result["hit_blocks"] <= hits
    assert result["corrupt_blocks"] == 0
    # verified: the host and storage hits, each transferred and checked; device hits apart
    transferred = round((result["host_hit_ratio"] + result["storage_hit_ratio"]) * result["blocks"])
    assert result["verified_blocks"] == transferred > 0
    assert result["verified_blocks"] + result["device_hits"] == result["hit_blocks"]
    assert_bytes_from_facts(result)
    assert result["host_hit_ratio"] > 0 and result["storage_hit_ratio"] > 0
    assert result["bytes_d2h"] > 0 and result["bytes_to_storage"] > 0 and result["bytes_from_storage"] > 0
    for key in ("requests", "blocks", "device_hit_ratio", "bytes_h2d", "transfer_gbps", "task_p50_ms", "task_p99_ms"):
        assert key in result
    with open(tmp_path / "plot.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_write_policies_serve_only_right_bytes_and_write_less_than_write_through(tmp_path):
    """The same 150 requests (a window of the shared trace with reuse) under every write policy,
    with tiers small enough to evict from both: 0 corrupt blocks; write_back and
    write_through_selective write fewer bytes than write_through; no hit ratio beats the ceiling."""
    path = trace_window(tmp_path, 3800, 150)
    hits, total = independent_ceiling(path)
    results = {}
    for policy in ("write_through", "write_back", "write_through_selective", "none"):
        result, proc = run_replay(tmp_path, "--trace", path, "--device-blocks", "192", "--host-blocks", "256",
                                  "--write-policy", policy, "--write-threshold", "2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert result["write_policy"] == policy and result["write_threshold"] == 2
        assert f"write policy          {policy}" in proc.stdout
        assert result["corrupt_blocks"] == 0 and result["skipped_requests"] == 0
        assert result["blocks"] == total and result["hit_blocks"] <= hits
        assert result["verified_blocks"] + result["device_hits"] == result["hit_blocks"]
        assert_bytes_from_facts(result)
        results[policy] = result
    through, back, selective, none = (results[p] for p in ("write_through", "write_back",
                                                           "write_through_selective", "none"))
    assert none["bytes_to_storage"] == 0 and none["storage_hit_ratio"] == 0
    assert 0 < back["bytes_to_storage"] < through["bytes_to_storage"]
    assert 0 < selective["bytes_to_storage"] < back["bytes_to_storage"]
    assert back["bounce_blocks"] > 0 and back["swap_in_blocks"] > back["host_hit_ratio"] * back["blocks"]
    # what storage serves under write_back: blocks written as they left the host tier
    assert back["storage_read_blocks"] > 0 and back["storage_hit_ratio"] > 0.5 * through["storage_hit_ratio"]
    assert selective["hit_ratio"] >= none["hit_ratio"]


def test_generated_workload_without_a_trace(tmp_path):
    result, proc = run_replay(tmp_path, "--max-requests", "120", "--storage", "none", "--tp", "1")
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
    result, proc = run_replay(tmp_path, "--trace", str(path), "--storage", "none", "--tp", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["requests"] == 6
    for line, reason in ((3, "not JSON"), (4, "missing field 'hash_ids'"), (5, "input_length -5"),
                         (6, "expected a JSON object")):
        assert f"line {line}: {reason}" in proc.stderr, proc.stderr
    _, strict = run_replay(tmp_path, "--trace", str(path), "--storage", "none", "--on-bad-line", "error")
    assert strict.returncode == 2 and "line 3: not JSON" in strict.stderr


def test_parse_line_rejects_each_bad_field():
    with pytest.raises(replay_workload.BadTraceLine, match="line 9: output_length 'x'"):
        replay_workload.parse_line(json.dumps({"timestamp": 0, "input_length": 1, "output_length": "x",
                                            "hash_ids": []}), 9)
    with pytest.raises(replay_workload.BadTraceLine, match="line 2: hash_ids must be a list"):
        replay_workload.parse_line(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1,
                                            "hash_ids": "abc"}), 2)


def test_replay_with_mooncake_starts_and_stops_its_own_master(tmp_path):
    env_free = {k: v for k, v in private_env(tmp_path).items() if not k.startswith("MOONCAKE_")}
    path = trace_slice(tmp_path, 250)
    result, proc = run_replay(tmp_path, "--trace", path, "--storage", "mooncake", "--device-blocks", "64",
                              "--host-blocks", "0", env=env_free)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started a local mooncake_master at 127.0.0.1:" in proc.stdout
    hits, total = independent_ceiling(path)
    assert result["blocks"] == total and 0 < result["hit_blocks"] <= hits
    assert result["storage_hit_ratio"] > 0 and result["corrupt_blocks"] == 0
    assert result["verified_blocks"] + result["device_hits"] == result["hit_blocks"]
    assert result["verified_blocks"] == result["storage_read_blocks"] > 0
    assert os.path.exists(tmp_path / "log" / "mooncake_master.log"), "the master's log goes beside the CTMs'"
    port = proc.stdout.split("started a local mooncake_master at 127.0.0.1:")[1].split()[0]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--rpc_port {port}" not in ps and f"--rpc_port={port}" not in ps, "the replay left its master running"


def processes_naming(text: str, reaper: bool = False) -> list[int]:
    """Live (not zombie) processes with an argument containing ``text`` (``reaper``: only
    ``python -c`` ones, as ``ops.procs.PathReaper`` starts)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if any(text in a for a in argv) and state not in ("Z", "X") and (not reaper or argv[1:2] == ["-c"]):
            out.append(int(pid))
    return out


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout}s")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["killed", "interrupted"])
def test_the_temporary_store_root_goes_however_the_replay_ends(tmp_path, sig):
    """Mid-replay (the store holds objects), the replay is SIGKILLed or gets Ctrl+C: its store root
    is gone within seconds and no reaper or CTM process is left."""
    env = private_env(tmp_path)
    systmp = env["TMPDIR"]
    # The whole trace: it is stopped as soon as something is stored, and 600 requests could end
    # between the check that it still runs and the signal (exit 0 instead of 130).
    path = trace_slice(tmp_path, 3993)
    proc = subprocess.Popen([*REPLAY, "--trace", path, "--device-blocks", "64", "--host-blocks", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=env)
    try:
        root = wait_for(lambda: [os.path.join(systmp, n) for n in os.listdir(systmp)
                                 if n.startswith("ctm-replay-store-")], 60, "no store root appeared")[0]
        wait_for(lambda: any(files for _, _, files in os.walk(root)), 60, "nothing was stored")
        reapers = processes_naming(root, reaper=True)
        assert len(reapers) == 1, f"expected one reaper naming {root}, found {reapers}"
        assert proc.poll() is None, "the replay ended before it could be stopped"
        proc.send_signal(sig)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:
        assert code == 130, proc.stderr.read()[-2000:]
    else:
        assert code == -signal.SIGKILL
    wait_for(lambda: not os.path.exists(root), 5, f"{root} still exists")
    wait_for(lambda: not processes_naming(root), 15, "CTMs still running")
    # the reaper outlives them only to remove whatever a dying CTM recreated
    wait_for(lambda: not processes_naming(root, reaper=True), 5, "the reaper is still running")
    assert not os.path.exists(root), "a CTM recreated the store root after it was removed"
    assert os.listdir(systmp) == []
    proc.stderr.close()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """One scrape of the Prometheus endpoint: (name, labels) -> value."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^([a-z_]+)(?:\{(.*)\})? (\S+)$', line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def test_metrics_scraped_during_a_replay_agree_with_its_summary(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = trace_slice(tmp_path, 250)
    proc = subprocess.Popen([*REPLAY, "--trace", path, "--device-blocks", "96", "--host-blocks", "128",
                             "--metrics-port", str(port), "--metrics-linger", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=private_env(tmp_path))
    during, result = [], None
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # the replay prints its progress, the summary, then the JSON line
            if line.startswith("metrics at"):
                try:
                    during.append(scrape(port))
                except OSError:
                    pass
            if line.startswith("{"):
                result = json.loads(line)
                break
            assert time.monotonic() < deadline, "the replay took too long"
        assert result is not None, proc.stderr.read()[-3000:]
        final = scrape(port)  # the endpoint lingers after the summary
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert during, "the endpoint did not answer during the replay"
    m = lambda name, **labels: final.get((name, frozenset(labels.items())), 0.0)  # noqa: E731
    ok = sum(v for (name, labels), v in final.items() if name == "ctm_tasks_total" and ("outcome", "ok") in labels)
    failed = sum(v for (name, labels), v in final.items()
                 if name == "ctm_tasks_total" and ("outcome", "ok") not in labels)
    assert (ok, failed) == (result["tasks"], 0)
    assert m("ctm_bytes_moved_total", direction="device_to_host") == result["bytes_d2h"] > 0
    assert m("ctm_bytes_moved_total", direction="host_to_device") == result["bytes_h2d"]
    assert m("ctm_bytes_moved_total", direction="to_storage") == result["bytes_to_storage"] > 0
    assert m("ctm_bytes_moved_total", direction="from_storage") == result["bytes_from_storage"]
    blocks = result["blocks"]
    for tier in ("device", "host", "storage"):
        served = m("ctm_tier_blocks_total", tier=tier, result="served")
        assert served == round(result[f"{tier}_hit_ratio"] * blocks)
    assert m("ctm_tier_blocks_total", tier="storage", result="missed") == blocks - result["hit_blocks"]
    assert m("ctm_tier_blocks_total", tier="device", result="served") + \
        m("ctm_tier_blocks_total", tier="device", result="missed") == blocks
    assert m("ctm_storage_calls_total", backend="file", direction="write") > 0
    assert m("ctm_storage_call_failures_total", backend="file", direction="write") == 0
    assert m("ctm_ranks_up") == 2 and m("ctm_tasks_in_flight") == 0
