"""The replay's prefill/decode mode end to end (``replay_trace.py --pd P:D``, ``scripts/replay_pd.py``):
real prefill and decode instances, each with its own TP=2 CTMs, hand every request's blocks over
by pull or layer-wise push, over the same-host path or the Mooncake Transfer Engine; the decode
side finds every block bit-exact, the prefix cache still reaches the workload's ceiling, and the
run leaves no process, shared-memory segment or temporary file behind."""
import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import replay_pd  # noqa: E402

# a generated workload: it has prefix hits from its first requests on (the shared trace's first
# requests have none), so a push also carries requests whose blocks are all computed already
REPLAY = [sys.executable, os.path.join(REPO, "scripts", "replay_trace.py"), "--json", "--no-progress",
          "--max-requests", "30", "--device-blocks", "64", "--host-blocks", "64"]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process we can see."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        out[int(name)] = (ppid, cmd)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def run_pd(tmp_path, *args: str, timeout: float = 120.0) -> tuple[dict, dict[int, str], set[str]]:
    """Run the replay; its JSON result, every descendant it had (pid -> command line) and the
    engine ports of its CTMs, watched while it ran."""
    tmpdir = tmp_path / "systmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "CTM_LOG_DIR": str(tmp_path / "log")}
    proc = subprocess.Popen([*REPLAY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"replay {args} still running after {timeout}s")
            procs = _processes()
            tree = {proc.pid}
            for _ in range(4):  # children, grandchildren, ...
                tree |= {pid for pid, (ppid, _) in procs.items() if ppid in tree}
            for pid in tree - {proc.pid}:  # the latest command line: a child may not have exec'd yet
                seen[pid] = procs[pid][1] or seen.get(pid, "")
            time.sleep(0.1)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, f"replay {args} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line:\n{out[-3000:]}\n{err[-3000:]}"
    assert not os.listdir(tmpdir), f"the replay left {os.listdir(tmpdir)} in the system temp dir"
    ports = set()
    for cmd in seen.values():
        words = cmd.split()
        if "--engine_worker_queue_port" in words:
            ports.add(words[words.index("--engine_worker_queue_port") + 1])
    return json.loads(lines[-1]), seen, ports


def assert_nothing_left(seen: dict[int, str], ports: set[str], instances: int, ranks: int | None = None) -> None:
    """Every process the replay started is gone, and so is every shared-memory name of its engines."""
    ctms = [pid for pid, cmd in seen.items() if "cache_manager.cache_transfer_manager" in cmd]
    assert len(ctms) >= (ranks or 2 * instances) and len(ports) == instances, f"watched {len(ctms)} CTMs, ports {ports}"
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: seen[pid][:120] for pid in seen if _alive(pid)}
    assert not left, f"processes left behind: {left}"
    shm = [n for n in os.listdir("/dev/shm")
           if any(n.startswith(f"ctm.{p}.") or f".{p}." in n or n.endswith(f".{p}") for p in ports)]
    assert not shm, f"shared memory left behind: {shm}"


@pytest.mark.parametrize("mode,transport", [("pull", "ipc"), ("push", "ipc"), ("pull", "mooncake"),
                                            ("push", "mooncake")])
def test_every_block_reaches_decode_bit_exact_at_the_ceiling(tmp_path, mode, transport):
    r, seen, ports = run_pd(tmp_path, "--pd", "1:1", "--pd-mode", mode, "--pd-transport", transport)
    assert (r["pd"], r["pd_mode"], r["pd_transport"]) == ("1:1", mode, transport)
    assert r["pd_corrupt_blocks"] == 0 and r["corrupt_blocks"] == 0
    assert r["pd_failed_transfers"] == 0
    assert r["pd_blocks"] > 0 and r["pd_blocks"] == r["blocks"], "every block of every request goes to decode"
    assert r["pd_requests"] == r["requests"] == 30
    assert r["pd_bytes"] == r["pd_blocks"] * r["block_bytes"], "the ranks report whole blocks moved"
    assert r["hit_blocks"] > 0 and r["hit_ratio"] == pytest.approx(r["theoretical_hit_ratio"])
    assert 0 < r["pd_transfer_p50_ms"] <= r["pd_transfer_p99_ms"] and r["pd_gbps"] > 0
    assert (r["pd_layer_visible_ms"] is not None) == (mode == "push")
    assert_nothing_left(seen, ports, instances=2)


def test_two_prefill_instances_share_one_decode_instance(tmp_path):
    r, seen, ports = run_pd(tmp_path, "--pd", "2:1", "--pd-mode", "push", "--route", "session")
    assert (r["pd"], r["pd_transport"]) == ("2:1", "ipc")
    assert r["pd_corrupt_blocks"] == 0 and r["pd_failed_transfers"] == 0
    assert r["pd_blocks"] == r["blocks"] > 0
    assert_nothing_left(seen, ports, instances=3)


@pytest.mark.parametrize("p_tp,d_tp,mode,transport", [("2", "1", "pull", "mooncake"), ("1", "2", "push", "ipc")])
def test_instances_of_different_tp_sizes_hand_over_every_block_bit_exact(tmp_path, p_tp, d_tp, mode, transport):
    r, seen, ports = run_pd(tmp_path, "--pd", "1:1", "--prefill-tp", p_tp, "--decode-tp", d_tp, "--pd-mode", mode,
                            "--pd-transport", transport)
    assert (r["prefill_tp"], r["decode_tp"], r["pd_transport"]) == (int(p_tp), int(d_tp), transport)
    assert r["pd_corrupt_blocks"] == 0 and r["corrupt_blocks"] == 0 and r["pd_failed_transfers"] == 0
    assert r["pd_blocks"] == r["blocks"] > 0 and r["pd_requests"] == r["requests"]
    assert r["pd_bytes"] == r["pd_blocks"] * r["block_bytes"], "every head of every block moved once"
    assert_nothing_left(seen, ports, instances=2, ranks=int(p_tp) + int(d_tp))


@pytest.mark.parametrize("text", ["1", "0:1", "1:0", "a:b", "1:2:3", "9:1"])
def test_a_bad_pd_shape_is_refused(text):
    with pytest.raises(ValueError, match="--pd"):
        replay_pd.parse_pd(text)
