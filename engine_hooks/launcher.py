"""Starting and stopping one CTM process per rank, with the flags FastDeploy passes."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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

    def describe_failure(self) -> str:
        code = self.popen.poll()
        state = "running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exited with {code}")
        return (f"rank {self.rank} (pid {self.pid}) {state}; last lines of {self.log_path}:\n{tail(self.log_path)}"
                f"\nstderr:\n{tail(self.stderr_path, 10)}")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; always reaps the process."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d did not stop within %.1fs of SIGTERM; killing it", self.rank, grace)
                self.popen.kill()
                self.popen.wait(5.0)
        else:
            self.popen.wait(0)


def launch(rank: int, flags: dict[str, object], log_dir: str, env: dict[str, str]) -> RankProcess:
    """Start ``python -m cache_manager.cache_transfer_manager`` for one rank."""
    argv = [sys.executable, "-m", "cache_manager.cache_transfer_manager"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    os.makedirs(log_dir, exist_ok=True)
    stderr_path = os.path.join(log_dir, f"ctm_rank{rank}.stderr")
    child_env = {**os.environ, **env}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, child_env.get("PYTHONPATH", "")) if p)
    with open(stderr_path, "wb") as err:
        popen = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=err, cwd=REPO_ROOT)
    logger.info("launched rank %d as pid %d", rank, popen.pid)
    return RankProcess(rank, popen, ctm_log_path(log_dir, rank), stderr_path)

