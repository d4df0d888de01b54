"""A Mooncake pool across hosts, on the two-host bed (tests/two_hosts.py), with a real master and real
clients (scripts/mooncake_pool_client.py, this repo's MooncakeStore), and the rules behind it:

* a master started by ``scripts/start_mooncake_master.py --rpc-address`` on host a listens on a's
  address only and serves a client on host b;
* a client left at a loopback ``local_hostname`` with a master not on loopback is refused before it
  connects, naming the setting (on the bed, and as a unit);
* a client with a routable ``local_hostname`` listens on that address only, not every interface;
* a partition of host a longer than the master's ``client_ttl``: with ``placement`` "local" (the
  default) every block host b wrote is still readable; with "random" (Mooncake's own placement)
  nearly every block lost a piece.

Needs the mooncake wheel and its master binary, and root for the bed; skipped without them.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("mooncake.store")

from scripts.local_mooncake_master import LocalMooncakeMaster, MooncakeMasterError, find_master_binary  # noqa: E402
from scripts.mooncake_pool_client import PoolClient  # noqa: E402
from tests import mooncake_helpers  # noqa: E402
from tests import two_hosts as bed_lib  # noqa: E402
from transfer_factory.kvcache_storage import StorageConfigError  # noqa: E402
from transfer_factory.mooncake.config import MooncakeConfig, check_pool_addresses, load_mooncake_config  # noqa: E402
from transfer_factory.mooncake.loopback import bind_address  # noqa: E402
from transfer_factory.mooncake.store import MooncakeStore  # noqa: E402

two_hosts = bed_lib.two_hosts                                   # the shared fixture
_clean_mooncake_env = mooncake_helpers._clean_mooncake_env      # no MOONCAKE_* from the shell

log = logging.getLogger(__name__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEP_S = 30.0            # the longest any one step waits
CLIENT_TTL_S = 2         # the master's --client_ttl in the partition test
BLOCK = {"blocks": 24, "size": 64 << 10, "kinds": ["k", "v"]}   # x 2 ranks: 4 objects a block


@pytest.fixture
def master_binary() -> str:
    try:
        return find_master_binary()
    except MooncakeMasterError as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------- units: no bed
@pytest.mark.parametrize("local, master, refused", [
    ("127.0.0.1", "10.0.0.1:50051", True),
    ("localhost", "10.0.0.1:50051", True),
    ("::1", "[2001:db8::1]:50051", True),
    ("127.0.0.1", "etcd://127.0.0.1:2379;10.0.0.2:2379", True),
    ("127.0.0.1", "127.0.0.1:50051", False),
    ("127.0.0.1", "localhost:50051", False),
    ("10.0.0.2", "10.0.0.1:50051", False),
    ("127.0.0.1", "no-such-host.invalid:50051", False),   # unresolvable: the master probe says so
])
def test_a_loopback_client_with_a_master_off_loopback_is_refused(local, master, refused):
    config = MooncakeConfig(master_server_addr=master, local_hostname=local, source="options")
    if refused:
        with pytest.raises(StorageConfigError, match="local_hostname.*MOONCAKE_LOCAL_HOSTNAME"):
            check_pool_addresses(config)
    else:
        check_pool_addresses(config)


def test_the_store_refuses_it_before_connecting():
    start = time.monotonic()
    with pytest.raises(StorageConfigError, match=r"local_hostname '127\.0\.0\.1' is a loopback address"):
        MooncakeStore(namespace="ns", options={"master_server_addr": "192.0.2.1:50051"})   # nothing listens
    assert time.monotonic() - start < 0.5, "refused by configuration, not after a connect attempt"


def test_one_config_file_for_every_host_takes_local_hostname_from_the_environment(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_addr": "10.0.0.1:50051"}))
    env = {"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.2"}
    config, tuning = load_mooncake_config({}, env)
    assert config.local_hostname == "10.0.0.2" and "environment" in config.source
    assert tuning["placement"] == "local"
    path.write_text(json.dumps({"master_server_addr": "10.0.0.1:50051", "local_hostname": "10.0.0.3"}))
    assert load_mooncake_config({}, env)[0].local_hostname == "10.0.0.3"     # the file's own wins
    with pytest.raises(StorageConfigError, match="placement"):
        load_mooncake_config({"master_server_addr": "h:1", "placement": "everywhere"}, {})


def test_a_master_address_must_be_one_address():
    for host in ("0.0.0.0", "::", "master.example"):
        with pytest.raises(MooncakeMasterError, match="address"):
            LocalMooncakeMaster(host=host)
    assert bind_address("127.0.0.1") == "127.0.0.1"
    assert bind_address("192.0.2.1") is None            # not an address of this host


# ---------------------------------------------------------------- the bed
def _start_master(host: bed_lib.Host, *args: str) -> dict:
    """start_mooncake_master.py on ``host``, bound to its address; its JSON line."""
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = host.popen([sys.executable, os.path.join(REPO, "scripts", "start_mooncake_master.py"),
                       "--rpc-address", host.address, *args], cwd=REPO, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = PoolClient(proc, f"master on {host.name}")
    try:
        return client._line(STEP_S)
    except RuntimeError:
        raise AssertionError(f"the master did not start: {proc.stderr.read()}") from None


def _listeners(host: bed_lib.Host, pid: int) -> list[tuple[str, int]]:
    """What ``pid`` listens on, read from /proc/net/tcp* inside ``host``'s network namespace."""
    code = ("import json, sys; from scripts.mooncake_pool_client import listeners; "
            "print(json.dumps(listeners(int(sys.argv[1]))))")
    out = host.run([sys.executable, "-c", code, str(pid)], timeout=STEP_S, check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": REPO}).stdout
    return [tuple(x) for x in json.loads(out)]


def _ready(*clients: PoolClient) -> None:
    for c in clients:
        assert c.ready(STEP_S).get("ready"), f"{c.name}: {c.info}"


def _ask(client: PoolClient, **cmd) -> dict:
    answer = client.ask(STEP_S, **cmd)
    assert "error" not in answer, f"{client.name}: {answer}"
    return answer


def _only_on(address: str, socks: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The sockets not bound to ``address`` (IPv4, or IPv4-mapped on a dual-stack socket)."""
    return [s for s in socks if s[0] not in (address, f"::ffff:{address}")]


def test_a_master_on_host_a_serves_a_client_on_host_b_and_everything_listens_on_its_address(
        two_hosts: bed_lib.Bed, master_binary: str) -> None:
    a, b = two_hosts.a, two_hosts.b
    master = _start_master(a)
    assert master["master_server_addr"].startswith(f"{a.address}:")
    assert "local_hostname" not in master, "each client gives its own host's address"
    rpc_port = int(master["master_server_addr"].rsplit(":", 1)[1])
    expected = [(a.address, rpc_port), ("127.0.0.1", master["metrics_port"])]     # RPC and metrics only
    assert sorted(_listeners(a, master["pid"])) == sorted(expected)

    holder = PoolClient.start(a, master["master_server_addr"], "--ranks", "1")       # the segment, on a
    writer = PoolClient.start(b, master["master_server_addr"], "--segment-size", "0")
    stray = PoolClient.start(b, master["master_server_addr"], local_hostname=None)    # left at 127.0.0.1
    _ready(holder, writer)
    refused = stray.ready(STEP_S)
    assert not refused["ready"] and "local_hostname '127.0.0.1'" in refused["error"], refused
    assert "MOONCAKE_LOCAL_HOSTNAME" in refused["error"]

    blocks = {**BLOCK, "tag": "ab", "blocks": 6}
    assert _ask(writer, op="put", **blocks)["ok"] == 12
    assert _ask(writer, op="get", **blocks)["readable"] == 6          # b reads what sits in a's segment
    assert _ask(holder, op="get", **blocks)["readable"] == 6

    # Each client's handshake and data ports listen on its local_hostname only, not 0.0.0.0 / [::].
    for host, client in ((a, holder), (b, writer)):
        socks = [tuple(s) for s in _ask(client, op="listeners")["listeners"]]
        assert len(socks) >= 2, f"{client.name}: {socks}"
        assert not _only_on(host.address, socks), f"{client.name} listens beyond {host.address}: {socks}"
    for c in (holder, writer):
        c.quit()


def _segments_of(host: bed_lib.Host, metrics_port: int, address: str) -> int:
    """Segments the master (on ``host``) has mounted from clients at ``address``."""
    code = ("import sys, urllib.request; t = urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics', "
            "timeout=2).read().decode(); print(sum(1 for l in t.splitlines() if "
            "l.startswith('segment_total_capacity_bytes{segment=\"' + sys.argv[2] + ':')))")
    out = host.run([sys.executable, "-c", code, str(metrics_port), address], timeout=STEP_S, check=True).stdout
    return int(out)


def test_a_partition_past_client_ttl_takes_whole_blocks_with_local_placement(
        two_hosts: bed_lib.Bed, master_binary: str) -> None:
    a, b = two_hosts.a, two_hosts.b
    master = _start_master(b, "--client-ttl", str(CLIENT_TTL_S))
    addr = master["master_server_addr"]
    # Two ranks' segments on each host; b's local writer mounts its own two, the random writer none
    # (so its objects go to the same four segments at random, as Mooncake places them by default).
    holder = PoolClient.start(a, addr, "--ranks", "2")
    local = PoolClient.start(b, addr, "--ranks", "2")
    random_ = PoolClient.start(b, addr, "--ranks", "2", "--segment-size", "0", "--namespace", "rnd",
                               "--options", json.dumps({"placement": "random"}))
    _ready(holder, local, random_)
    cases = {"local": (local, {**BLOCK, "tag": "l"}), "random": (random_, {**BLOCK, "tag": "r"})}
    for client, blocks in cases.values():
        assert _ask(client, op="put", **blocks)["ok"] == 4 * BLOCK["blocks"]
        assert _ask(client, op="get", **blocks)["readable"] == BLOCK["blocks"]
    assert _segments_of(b, master["metrics_port"], a.address) == 2

    two_hosts.link_down(a)
    deadline = time.monotonic() + CLIENT_TTL_S + 15
    while _segments_of(b, master["metrics_port"], a.address):
        assert time.monotonic() < deadline, "the master never dropped host a's segments"
        time.sleep(0.2)
    two_hosts.link_up(a)

    after = {name: _ask(client, op="get", **blocks) for name, (client, blocks) in cases.items()}
    log.info("readable blocks of %d after host a was cut off past client_ttl: %s", BLOCK["blocks"],
             {n: (r["readable"], r["objects_ok"]) for n, r in after.items()})
    assert after["local"]["readable"] == BLOCK["blocks"], after["local"]
    # Random placement: a block survives only if all 4 objects sat on b (1 in 16): ~1.5 of 24.
    assert after["random"]["readable"] < BLOCK["blocks"] // 2, after["random"]
    for c in (holder, local, random_):
        c.quit()
