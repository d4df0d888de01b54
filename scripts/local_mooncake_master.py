"""A local ``mooncake_master`` on loopback, for tests, benchmarks and single-host runs.

``LocalMooncakeMaster`` starts the real master binary (from the ``mooncake-transfer-engine``
wheel: ``mooncake_master`` next to ``sys.executable``, else on PATH, else in the package) on
free loopback ports, so a client needs nothing else (no etcd, no metadata server)::

    with LocalMooncakeMaster(lease_ttl_ms=500) as master:
        store = MooncakeStore(namespace="ns", rank=0, options=master.config())

``start()`` returns only once the master answers: its process holds the RPC port and a TCP
connect to it succeeds (and, with ``http_metadata``, its metadata server answers an HTTP GET).
If it exits first (a taken port: retried with fresh ports) or does not answer within
``start_timeout`` seconds, it is stopped and ``MooncakeMasterError`` carries the tail of its
log.  ``stop()`` sends SIGTERM, then SIGKILL after ``stop_grace`` seconds, and always reaps
the process; it is idempotent.  ``kill()`` is SIGKILL (fault tests); ``restart()`` starts a
fresh master on the same ports (a master keeps its objects in memory only, so it comes back
empty).  ``pid`` is the master's pid (SIGSTOP/SIGCONT in fault tests).  With
``die_with_parent`` (default) the master gets SIGTERM if this process dies, even by SIGKILL
(Linux; strictly, when the thread that started it exits).

Binds: the RPC server and the metrics server listen on 127.0.0.1 only, unless ``host`` names
another address of this host: then the RPC server listens on that address only (``--rpc_address``;
the readiness probe connects there), so clients on other hosts can reach it, and the metrics
server stays on 127.0.0.1.  ``config()`` then leaves ``local_hostname`` out: every client must
give its own host's address (a loopback one is refused: ``transfer_factory/mooncake/config.py``).
Clients use ``P2PHANDSHAKE`` metadata (each client answers its peers' handshakes itself), so by default
the master runs no metadata server at all.  ``http_metadata=True`` turns on the master's
embedded HTTP metadata server, but Mooncake 0.3.13 binds that one to 0.0.0.0 whatever
``--http_metadata_server_host`` says (``HttpMetadataServer`` constructs its
``coro_http_server(4, port)`` without the host), so it is off unless asked for and starting
it logs a warning.

Log: the master's output is appended to ``<log_dir>/mooncake_master.log``; ``log_dir``
defaults to ``$CTM_LOG_DIR``, else ``./log`` (where the CTMs log), and nothing is written to
the system's temp directory.  Each start appends a header line naming its ports; a file
over 64 MiB is rotated to ``mooncake_master.log.1`` at the next start.  Several masters with
one ``log_dir`` share the file (their lines interleave); ``master_log.py`` keeps it.

``lease_ttl_ms`` is ``--default_kv_lease_ttl``: a read's lease must outlast its transfer (a
200 ms lease failed 256 MiB batch reads with -707), and ``remove`` is refused (-706) while a
lease is held.

``client_ttl_s`` is ``--client_ttl`` (Mooncake's default: 10 s): a client pings the master every
second; one that has not pinged for this long is taken for dead, its segments are unmounted and
every object left without a replica is erased (measured with 0.3.13: a SIGKILLed client's objects
answer ``exists`` and fail reads with TRANSFER_FAIL until then, and are not found after).
``metrics()`` reads the master's own Prometheus counters from its loopback metrics port
(``master_key_count``, ``segment_total_capacity_bytes{segment=...}``, ...); ``segments()`` names
the mounted segments and ``wait_for_segments(n)`` waits until at most ``n`` are.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from scripts.local_ports import LOOPBACK, distinct_free_ports, free_port, owns_listener, tcp_answers
from scripts.master_log import MasterLog

# free_port is part of this harness's interface (tests pick ports with it).
__all__ = ["LocalMooncakeMaster", "MooncakeMasterError", "find_master_binary", "free_port"]

BINARY = "mooncake_master"
P2P_METADATA = "P2PHANDSHAKE"
_POLL = 0.05

log = logging.getLogger(__name__)


class MooncakeMasterError(RuntimeError):
    """The master binary is missing, exited, or did not answer in time."""


def find_master_binary() -> str:
    """``mooncake_master`` next to ``sys.executable`` (the venv), else on PATH, else in the wheel."""
    candidates = [os.path.join(os.path.dirname(sys.executable), BINARY), shutil.which(BINARY)]
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(d, BINARY) for d in spec.submodule_search_locations]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise MooncakeMasterError(
        f"{BINARY} not found next to {sys.executable}, on PATH or in the mooncake package; "
        "install mooncake-transfer-engine (or -non-cuda on CPU hosts) into this environment")


def _load_prctl() -> Any:
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies, even by SIGKILL, so a crashed
    test run leaves no master behind.  (Linux; strictly, when the thread that started it exits.)"""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _bind_host(host: str) -> str:
    """The IP literal the master's RPC server binds to; a wildcard or a name is refused (clients
    need the one address they reach it at, and the readiness probe connects there)."""
    try:
        addr = ipaddress.ip_address(str(host).strip().strip("[]"))
    except ValueError:
        raise MooncakeMasterError(f"master address {host!r} must be an IP address of this host") from None
    if addr.is_unspecified:
        raise MooncakeMasterError(f"master address {host!r} is a wildcard: give the address clients reach it at")
    return str(addr)


class LocalMooncakeMaster:
    """One ``mooncake_master`` process on loopback; see the module docstring."""

    def __init__(self, *, lease_ttl_ms: int = 5000, client_ttl_s: int | None = None,
                 rpc_port: int | None = None, http_port: int | None = None, metrics_port: int | None = None,
                 extra_args: list[str] | None = None, binary: str | None = None,
                 start_timeout: float = 20.0, stop_grace: float = 5.0, log_dir: str | None = None,
                 die_with_parent: bool = True, http_metadata: bool = False, host: str = LOOPBACK) -> None:
        self.host = _bind_host(host)
        self.binary = binary or find_master_binary()
        self.lease_ttl_ms = int(lease_ttl_ms)
        self.client_ttl_s = client_ttl_s
        self.extra_args = list(extra_args or [])
        self.start_timeout = float(start_timeout)
        self.stop_grace = float(stop_grace)
        self.die_with_parent = bool(die_with_parent)
        self.http_metadata = bool(http_metadata)
        self._fixed_ports = (rpc_port, http_port if self.http_metadata else 0, metrics_port)
        self.rpc_port, self.http_port, self.metrics_port = self._fixed_ports
        self._log = MasterLog(log_dir)
        self._proc: subprocess.Popen | None = None

    # ---- addresses -------------------------------------------------------------------------

    @property
    def log_dir(self) -> str:
        return self._log.log_dir

    @property
    def log_path(self) -> str:
        """The (shared) file the master's output is appended to."""
        return self._log.path

    @property
    def on_loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    def _hostport(self, port: int | None) -> str:
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    @property
    def master_server_addr(self) -> str:
        return self._hostport(self.rpc_port)

    @property
    def metadata_server(self) -> str:
        """``P2PHANDSHAKE``, or the embedded server's URL with ``http_metadata``."""
        return f"http://{self._hostport(self.http_port)}/metadata" if self.http_metadata else P2P_METADATA

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def config(self) -> dict[str, Any]:
        """The options a ``MooncakeStore`` (or ``MooncakeDistributedStore.setup``) needs.  With a
        master on another address than loopback, ``local_hostname`` is left out: each client gives
        the address of its own host."""
        config = {
            "local_hostname": LOOPBACK,
            "metadata_server": self.metadata_server,
            "master_server_addr": self.master_server_addr,
            "protocol": "tcp",
            "rdma_devices": "",
        }
        if not self.on_loopback:
            del config["local_hostname"]
        return config

    # ---- lifecycle -------------------------------------------------------------------------

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "LocalMooncakeMaster":
        """Start and wait until it answers.  Ports picked once are kept (``restart`` reuses them)."""
        if self.is_running():
            return self
        pick = None in (self.rpc_port, self.http_port, self.metrics_port)
        deadline = time.monotonic() + self.start_timeout
        for attempt in range(1, 6):
            if pick:
                fresh = iter(distinct_free_ports(3))   # a spare one when there is no http port
                self.rpc_port, self.http_port, self.metrics_port = (
                    fixed if fixed is not None else next(fresh) for fixed in self._fixed_ports)
            try:
                self._spawn()
                self._wait_ready(deadline)
                return self
            except MooncakeMasterError:
                exited = self._proc is not None and self._proc.poll() is not None
                self.stop()
                # The master exits at once when a port is taken (picked by someone else between
                # our probe and its bind, or still held by the previous master on these ports):
                # try again, with fresh ports where we picked them, within the deadline.
                if not exited or attempt == 5 or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05 if pick else 0.3)
        raise AssertionError("unreachable")

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
            f"--metrics_port={self.metrics_port}", f"--metrics_host={LOOPBACK}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
        ]
        if self.http_metadata:
            argv += ["--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
                     f"--http_metadata_server_host={self.host}"]
        if self.client_ttl_s is not None:
            argv.append(f"--client_ttl={int(self.client_ttl_s)}")
        return argv + self.extra_args

    def _spawn(self) -> None:
        if self.http_metadata:
            log.warning("mooncake_master %s: its HTTP metadata server on port %d listens on every interface "
                        "(Mooncake 0.3.13 ignores --http_metadata_server_host)", self.master_server_addr,
                        self.http_port)
        log_file = self._log.open(self._argv())
        # Own session: a Ctrl+C in the terminal reaches the parent, which stops the master.
        self._proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=log_file,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent if self.die_with_parent else None)

    def _wait_ready(self, deadline: float) -> None:
        rpc_ok = http_ok = False
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise MooncakeMasterError(f"{BINARY} exited with status {code} while starting "
                                          f"(rpc {self.master_server_addr}); log tail:\n{self.log_tail()}")
            rpc_ok = rpc_ok or (tcp_answers(self.rpc_port, self.host) and self._owns_listener(self.rpc_port))
            http_ok = http_ok or not self.http_metadata or (
                rpc_ok and self._owns_listener(self.http_port) and self._http_answers())
            if rpc_ok and http_ok:
                return
            if time.monotonic() >= deadline:
                raise MooncakeMasterError(
                    f"{BINARY} did not answer within {self.start_timeout:.0f}s (rpc {self.master_server_addr} "
                    f"{'up' if rpc_ok else 'down'}, metadata {self.metadata_server} {'up' if http_ok else 'down'}); "
                    f"log tail:\n{self.log_tail()}")
            time.sleep(_POLL)

    def _http_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.metadata_server}?key=__ctm_probe__", timeout=1.0) as resp:
                resp.read()
            return True
        except urllib.error.HTTPError:
            return True   # it answered (404 for a missing key is an answer)
        except (OSError, ValueError):
            return False

    def _owns_listener(self, port: int) -> bool:
        """Whether our process holds the socket listening on ``port``; best effort (``owns_listener``)."""
        return self._proc is not None and owns_listener(self._proc.pid, port)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after ``stop_grace`` seconds; always reaped.  Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=self.stop_grace)
                except subprocess.TimeoutExpired:
                    self._sigkill(proc)
            else:
                proc.wait()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL at once and reap (a crash, for fault tests).  Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._sigkill(proc)
        self._log.close()

    @staticmethod
    def _sigkill(proc: subprocess.Popen) -> None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process not reaped in 10 s
            raise MooncakeMasterError(f"{BINARY} pid {proc.pid} survived SIGKILL") from None

    def restart(self) -> "LocalMooncakeMaster":
        """Stop (if running) and start a fresh master on the same ports (it starts empty)."""
        self.stop()
        return self.start()

    def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """The master's metrics, ``name`` or ``name{labels}`` -> value.  MooncakeMasterError when it
        does not answer."""
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                text = resp.read().decode(errors="replace")
        except (OSError, ValueError) as e:
            raise MooncakeMasterError(f"{BINARY} metrics at {url} did not answer: {e}") from None
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if not name or line.startswith("#"):
                continue
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out

    def segments(self) -> set[str]:
        """The segments mounted in the pool (``host:port`` of each client that mounted one)."""
        prefix = 'segment_total_capacity_bytes{segment="'
        return {k[len(prefix):].split('"', 1)[0] for k in self.metrics() if k.startswith(prefix)}

    def wait_for_segments(self, at_most: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until at most ``at_most`` segments are mounted.  A client
        that closes unmounts its segment at once; a dead one's segment goes ``client_ttl`` seconds after
        its last ping.  (``master_active_clients`` is no measure of either: a closed client is counted
        until its ``client_ttl`` runs out too.)  Returns whether it happened."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if len(self.segments()) <= at_most:
                    return True
            except MooncakeMasterError as e:
                log.debug("waiting for segments: %s", e)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of this start's output (other masters sharing the file may interleave)."""
        return self._log.tail(max_bytes)

    def cleanup(self) -> None:
        """Stop.  (Kept for callers of older versions: nothing temporary is created any more.)"""
        self.stop()

    def __enter__(self) -> "LocalMooncakeMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
                proc.wait(timeout=5.0)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"LocalMooncakeMaster(rpc {self.master_server_addr}, metadata {self.metadata_server}, {state})"
