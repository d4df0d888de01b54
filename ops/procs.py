"""Process helpers shared by the layers above (liveness of an engine, of a file's writer; clean-up
that outlives its owner; files only this process's user may read)."""
from __future__ import annotations

import ipaddress
import logging
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
from typing import Sequence

logger = logging.getLogger(__name__)


def process_argv(pid: int) -> list[str] | None:
    """Process ``pid``'s command line as the kernel keeps it (``/proc/<pid>/cmdline``), or None when
    it cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return None


def wait_readable(fds: Sequence[int], timeout: float | None) -> set[int]:
    """The descriptors of ``fds`` that are readable, or hung up, in error or invalid (any of these is
    "ready"), waiting up to ``timeout`` seconds (None: until one is) for the first.  poll(2), not
    select(2): a descriptor numbered past FD_SETSIZE (1024) is fine.  The timeout is rounded up to
    poll's milliseconds, so a wait never ends early."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return {fd for fd, _ in poller.poll(ms)}


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class ProcessWatch:
    """Whether one process has ended, watched through a pidfd opened now: it names the process
    itself, so a later holder of its pid cannot pass for it (the bare pid where pidfds are not
    available).  ``gone()`` never blocks, and once True stays True."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd = -1
        self._gone = False
        if hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone = True
            except OSError:
                self._fd = -1  # no pidfd here: the pid itself is watched

    def gone(self) -> bool:
        if not self._gone:
            self._gone = bool(wait_readable([self._fd], 0)) if self._fd >= 0 else not pid_alive(self.pid)
        return self._gone

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def private_dir(path: str) -> str:
    """Create directory ``path`` (and its parents) mode 0700 whatever the umask, or accept an existing
    one of this process's effective uid, tightened to 0700; returns ``path``.  DESIGN §4: logs are
    0600 in a 0700 directory, since they name the engine's ports, files and storage keys.

    ``PermissionError`` for a directory another user owns: its owner could read, replace or
    remove what is written there, and changing its mode would be taking it over."""
    os.makedirs(path, mode=0o700, exist_ok=True)  # the mode is masked by the umask: fchmod below
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise PermissionError(f"directory {path!r} is owned by uid {info.st_uid}, not by this process's uid "
                                  f"{os.geteuid()}: refusing to write logs there (use a directory of your own)")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def open_private(path: str, append: bool = True) -> int:
    """Open ``path`` for writing, created 0600 whatever the umask (an existing file of ours is
    tightened to 0600); a descriptor.  ``PermissionError`` for a symlink, or for something not
    a regular file of this process's effective uid, rather than write through it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise PermissionError(f"{path!r} is a symbolic link: refusing to write through it") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError(f"{path!r} is not a regular file of uid {os.geteuid()} (mode {info.st_mode:o}, "
                                  f"uid {info.st_uid}): refusing to write to it")
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


# The reaper's body, run as ``python -c``: it must not import the project (fast start, nothing to
# break).  argv: owner pid, then the paths.  Its stdin is a pipe whose only writer is the owner:
# "pid N" lines name processes that may still write under the paths; "done" means the owner removed
# the paths itself.  EOF without "done" (the kernel closes the pipe however the owner dies) or the
# owner's pidfd becoming readable means the owner is gone: remove the paths at once, then again once
# the named processes, and any process whose command line names a path (one the owner was still
# starting when it died), are gone too, since a writer that outlived the owner may recreate them.
_REAPER = r"""
import math, os, select, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
owner, paths = int(sys.argv[1]), sys.argv[2:]
def remove():
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
def ready(fds, timeout=None):  # poll(2): select(2) refuses a descriptor past FD_SETSIZE
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))}
fds = []
try:
    fds.append(os.pidfd_open(owner))
except (AttributeError, OSError):
    pass
watched = []
if os.getppid() == owner:  # else the owner died before the pidfd opened (or its pid was reused)
    buf = b""
    done = False
    while not done:
        if 0 not in ready([0] + fds):
            break  # the owner exited
        chunk = os.read(0, 4096)
        if not chunk:
            break  # EOF: the owner exited
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line == b"done":
                done = True
            elif line.startswith(b"pid "):
                try:
                    watched.append(os.pidfd_open(int(line[4:])))
                except (AttributeError, OSError, ValueError):
                    pass
    if done:
        sys.exit(0)
remove()
for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
    try:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            argv = f.read().decode(errors="replace")
        if any(p in argv for p in paths):
            watched.append(os.pidfd_open(int(pid)))
    except (AttributeError, OSError, ValueError):
        pass
end = time.monotonic() + 30.0
while watched and time.monotonic() < end:
    gone = ready(watched, end - time.monotonic())
    watched = [fd for fd in watched if fd not in gone]
remove()
"""


class PathReaper:
    """Removes ``paths`` when this process ends, however it ends: normally, by an exception, or
    killed (SIGKILL included).

    A small child process (``python -c``, its own session so a terminal's Ctrl+C does not reach
    it) waits on this process's pidfd and on a pipe only this process writes.  ``close()`` removes
    the paths here and lets the child exit; if this process dies first, the child removes them.
    Name processes that may write under the paths with ``watch(pid)``: after the owner's death the
    child removes the paths again once those, and any process whose command line names a path,
    are gone (bounded to 30 s)."""

    def __init__(self, paths: Sequence[str]):
        self.paths = [os.path.abspath(p) for p in paths]
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(os.getpid()), *self.paths], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def watch(self, pid: int) -> None:
        """``pid`` may write under the paths: if this process dies, remove them again once ``pid`` is gone."""
        self._send(f"pid {int(pid)}\n")

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:  # the reaper is gone: close() still cleans up
            logger.warning("path reaper (pid %s) is gone: %s", self._proc.pid, exc)

    def close(self, remove: bool = True, timeout: float = 5.0) -> None:
        """Remove the paths (unless ``remove`` is False) and stop the reaper.  Idempotent."""
        if remove:
            for p in self.paths:
                shutil.rmtree(p, ignore_errors=True)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.write(b"done\n")
                proc.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("path reaper (pid %d) did not exit; killing it", proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout)

    def __enter__(self) -> "PathReaper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listening_ports(pid: int | str = "self") -> set[int]:
    """TCP ports process ``pid`` listens on; empty where /proc says nothing."""
    return {port for _, port in listening_sockets(pid)}


def listening_sockets(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (its sockets in /proc/<pid>/fd
    matched to the kernel's tables; ``0.0.0.0`` or ``::``: every interface); empty where /proc says
    nothing."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    found = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                address, port = cols[1].rsplit(":", 1)
                found.add((_proc_address(address), int(port, 16)))
    return found


def _proc_address(hex_address: str) -> str:
    """/proc/net/tcp's address (host-order 32-bit words in hex) as text."""
    raw = b"".join(int(hex_address[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return f"::ffff:{mapped}" if mapped is not None else str(address)
