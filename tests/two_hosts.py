"""A test bed of two (or three) simulated hosts on this machine, for tests of "a peer on another host".

Each host is a network namespace with its own address (10.77.<subnet>.<i+1>/24; never 127/8, which the
project treats as this host), ``lo`` up, and mount and UTS namespaces held by a sleeping *holder* process:
a private tmpfs on ``/dev/shm``, a fresh boot id bind-mounted over ``/proc/sys/kernel/random/boot_id``,
its own hostname (the netns name).  Everything else is the machine's: the filesystem (a host's /tmp is
the machine's /tmp), the PID namespace, users, CLOCK_REALTIME.  Two hosts are joined by a veth pair;
three or more by a bridge in a switch namespace of the bed's own.  Nothing of a bed is in the machine's
namespaces, apart from the ``/run/netns/<name>`` entries.

A host may also get a time namespace whose CLOCK_MONOTONIC and CLOCK_BOOTTIME run ``clock_offset_s``
ahead (or behind) the machine's.  CLOCK_REALTIME cannot be shifted per namespace (the kernel offers
monotonic and boottime offsets only), so ``time.time()`` is the machine's on every host.

Faults: ``link_down``/``link_up`` (the veth ends go down: connects fail with "network unreachable" or,
when only the far end is down, "no route to host" after the ARP timeout), ``blackhole`` (every packet
vanishes: connects time out, never refused), ``throttle`` (a tbf token bucket).  Every wait has a
timeout; ``Bed.close`` kills every process of the bed, deletes its namespaces and checks nothing is left;
``make_bed`` first removes the namespaces of beds whose process died.  Needs root, iproute2 (``ip``,
``tc``) and util-linux (``unshare``, ``nsenter``); ``make_bed`` raises ``BedUnavailable`` (the fixtures
``two_hosts``, ``three_hosts``, ``host_bed_factory`` skip) when the machine refuses.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import time
import uuid
from typing import Iterator, Mapping, Sequence

import pytest

log = logging.getLogger(__name__)

PREFIX = "ctmbed"                 # every namespace of every bed: ctmbed<pid>x<seq><host>
WAIT_S = 10.0                     # the longest any step of the bed waits
_NAME = re.compile(rf"^{PREFIX}(\d+)x")
_beds = itertools.count()

# The holder: sets the host's hostname, /dev/shm and boot id in its own namespaces, says so, sleeps.
_HOLDER = r"""set -e
printf '%s\n' "$2" > /proc/sys/kernel/hostname
mount -t tmpfs -o "size=$1,mode=1777" "ctmbed-shm-$2" /dev/shm
printf '%s\n' "$3" > /dev/shm/.ctmbed-boot-id
mount --bind /dev/shm/.ctmbed-boot-id /proc/sys/kernel/random/boot_id
rm /dev/shm/.ctmbed-boot-id
echo "ready $$"
exec sleep infinity </dev/null >/dev/null 2>&1
"""


class BedError(RuntimeError):
    """A step of the bed failed (a bug or a broken machine: the test errors)."""


class BedUnavailable(BedError):
    """The machine refuses what the bed needs (not root, no namespaces, a tool missing): tests skip."""


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    """Runs a setup command; raises BedError with its stderr when it fails and ``check``."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


def _wait(predicate, what: str, timeout: float = WAIT_S) -> None:
    """Polls ``predicate`` until true; raises BedError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise BedError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _sh(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split()]


def _kill_netns(ns: str, timeout: float = WAIT_S) -> None:
    """SIGKILLs every process in netns ``ns``, waits for them to go, deletes the namespace."""
    for pid in _netns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait(lambda: not [p for p in _netns_pids(ns) if _alive(p)], f"the processes of netns {ns} to end", timeout)
    _sh(["ip", "netns", "del", ns], check=False)


def unavailable_reason() -> str | None:
    """Why no bed can be made here (not root, a tool missing), or None; the kernel is tried by make_bed."""
    if os.geteuid() != 0:
        return "the two-host bed needs root (network and mount namespaces)"
    missing = [t for t in ("ip", "tc", "unshare", "nsenter", "mount") if shutil.which(t) is None]
    if missing:
        return f"the two-host bed needs {', '.join(missing)} (Debian: iproute2, util-linux, mount)"
    return None


def clean_stale_beds() -> list[str]:
    """Deletes the namespaces (and kills the processes) of beds whose pytest process is gone; returns them."""
    stale = []
    for ns in _netns_list():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            log.warning("removing netns %s of a dead earlier run", ns)
            _kill_netns(ns)
            stale.append(ns)
    return stale


class Host:
    """One simulated host: its netns, address, holder (mount and maybe time namespace) and processes.

    ``ends`` are the (netns, device) of the veth ends that carry this host's traffic: its own ``eth0``
    first, then the far end (the other host's ``eth0``, or its port on the bed's bridge).
    """

    def __init__(self, name: str, netns: str, address: str, clock_offset_s: int | None,
                 boot_id: str | None = None) -> None:
        self.name, self.netns, self.address = name, netns, address
        self.hostname = netns
        self.clock_offset_s = clock_offset_s
        self.boot_id = boot_id or str(uuid.uuid4())
        self.ends: list[tuple[str, str]] = [(netns, "eth0")]
        self.holder_pid = 0
        self._holder: subprocess.Popen | None = None
        self._procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns})"

    def enter_argv(self, cwd: str | None = None) -> list[str]:
        """The argv prefix that runs a command on this host: its net, mount (and time) namespaces, in ``cwd``."""
        argv = ["nsenter", f"--target={self.holder_pid}", "--mount", "--uts", "--net"]
        if self.clock_offset_s is not None:
            argv.append("--time")
        return argv + [f"--wd={cwd or os.getcwd()}", "--"]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Starts ``argv`` on this host, as ``subprocess.Popen`` would (``cwd`` honoured; the default is
        a session of its own).  The bed kills it, and its process group, when it closes."""
        kw.setdefault("start_new_session", True)
        cwd = kw.pop("cwd", None)
        proc = subprocess.Popen(self.enter_argv(os.fspath(cwd) if cwd else None) + [os.fspath(a) for a in argv],
                                env=None if env is None else dict(env), **kw)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float, *, check: bool = False,
            env: Mapping[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        """Runs ``argv`` on this host to its end (text output captured unless told otherwise); on
        ``timeout`` kills its process group and raises ``subprocess.TimeoutExpired``."""
        kw.setdefault("text", True)
        if "stdout" not in kw and "stderr" not in kw:
            kw["stdout"] = kw["stderr"] = subprocess.PIPE
        proc = self.popen(argv, env=env, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            proc.communicate(timeout=WAIT_S)
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``ip -n <netns> args...`` (no mount namespace needed)."""
        return _sh(["ip", "-n", self.netns, *args], check=check)

    def mac(self) -> str:
        """The MAC address of this host's eth0."""
        return self.ip("-o", "link", "show", "dev", "eth0").stdout.split("link/ether ")[1].split()[0]

    def _start_holder(self, shm_size: str) -> None:
        time_args = []
        if self.clock_offset_s is not None:
            off = str(int(self.clock_offset_s))
            time_args = ["--time", "--fork", "--monotonic", off, "--boottime", off]
        argv = ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation", "private",
                *time_args, "--", "sh", "-c", _HOLDER, "holder", shm_size, self.netns, self.boot_id]
        self._holder = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(self._holder.stdout, selectors.EVENT_READ)
            if sel.select(timeout=WAIT_S):
                line = self._holder.stdout.readline()
        if not line.startswith("ready "):
            _killpg(self._holder)
            err = self._holder.communicate(timeout=WAIT_S)[1].strip()
            raise BedUnavailable(f"host {self.name}: the kernel refused its mount/UTS"
                                 f"{' or time' if time_args else ''} namespace: {err or 'no answer'}")
        self.holder_pid = int(line.split()[1])
        self._holder.stdout.close()
        seen = self.run(["cat", "/proc/sys/kernel/random/boot_id"], timeout=WAIT_S).stdout.strip()
        if seen != self.boot_id:
            raise BedError(f"host {self.name}: boot id {seen!r} seen through nsenter, not {self.boot_id!r}")

    def _stop(self) -> list[str]:
        """Kills this host's processes and holder; returns what would not die."""
        for proc in self._procs:
            _killpg(proc, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        left = []
        for proc in self._procs + ([self._holder] if self._holder else []):
            _killpg(proc)
            try:
                proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                left.append(f"host {self.name}: pid {proc.pid} {proc.args[-1]!r}")
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self.holder_pid and _alive(self.holder_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.holder_pid, signal.SIGKILL)
        return left


def _killpg(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signals ``proc``'s process group (it leads one when started in a session of its own) or ``proc``."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


class Bed:
    """Simulated hosts joined by a veth pair (two) or a bridge (three or more); made by ``make_bed``."""

    def __init__(self, hosts: list[Host], switch: str | None) -> None:
        self.hosts = hosts
        self.switch = switch              # the bridge's netns (three or more hosts), or None
        self.blackhole_method = ""        # the qdisc blackhole() used: "netem loss 100%", "blackhole" or "tbf"
        self._pinned: list[tuple[Host, str]] = []
        self._holed: set[tuple[str, str]] = set()
        self._closed = False

    a = property(lambda self: self.hosts[0], doc="the first host")
    b = property(lambda self: self.hosts[1], doc="the second host")
    c = property(lambda self: self.hosts[2], doc="the third host (three_hosts only)")

    def namespaces(self) -> list[str]:
        """Every netns of the bed."""
        return [h.netns for h in self.hosts] + ([self.switch] if self.switch else [])

    def _ends(self, host: Host | None) -> list[tuple[str, str]]:
        ends = host.ends if host else [e for h in self.hosts for e in h.ends]
        return list(dict.fromkeys(ends))

    def link_down(self, host: Host | None = None) -> None:
        """Sets down both ends of ``host``'s link (every link when None): its connects fail at once with
        ENETUNREACH; peers' connects to it fail with EHOSTUNREACH after ARP gives up (~3 s) or time out."""
        for ns, dev in self._ends(host):
            _sh(["ip", "-n", ns, "link", "set", "dev", dev, "down"])

    def link_up(self, host: Host | None = None) -> None:
        """Undoes ``link_down``; returns once every end has its carrier back."""
        ends = self._ends(host)
        for ns, dev in ends:
            _sh(["ip", "-n", ns, "link", "set", "dev", dev, "up"])
        for ns, dev in ends:
            _wait(lambda: "LOWER_UP" in _sh(["ip", "-n", ns, "-o", "link", "show", "dev", dev]).stdout,
                  f"{dev} in {ns} to come up")

    def blackhole(self, host: Host | None = None) -> None:
        """Drops every packet on ``host``'s link (every link when None), both ways, silently: connects
        time out, never refused.  Neighbour entries are pinned meanwhile, so no ARP failure turns the
        silence into EHOSTUNREACH.  Tries netem loss 100%, then the blackhole qdisc, then a tbf whose
        bucket is smaller than any packet; ``blackhole_method`` says which took."""
        for h in self.hosts:
            for o in self.hosts:
                if o is not h and (h, o.address) not in self._pinned:
                    h.ip("neigh", "replace", o.address, "lladdr", o.mac(), "dev", "eth0", "nud", "permanent")
                    self._pinned.append((h, o.address))
        methods = (["netem", "loss", "100%"], ["blackhole"], ["tbf", "rate", "8bit", "burst", "1", "latency", "1ms"])
        for ns, dev in self._ends(host):
            for qdisc in methods:
                if _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc],
                       check=False).returncode == 0:
                    self.blackhole_method = " ".join(qdisc[:3] if qdisc[0] == "netem" else qdisc[:1])
                    self._holed.add((ns, dev))
                    break
            else:
                raise BedUnavailable(f"no qdisc can drop every packet on {dev} in {ns}")

    def unblackhole(self, host: Host | None = None) -> None:
        """Undoes ``blackhole`` (and ``throttle``) on ``host``'s link (every link when None); the pinned
        neighbour entries go with the last blackholed link."""
        self.unthrottle(host)
        if not self._holed:
            for h, addr in self._pinned:
                h.ip("neigh", "del", addr, "dev", "eth0", check=False)
            self._pinned.clear()

    def throttle(self, rate_bit: int, host: Host | None = None) -> None:
        """Limits ``host``'s link (every link when None) to ``rate_bit`` bits per second each way (tbf)."""
        rate_b = max(rate_bit // 8, 1)
        burst, limit = max(rate_b // 50, 16384), max(rate_b // 4, 65536)
        for ns, dev in self._ends(host):
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)])

    def unthrottle(self, host: Host | None = None) -> None:
        """Undoes ``throttle`` (and ``blackhole``'s qdiscs) on ``host``'s link (every link when None)."""
        for ns, dev in self._ends(host):
            self._holed.discard((ns, dev))
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def leftovers(self) -> list[str]:
        """What of the bed is still on the machine: namespaces, holders, processes it started, mounts."""
        left = [f"netns {ns}" for ns in set(self.namespaces()) & set(_netns_list())]
        for h in self.hosts:
            pids = [h.holder_pid] + [p.pid for p in h._procs]
            left += [f"host {h.name}: pid {pid}" for pid in pids if pid and _alive(pid)]
        tags = [f"{PREFIX}-shm-{h.netns} " for h in self.hosts]
        for mi in [f"/proc/{p}/mountinfo" for p in os.listdir("/proc") if p.isdigit()]:
            with contextlib.suppress(OSError), open(mi) as f:
                text = f.read()
            left += [f"mount {t.strip()} in {mi}" for t in tags if t in text]
        return left

    def close(self) -> None:
        """Kills every process of the bed, deletes its namespaces (and so its veths and bridge); idempotent.
        Raises BedError if anything is left behind."""
        if self._closed:
            return
        self._closed = True
        left = [x for h in self.hosts for x in h._stop()]
        for ns in self.namespaces():
            _kill_netns(ns)
        _wait(lambda: not self.leftovers(), "the bed to be gone", timeout=WAIT_S)
        if left:
            raise BedError(f"left behind: {left}")


def make_bed(n_hosts: int = 2, *, clock_offsets: Mapping[str, int] | None = None,
             boot_ids: Mapping[str, str] | None = None, shm_size: str = "256m", subnet: int = 1) -> Bed:
    """Makes a bed of ``n_hosts`` hosts named "a", "b", "c"...; host i has 10.77.<subnet>.<i+1>/24.
    ``clock_offsets`` maps a host name to seconds its CLOCK_MONOTONIC/CLOCK_BOOTTIME run ahead (a time
    namespace); ``boot_ids`` to the boot id it reads (default a fresh UUID; give the machine's for "a
    container on this kernel").  ``shm_size`` sizes each host's /dev/shm tmpfs.
    Raises BedUnavailable where the machine refuses (nothing left behind then), BedError on failure."""
    reason = unavailable_reason()
    if reason:
        raise BedUnavailable(reason)
    if not 2 <= n_hosts <= 26:
        raise ValueError(f"n_hosts must be 2..26, not {n_hosts}")
    clean_stale_beds()
    stem = f"{PREFIX}{os.getpid()}x{next(_beds)}"
    names = [chr(ord("a") + i) for i in range(n_hosts)]
    hosts = [Host(n, stem + n, f"10.77.{subnet}.{i + 1}", (clock_offsets or {}).get(n), (boot_ids or {}).get(n))
             for i, n in enumerate(names)]
    bed = Bed(hosts, f"{stem}sw" if n_hosts > 2 else None)
    try:
        for ns in bed.namespaces():
            proc = _sh(["ip", "netns", "add", ns], check=False)
            if proc.returncode != 0:
                raise BedUnavailable(f"ip netns add refused: {proc.stderr.strip()}")
        if bed.switch:
            _sh(["ip", "-n", bed.switch, "link", "add", "br0", "type", "bridge"])
            _sh(["ip", "-n", bed.switch, "link", "set", "br0", "up"])
            for h in hosts:
                port = f"port-{h.name}"
                _sh(["ip", "link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", port,
                     "netns", bed.switch])
                _sh(["ip", "-n", bed.switch, "link", "set", "dev", port, "master", "br0", "up"])
                h.ends.append((bed.switch, port))
        else:
            _sh(["ip", "link", "add", "eth0", "netns", hosts[0].netns, "type", "veth", "peer", "name", "eth0",
                 "netns", hosts[1].netns])
            hosts[0].ends.append((hosts[1].netns, "eth0"))
            hosts[1].ends.append((hosts[0].netns, "eth0"))
        for h in hosts:
            h.ip("link", "set", "dev", "lo", "up")
            h.ip("addr", "add", f"{h.address}/24", "dev", "eth0")
            h.ip("link", "set", "dev", "eth0", "up")
        for h in hosts:
            h._start_holder(shm_size)
        log.info("two-host bed up: %s", hosts)
        return bed
    except BaseException:
        with contextlib.suppress(BedError):
            bed.close()
        raise


@contextlib.contextmanager
def host_bed(n_hosts: int = 2, **kw) -> Iterator[Bed]:
    """``make_bed`` as a context manager: the bed is closed however the block ends."""
    bed = make_bed(n_hosts, **kw)
    try:
        yield bed
    finally:
        bed.close()


def _make_or_skip(n_hosts: int, **kw) -> Bed:
    try:
        return make_bed(n_hosts, **kw)
    except BedUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def two_hosts() -> Iterator[Bed]:
    """Two hosts, a (10.77.1.1) and b (10.77.1.2), on a veth pair; skips where the machine refuses."""
    with contextlib.closing(_make_or_skip(2)) as bed:
        yield bed


@pytest.fixture
def three_hosts() -> Iterator[Bed]:
    """Three hosts a, b, c (10.77.1.1-3) on a bridge; skips where the machine refuses."""
    with contextlib.closing(_make_or_skip(3)) as bed:
        yield bed


@pytest.fixture
def host_bed_factory() -> Iterator:
    """``factory(n_hosts=2, clock_offsets=..., boot_ids=...) -> Bed``, ``make_bed``'s arguments: every
    bed made is closed at teardown; skips where the machine refuses."""
    with contextlib.ExitStack() as beds:
        def factory(n_hosts: int = 2, **kw) -> Bed:
            return beds.enter_context(contextlib.closing(_make_or_skip(n_hosts, **kw)))
        yield factory
