"""Whether the engine a CTM serves is still there.

The CTM exits once the engine *process* is gone: ``--engine_pid`` watched through a pidfd (which
names the process itself, so a reused pid cannot fool it), else the parent; and, once the CTM joined
the queue over its local link, the process the kernel names at the link's other end
(``watch_engine``).  That last one is what ends a CTM FastDeploy launched: through
``Popen(cmd, shell=True, preexec_fn=os.setsid)`` without an engine pid, its parent is a shell that
outlives the engine.  Until then (a CTM waits for the engine's caches before it joins the queue)
a CTM launched through ``sh -c`` without an engine pid watches the shell's parent, the process that
launched it, as it would watch its own parent: an engine that dies while starting up takes its
CTMs with it at once, not at ``--attach_timeout``.  A
``worker_healthy_live_signal`` that stops changing for ``FD_CACHE_PROC_EXIT_TIMEOUT`` seconds
(on this process's monotonic clock, so wall-clock steps do not matter) is logged and nothing more:
a paused engine (SIGSTOP, a debugger, swapped out) still owns its caches.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Iterable, Mapping

from ops.platform import Platform
from ops.procs import ProcessWatch, process_argv

from cache_manager.ipc_signal import IPCSignal, unlink_if_same
from cache_manager.queue.unix_address import private_dir_problem
from cache_manager.queue.wire import SECRET_ENV, SECRET_FILE_ENV

EXIT_TIMEOUT_ENV = "FD_CACHE_PROC_EXIT_TIMEOUT"
SHELLS = ("sh", "bash", "dash", "zsh", "ksh", "ash", "busybox")


def shell_launcher(ppid: int) -> int | None:
    """The process that started this one through ``<shell> -c`` (FastDeploy's ``Popen(cmd,
    shell=True)``): the parent shell's parent; None when the parent is no such shell."""
    argv = process_argv(ppid)
    try:
        with open(f"/proc/{ppid}/stat") as f:
            grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    if argv is None:
        return None
    name = os.path.basename(argv[0]).lstrip("-")
    if name in SHELLS and "-c" in argv[1:3] and grandparent > 1:
        return grandparent
    return None


class EngineGone(Exception):
    """The engine is gone: the CTM stops, and removes what the engine can no longer unlink."""


class EngineWatch:
    def __init__(self, engine_pid: int | None, log: logging.Logger):
        self.engine_pid = engine_pid
        self.parent_pid = os.getppid()
        self.exit_timeout = float(os.environ.get(EXIT_TIMEOUT_ENV, "30"))
        self._log = log
        self._engine = ProcessWatch(engine_pid) if engine_pid is not None else None
        self._beat_value: int | None = None
        self._beat_seen = time.monotonic()
        self._beat_stale_logged = False
        self._linked: ProcessWatch | None = None  # the engine behind the queue's link
        # Before the link: with no engine pid, the process that launched us through a shell.
        launcher = shell_launcher(self.parent_pid) if engine_pid is None else None
        self._launcher = ProcessWatch(launcher) if launcher is not None else None
        if launcher is not None:
            log.info("launched through a shell by process %d: watching it until the queue names the engine", launcher)

    def watch_engine(self, pid: int) -> None:
        """Also treat the end of process ``pid`` (the engine, as the queue's local link names it) as the
        engine's.  Call it right after the link connected: the process is alive then, so the pidfd
        opened here names it and not a later holder of its pid."""
        if pid <= 0 or pid == self.engine_pid or self._linked is not None:
            return
        self._linked = ProcessWatch(pid)
        self._log.info("watching engine process %d, the queue's end of the local link", pid)

    def _launcher_gone(self) -> bool:
        """The shell's launcher ended, while it still stands for the engine (no link yet)."""
        return self._linked is None and self._launcher is not None and self._launcher.gone()

    def engine_exited(self) -> bool:
        """True once the engine process is gone."""
        if (self._linked is not None and self._linked.gone()) or self._launcher_gone():
            return True
        if self._engine is None:
            return os.getppid() != self.parent_pid
        return self._engine.gone()

    def check(self, heartbeat: IPCSignal | None) -> None:
        """Raise ``EngineGone`` if the engine process is gone; log a heartbeat that stopped or resumed."""
        if self.engine_exited():
            who = f"engine process {self.engine_pid}" if self.engine_pid else f"parent {self.parent_pid}"
            if self._linked is not None and self._linked.gone():
                who = f"engine process {self._linked.pid} (the queue's end of the local link)"
            elif self._launcher_gone():
                who = f"process {self._launcher.pid}, which launched this CTM through a shell"
            raise EngineGone(f"{who} is gone")
        if heartbeat is None:
            return
        value, now = int(heartbeat.value[0]), time.monotonic()
        if value != self._beat_value:
            if self._beat_stale_logged:
                self._log.warning("worker_healthy_live_signal moves again: the engine is back")
            self._beat_value, self._beat_seen, self._beat_stale_logged = value, now, False
        elif now - self._beat_seen > self.exit_timeout and not self._beat_stale_logged:
            # A live engine that stopped beating is paused: its caches are still its own, so
            # nothing is removed and the CTM keeps serving.
            self._log.warning("worker_healthy_live_signal has not changed for %.0fs (> %s=%g) but the engine "
                              "process is alive: keeping its caches and serving on", now - self._beat_seen,
                              EXIT_TIMEOUT_ENV, self.exit_timeout)
            self._beat_stale_logged = True


QUEUE_DIR_PREFIX = "ctm-queue-"  # ``engine_hooks.fastdeploy.secret.SecretFile``'s directories


def remove_engine_leftovers(signals: Iterable[IPCSignal | None], platform: Platform, log: logging.Logger,
                            environ: Mapping[str, str] | None = None) -> None:
    """The engine is gone without cleaning up: remove what it left, by identity, never by name alone.

    What this CTM attached (the platform's segments, ``Platform.remove_attached``, and ``signals``), each
    only while its name still holds the file attached: an engine restarted on the same port keeps its
    new segments.  Then what processes that are provably gone created and left, the engine among them
    (``Platform.sweep_orphans``: their creator records; names of the engine this CTM did not attach, its
    other ranks' caches and its other signals, go that way).  And the queue's private directory (secret
    file, Unix socket) the CTM was handed.  Only our own uid's files go; every rank may run this at
    once (each step is idempotent)."""
    removed = platform.remove_attached()
    count = sum(unlink_if_same(sig.segment_name, sig.identity) for sig in signals if sig is not None)
    swept = platform.sweep_orphans()
    env = os.environ if environ is None else environ
    secret_file = None if env.get(SECRET_ENV) else env.get(SECRET_FILE_ENV)  # only the file our secret came from
    directory = os.path.dirname(os.path.abspath(secret_file)) if secret_file else None
    if directory and os.path.basename(directory).startswith(QUEUE_DIR_PREFIX) and private_dir_problem(directory) is None:
        shutil.rmtree(directory, ignore_errors=True)
    log.warning("engine gone: removed the %d cache segments and %d signals attached here that were still its own, "
                "and swept %d segments of processes that are gone", len(removed), count, len(swept))
