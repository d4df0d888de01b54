"""Shutdown under faults: a CTM that outlives SIGKILL, another user's names in /dev/shm, log modes."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import pytest

from engine_hooks.core import launcher
from ops.shm import SHM_DIR
from tests.service_helpers import process_gone, segments_of, start_service


class KernelHeldPopen:
    """A real CTM process whose signals the kernel holds back, as it does for a process in
    uninterruptible sleep (D-state) on a hung filesystem: SIGTERM and SIGKILL are accepted but
    only take effect at ``release()``.  The process really keeps running and really cannot be
    reaped meanwhile; what is emulated is only the kernel's delay in acting on the signals."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self._lock = threading.Lock()
        self._held: list[int] | None = []

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(signum)
                return
        self._popen.send_signal(signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def release(self) -> None:
        """The filesystem came back: deliver what was held, and SIGKILL in any case."""
        with self._lock:
            held, self._held = self._held or [], None
        for signum in held + [signal.SIGKILL]:
            self._popen.send_signal(signum)

    def __getattr__(self, name: str):
        return getattr(self._popen, name)


def test_shutdown_finishes_when_a_rank_outlives_sigkill(monkeypatch, caplog):
    held: list[KernelHeldPopen] = []
    real_launch = launcher.launch

    def launch(rank, flags, log_dir, env):
        proc = real_launch(rank, flags, log_dir, env)
        if rank == 1:
            held.append(KernelHeldPopen(proc.popen))
            return launcher.RankProcess(rank, held[-1], proc.log_path, proc.stderr_path)
        return proc

    monkeypatch.setattr(launcher, "launch", launch)
    svc = start_service(stop_grace=0.5)
    port, pids = svc.port, svc.pids()
    done = threading.Event()
    errors: list[BaseException] = []

    def shut() -> None:
        try:
            svc.shutdown()
        except BaseException as exc:  # what the engine would see instead of a finished shutdown
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=shut, name="shutdown")
    try:
        with caplog.at_level(logging.ERROR, logger="engine_hooks.core.launcher"):
            thread.start()
            assert done.wait(60), "shutdown() did not return while rank 1 was stuck"
        assert errors == []
        assert process_gone(pids[0]), "the other rank must be stopped"
        assert not process_gone(pids[1]), "the stand-in must still hold rank 1 (else the test proves nothing)"
        assert segments_of(port) == [], "the engine's segments and signals must be unlinked"
        assert any(f"rank 1 (pid {pids[1]}) still runs" in r.getMessage() for r in caplog.records)
    finally:
        for popen in held:
            popen.release()
            popen.wait(10)
        thread.join(60)
        for name in segments_of(port):  # only after a failure: leave nothing behind
            os.unlink(os.path.join(SHM_DIR, name))


NOBODY = 65534


def squat(name: str) -> str:
    """Create /dev/shm/``name`` as another user (uid 65534) would: a regular file of theirs, with data."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"theirs")
        os.fchown(fd, NOBODY, NOBODY)
    finally:
        os.close(fd)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")


@needs_root
def test_orphan_cleanup_removes_only_our_regular_files(cpu, tmp_path):
    ours = os.path.join(SHM_DIR, cpu.segment_prefix + "ours")
    with open(ours, "wb") as f:
        f.write(b"ours")
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = os.path.join(SHM_DIR, cpu.segment_prefix + "link")
    theirs = os.path.join(SHM_DIR, cpu.segment_prefix + "theirs")
    try:
        os.symlink(target, link)
        squat(os.path.basename(theirs))
        assert cpu.remove_orphans() == [os.path.basename(ours)]
        assert not os.path.exists(ours)
        assert os.lstat(theirs).st_uid == NOBODY and open(theirs, "rb").read() == b"theirs"
        assert os.path.islink(link) and target.read_bytes() == b"keep"
    finally:
        for path in (ours, link, theirs):
            if os.path.lexists(path):
                os.unlink(path)


@needs_root
def test_refused_start_leaves_the_squatters_names(tmp_path, monkeypatch):
    from cache_manager.cache_data import KV_CACHE_STATUS_SIGNAL
    from cache_manager.ipc_signal import ipc_suffix, signal_segment_name

    port, token = launcher.free_port(), "0123456789abcdef"
    # a squatter who knows the engine's token (it is random: see tests/cache_manager/ctm/test_ipc_names.py for one
    # who does not)
    monkeypatch.setattr("engine_hooks.service.new_ipc_token", lambda: token)
    # the engine's last signal (so its earlier ones are created, then must go) and names under
    # the platform's prefix (what the orphan cleanup deletes by prefix)
    names = [signal_segment_name(KV_CACHE_STATUS_SIGNAL, ipc_suffix(port, token))] + \
        [f"ctm.{port}.{token}.cache{i}" for i in range(3)]
    paths = [squat(name) for name in names]
    try:
        with pytest.raises(FileExistsError, match=f"owned by uid {NOBODY}"):
            start_service(engine_worker_queue_port=port, log_dir=str(tmp_path))
        assert segments_of(port) == sorted(names), "ours must go, the squatter's must stay"
        for path in paths:
            assert os.lstat(path).st_uid == NOBODY and open(path, "rb").read() == b"theirs"
    finally:
        for path in paths:
            if os.path.lexists(path):
                os.unlink(path)
        for name in segments_of(port):  # only after a failure: leave nothing behind
            os.unlink(os.path.join(SHM_DIR, name))


def test_logs_are_private_under_a_permissive_umask(tmp_path):
    log_dir = tmp_path / "a" / "logs"
    old = os.umask(0)  # the CTMs inherit it: every file they make would be world-writable
    try:
        svc = start_service(tp=1, log_dir=str(log_dir))
    finally:
        os.umask(old)
    svc.shutdown()
    assert os.stat(log_dir).st_mode & 0o777 == 0o700
    files = sorted(os.listdir(log_dir))
    assert files == ["cache_transfer_manager_rank0.log", "ctm_rank0.stderr"]
    assert {name: os.stat(log_dir / name).st_mode & 0o777 for name in files} == dict.fromkeys(files, 0o600)
    assert "rank0" in (log_dir / "cache_transfer_manager_rank0.log").read_text()


def run_rank_logger(log_dir: str) -> subprocess.CompletedProcess:
    """``rank_logger`` in a fresh process (it takes over the library loggers), umask 0."""
    code = ("import os, sys; os.umask(0)\n"
            "from cache_manager.cache_transfer_manager import rank_logger\n"
            "rank_logger(0, sys.argv[1]).warning('hello')\n")
    return subprocess.run([sys.executable, "-c", code, log_dir], capture_output=True, text=True, timeout=60,
                          cwd=launcher.REPO_ROOT)


@needs_root
def test_rank_logger_refuses_another_users_directory_and_tightens_ours(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    os.chown(theirs, NOBODY, NOBODY)
    done = run_rank_logger(str(theirs))
    assert done.returncode != 0
    assert f"PermissionError: directory {str(theirs)!r} is owned by uid {NOBODY}" in done.stderr
    assert os.listdir(theirs) == [] and os.stat(theirs).st_mode & 0o777 == 0o777

    ours = tmp_path / "ours"
    ours.mkdir()
    os.chmod(ours, 0o755)
    (ours / "cache_transfer_manager_rank0.log").write_text("old\n")
    os.chmod(ours / "cache_transfer_manager_rank0.log", 0o644)
    done = run_rank_logger(str(ours))
    assert done.returncode == 0, done.stderr
    assert os.stat(ours).st_mode & 0o777 == 0o700
    log = ours / "cache_transfer_manager_rank0.log"
    assert os.stat(log).st_mode & 0o777 == 0o600 and log.read_text().startswith("old\n") and "hello" in log.read_text()
