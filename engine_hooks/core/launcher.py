"""Starting and stopping one CTM process per rank, with the flags FastDeploy passes."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from ops.procs import open_private, private_dir

from .errors import StartupError

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: engine_hooks/core/../..


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (for the engine_worker_queue_port, the signals' suffix)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_log_dir() -> str:
    """Where CTM logs go unless told otherwise: ``$CTM_LOG_DIR``, else ``./log`` (as FastDeploy's ``log/``)."""
    return os.path.abspath(os.environ.get("CTM_LOG_DIR") or "log")


def ctm_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"cache_transfer_manager_rank{rank}.log")


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except FileNotFoundError:
        return "(no log file)"


# How long a process may take to die after SIGKILL.  One that outlives it is stuck in the kernel
# (uninterruptible sleep on a hung filesystem or device): no signal can end it sooner.
KILL_WAIT = 5.0


@dataclass
class RankProcess:
    """One running CTM.  Its stderr goes to ``<log_dir>/ctm_rank<r>.stderr`` beside its log."""

    rank: int
    popen: subprocess.Popen
    log_path: str
    stderr_path: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_detail(self) -> str:
        """How it ended: ``signal N`` or ``exit code N`` (``exit code None`` while it runs)."""
        code = self.popen.poll()
        return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"

    def describe_failure(self) -> str:
        code = self.popen.poll()
        state = "running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exited with {code}")
        return (f"rank {self.rank} (pid {self.pid}) {state}; last lines of {self.log_path}:\n{tail(self.log_path)}"
                f"\nstderr:\n{tail(self.stderr_path, 10)}")

    def stop(self, grace: float = 5.0, kill_wait: float = KILL_WAIT) -> bool:
        """SIGTERM, then SIGKILL after ``grace`` seconds; True once reaped.  Never raises: see ``stop_together``."""
        return not stop_together([self], grace, kill_wait)

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` unless the process was reaped already (then its pid may be another's)."""
        try:
            self.popen.send_signal(signum)
        except OSError as exc:  # gone between the poll and the kill: nothing to stop
            logger.debug("rank %d (pid %d): signal %d not sent: %s", self.rank, self.pid, signum, exc)

    def reap(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to end; True once it has been reaped."""
        try:
            self.popen.wait(max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False


def stop_together(procs: list[RankProcess], grace: float, kill_wait: float = KILL_WAIT) -> list[int]:
    """Stop every process at once: SIGTERM, SIGKILL to those still running after ``grace`` seconds,
    then wait ``kill_wait`` seconds more; returns the ranks still alive, each logged.

    Bounded to about ``grace + kill_wait`` for any number of processes, and never raises: a
    caller that is shutting down must still release everything else (other ranks, shared
    memory) even when one process cannot be killed."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = [p for p in procs if not p.reap(deadline - time.monotonic())]
    for proc in left:
        logger.warning("rank %d (pid %d) did not stop within %.1fs of SIGTERM; killing it", proc.rank, proc.pid, grace)
        proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + kill_wait
    stuck = [p for p in left if not p.reap(deadline - time.monotonic())]
    for proc in stuck:
        logger.error("rank %d (pid %d) still runs %.1fs after SIGKILL (stuck in the kernel?); leaving it behind",
                     proc.rank, proc.pid, kill_wait)
    return [p.rank for p in stuck]


def launch(rank: int, flags: dict[str, object], log_dir: str, env: dict[str, str]) -> RankProcess:
    """Start ``python -m cache_manager.cache_transfer_manager`` for one rank."""
    argv = [sys.executable, "-m", "cache_manager.cache_transfer_manager"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    stderr_path = os.path.join(private_dir(log_dir), f"ctm_rank{rank}.stderr")  # DESIGN §4: 0600 in 0700
    child_env = {**os.environ, **env}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, child_env.get("PYTHONPATH", "")) if p)
    with os.fdopen(open_private(stderr_path), "ab") as err:  # appended: a crashed process's native output stays
        err.write(f"--- rank {rank} launched at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
        err.flush()
        popen = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=err, cwd=REPO_ROOT)
    logger.info("launched rank %d as pid %d", rank, popen.pid)
    return RankProcess(rank, popen, ctm_log_path(log_dir, rank), stderr_path)



class RankProcesses:
    """The current CTM process of every rank, started by ``start(rank)`` (with the flags and environment
    the owner gives for that rank) and stopped by ``stop`` or ``stop_all``."""

    def __init__(self, flags: Callable[[int], dict[str, object]], log_dir: str, env: Callable[[], dict[str, str]]):
        self._flags = flags
        self._log_dir = log_dir
        self._env = env
        self._procs: dict[int, RankProcess] = {}
        # stop_all closes: no start (an automatic restart racing the shutdown) leaves a process behind
        self._lock = threading.Lock()
        self._closed = False

    def start(self, rank: int) -> RankProcess:
        with self._lock:
            if self._closed:
                raise StartupError(f"rank {rank} not started: the service is shutting down")
            self._procs[rank] = launch(rank, self._flags(rank), self._log_dir, self._env())
            return self._procs[rank]

    def stop(self, rank: int, grace: float) -> bool:
        """Stop ``rank``'s process; False if it outlived SIGKILL (logged; never raises)."""
        proc = self._procs.get(rank)
        return proc is None or proc.stop(grace)

    def stop_all(self, grace: float) -> list[int]:
        """Stop every rank's process together (bounded, never raises); the ranks that would not die.
        No process starts after this."""
        with self._lock:
            self._closed = True
        return stop_together(list(self._procs.values()), grace)

    def wait_ready(self, ranks: list[int], ready: Callable[[int], bool], timeout: float,
                   cancel: threading.Event | None = None) -> None:
        """Wait until ``ready(rank)`` for every rank of ``ranks``; ``StartupError`` names a rank that
        died meanwhile, or those still not ready after ``timeout`` seconds, with their logs' tails,
        or says the wait was cancelled (``cancel`` set: the service is shutting down)."""
        deadline = time.monotonic() + timeout
        waiting = set(ranks)
        while waiting:
            if cancel is not None and cancel.is_set():
                raise StartupError(f"ranks {sorted(waiting)} not waited for: cancelled")
            for rank in sorted(waiting):
                proc = self._procs[rank]
                if ready(rank):
                    waiting.discard(rank)
                elif not proc.alive():
                    raise StartupError(f"CTM {proc.describe_failure()}")
            if waiting and time.monotonic() > deadline:
                details = "\n".join(self._procs[r].describe_failure() for r in sorted(waiting))
                raise StartupError(f"ranks {sorted(waiting)} not ready within {timeout:g}s:\n{details}")
            if waiting:
                time.sleep(0.02)

    def current(self) -> Mapping[int, RankProcess]:
        """Rank -> its current process, read-only (a restart replaces one)."""
        return MappingProxyType(self._procs)

    def failures(self) -> dict[int, str]:
        """The ranks whose process is dead -> what happened, with its log's tail."""
        return {rank: proc.describe_failure() for rank, proc in list(self._procs.items()) if not proc.alive()}

    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items()}
