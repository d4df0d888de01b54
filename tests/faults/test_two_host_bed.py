"""The two-host test bed (tests/two_hosts.py) does what it says: the hosts reach each other over their
veth only, each has its own /dev/shm and boot id, the faults act as documented (link down, blackhole,
throttle, a clock shift) and closing the bed leaves nothing on the machine.  Needs root: skips otherwise.
"""
from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time


from tests import two_hosts as bed_lib
from tests.two_hosts import PREFIX, Bed, Host, clean_stale_beds, make_bed

# the shared fixtures, under their names here
two_hosts, three_hosts, host_bed_factory = bed_lib.two_hosts, bed_lib.three_hosts, bed_lib.host_bed_factory

# A sink: accepts connections on the host's address; reads each to EOF, answers "<bytes> <peer ip>".
SERVER = r"""
import socket, sys
srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen(16)
print(srv.getsockname()[1], flush=True)
while True:
    conn, peer = srv.accept()
    n = 0
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        n += len(chunk)
    conn.sendall(f"{n} {peer[0]}".encode()); conn.close()
"""
# A client: connects within argv[3] seconds, sends argv[4] bytes, prints "ok <answer> <seconds>" or the error.
CLIENT = r"""
import errno, socket, sys, time
t0 = time.monotonic()
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    s.settimeout(30); s.sendall(b"x" * int(sys.argv[4])); s.shutdown(socket.SHUT_WR)
    print("ok", s.recv(100).decode(), round(time.monotonic() - t0, 3))
except OSError as e:
    print(type(e).__name__, errno.errorcode.get(e.errno, e.errno))
"""


def serve(host: Host) -> int:
    """Starts the sink on ``host``'s address; returns its port once it listens."""
    proc = host.popen([sys.executable, "-c", SERVER, host.address], stdout=subprocess.PIPE, text=True)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=10), "the sink did not start listening in 10 s"
    return int(proc.stdout.readline())


def connect(host: Host, to: Host, port: int, timeout: float = 1.0, nbytes: int = 5) -> list[str]:
    """Runs the client on ``host`` against ``to``'s sink; its answer split in words."""
    out = host.run([sys.executable, "-c", CLIENT, to.address, str(port), str(timeout), str(nbytes)],
                   timeout=timeout + 30, check=True).stdout
    return out.split()


def test_the_hosts_reach_each_other_over_the_veth_only(two_hosts: Bed) -> None:
    a, b = two_hosts.a, two_hosts.b
    port = serve(a)
    assert connect(b, a, port)[:3] == ["ok", "5", b.address]     # the sink saw b's address, not loopback
    machine_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert a.address not in machine_addrs and b.address not in machine_addrs
    assert not a.address.startswith("127.")


def test_each_host_has_its_own_dev_shm(two_hosts: Bed) -> None:
    a, b = two_hosts.a, two_hosts.b
    name = f"ctmbed-probe-{os.getpid()}"
    a.run(["sh", "-c", f"echo hi > /dev/shm/{name}"], timeout=10, check=True)
    assert a.run(["cat", f"/dev/shm/{name}"], timeout=10).stdout == "hi\n"
    assert b.run(["ls", "/dev/shm"], timeout=10, check=True).stdout.split() == []
    assert not os.path.exists(f"/dev/shm/{name}")


def test_boot_ids_and_hostnames_differ_from_each_other_and_the_machine(two_hosts: Bed) -> None:
    read = "import os; print(open('/proc/sys/kernel/random/boot_id').read().strip(), os.uname().nodename)"
    seen = [h.run([sys.executable, "-c", read], timeout=10, check=True).stdout.split() for h in two_hosts.hosts]
    with open("/proc/sys/kernel/random/boot_id") as f:
        machine = f.read().strip()
    assert seen == [[h.boot_id, h.hostname] for h in two_hosts.hosts]
    assert len({seen[0][0], seen[1][0], machine}) == 3
    assert len({seen[0][1], seen[1][1], os.uname().nodename}) == 3


def test_link_down_fails_a_connect_and_link_up_restores_it(two_hosts: Bed) -> None:
    a, b = two_hosts.a, two_hosts.b
    port = serve(a)
    assert connect(b, a, port)[0] == "ok"
    two_hosts.link_down()
    assert connect(b, a, port) == ["OSError", "ENETUNREACH"]
    two_hosts.link_up()
    assert connect(b, a, port)[0] == "ok"


def test_blackhole_makes_a_connect_time_out_not_refused(two_hosts: Bed) -> None:
    a, b = two_hosts.a, two_hosts.b
    assert connect(b, a, 9)[0] == "ConnectionRefusedError"       # nobody listens: a refuses at once
    two_hosts.blackhole()
    t0 = time.monotonic()
    assert connect(b, a, 9, timeout=1.0)[0] == "TimeoutError"
    assert time.monotonic() - t0 >= 1.0
    assert two_hosts.blackhole_method in ("netem loss 100%", "blackhole", "tbf")
    two_hosts.unblackhole()
    assert connect(b, a, 9)[0] == "ConnectionRefusedError"


def test_throttle_slows_a_transfer(two_hosts: Bed) -> None:
    a, b = two_hosts.a, two_hosts.b
    port, nbytes = serve(a), 256 << 10
    fast = float(connect(b, a, port, nbytes=nbytes)[3])
    two_hosts.throttle(4_000_000)                                  # 256 KiB at 4 Mbit/s: ~0.5 s
    slow = connect(b, a, port, nbytes=nbytes)
    assert slow[:2] == ["ok", str(nbytes)]
    assert float(slow[3]) > max(0.3, 2 * fast), (fast, slow)
    two_hosts.unthrottle()
    assert float(connect(b, a, port, nbytes=nbytes)[3]) < float(slow[3]) / 2


def test_three_hosts_share_a_bridge_and_a_blackhole_isolates_one(three_hosts: Bed) -> None:
    a, b, c = three_hosts.hosts
    port = serve(a)
    assert connect(b, a, port)[:3] == ["ok", "5", b.address]
    assert connect(c, a, port)[:3] == ["ok", "5", c.address]
    three_hosts.blackhole(c)
    assert connect(c, a, port)[0] == "TimeoutError"
    assert connect(b, a, port)[0] == "ok"
    three_hosts.unblackhole(c)
    assert connect(c, a, port)[0] == "ok"


def test_a_clock_shift_moves_monotonic_and_boottime_not_realtime(host_bed_factory) -> None:
    shift = 5 * 3600
    bed = host_bed_factory(2, clock_offsets={"b": shift})
    read = ("import time; print(time.monotonic(), time.clock_gettime(time.CLOCK_BOOTTIME), time.time())")
    a_now = [float(x) for x in bed.a.run([sys.executable, "-c", read], timeout=10, check=True).stdout.split()]
    b_now = [float(x) for x in bed.b.run([sys.executable, "-c", read], timeout=10, check=True).stdout.split()]
    assert abs(b_now[0] - a_now[0] - shift) < 5
    assert abs(b_now[1] - a_now[1] - shift) < 5
    assert abs(b_now[2] - a_now[2]) < 5                          # CLOCK_REALTIME: the machine's on every host
    assert abs(a_now[0] - time.monotonic()) < 5


def _netns() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split())


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


def test_closing_the_bed_leaves_nothing(two_hosts: Bed) -> None:
    links_before = _links()
    bed = make_bed(3)
    procs = [bed.a.popen(["sleep", "600"]),
             bed.b.popen([sys.executable, "-c", "import subprocess, time; "
                          "subprocess.Popen(['sleep', '600'], start_new_session=True); time.sleep(600)"])]
    bed.blackhole(bed.c)
    holders = [h.holder_pid for h in bed.hosts]
    assert set(bed.namespaces()) <= _netns()
    bed.close()
    assert bed.leftovers() == []
    assert not set(bed.namespaces()) & _netns()
    assert _links() == links_before
    assert all(p.poll() is not None for p in procs)
    assert not [p for p in holders if os.path.exists(f"/proc/{p}")]
    bed.close()                                                      # idempotent


def test_the_namespaces_of_a_dead_run_are_cleaned(two_hosts: Bed) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale = f"{PREFIX}{dead.pid}x0a"
    subprocess.run(["ip", "netns", "add", stale], check=True, capture_output=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        assert stale in clean_stale_beds()
        assert stale not in _netns()
        assert sleeper.wait(timeout=10) == -9
        assert set(two_hosts.namespaces()) <= _netns()               # a live bed is left alone
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
