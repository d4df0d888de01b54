"""Who created each shared-memory segment, so that what a killed process left behind can be told
from what a live one still uses.

Every process that creates a segment (``ops.shm.SharedMemorySegment(create=True)``) lists it, with
its identity (device, inode), in its own creator record ``/dev/shm/ctm-creator-<pid>-<start>``
(0600, the process's uid).  The record's first line names the process: its pid, its start time
(``/proc/<pid>/stat`` field 22, so a reused pid is told apart), its pid namespace and the boot id.
A name the process unlinks itself leaves its list; the record goes with its last name.  So a
process that cleaned up leaves no record, and one killed outright leaves a record naming exactly
what it created (``ops.shm.sweep_orphans`` removes that, once the process is provably gone).
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CREATOR_PREFIX = "ctm-creator-"
_MAGIC = "ctm-creator/1"
MAX_RECORD_BYTES = 4 << 20  # a sweep reads no more of one record (the ledger compacts far below it)

Identity = tuple[int, int]  # (st_dev, st_ino) of a segment


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_state(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of process ``pid``; None if there is none."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    try:
        fields = text.rsplit(")", 1)[1].split()
        return int(fields[19]), fields[0]  # field 22 and field 3 of proc(5), counted after the name
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Creator:
    """A process, named so that neither a reused pid nor another pid namespace is mistaken for it."""

    pid: int
    start: int
    pidns: int
    boot: str

    @classmethod
    def this_process(cls) -> "Creator":
        pid = os.getpid()
        state = process_state(pid)
        return cls(pid, state[0] if state else 0, _pid_namespace(),
                   _read("/proc/sys/kernel/random/boot_id") or "unknown")

    @property
    def record_name(self) -> str:
        return f"{CREATOR_PREFIX}{self.pid}-{self.start}"

    def header(self) -> str:
        return f"{_MAGIC} pid={self.pid} start={self.start} pidns={self.pidns} boot={self.boot}\n"

    @classmethod
    def parse(cls, line: str) -> "Creator | None":
        parts = line.split()
        if len(parts) != 5 or parts[0] != _MAGIC:
            return None
        try:
            kv = dict(p.split("=", 1) for p in parts[1:])
            return cls(int(kv["pid"]), int(kv["start"]), int(kv["pidns"]), kv["boot"])
        except (KeyError, ValueError):
            return None

    def gone(self, me: "Creator | None" = None) -> bool | None:
        """True if this process provably no longer runs (another boot; its pid free, a zombie, or held by
        a later process); False while it runs; None when it cannot be told (another pid namespace).
        ``me``: the process asking (``this_process()``), read once by a caller that asks many times."""
        me = me or Creator.this_process()
        if self.boot != me.boot:
            return True
        if self.pidns != me.pidns:
            return None
        state = process_state(self.pid)
        return state is None or state[0] != self.start or state[1] in ("Z", "X")


def parse_record(text: str) -> tuple[Creator, list[tuple[str, Identity]]] | None:
    """A record's creator and its listed segments; None if it is not a creator record."""
    lines = text.splitlines()
    creator = Creator.parse(lines[0]) if lines else None
    if creator is None:
        return None
    entries = []
    for line in lines[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            entries.append((parts[2], (int(parts[0]), int(parts[1]))))
    return creator, entries


class CreationLedger:
    """This process's creator record in ``directory`` (one per process; see the module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._lock = threading.Lock()
        self._creator: Creator | None = None
        self._live: dict[str, Identity] = {}
        self._lines = 0  # entries in the file; compacted when far more than the live ones
        self._broken = False  # the record could not be written: segments go unlisted (never wrongly removed)

    def _path(self) -> str:
        assert self._creator is not None
        return os.path.join(self.directory, self._creator.record_name)

    def _ensure(self) -> None:
        """Start this process's record (again after a fork: a child is a creator of its own)."""
        if self._creator is not None and self._creator.pid == os.getpid():
            return
        self._creator, self._live, self._lines, self._broken = Creator.this_process(), {}, 0, False

    def created(self, name: str, identity: Identity) -> None:
        """List ``name`` (just created by this process) in the record."""
        with self._lock:
            self._ensure()
            self._live[name] = identity
            if self._broken:
                return
            try:
                if self._lines > 2 * len(self._live) + 256:
                    self._rewrite()
                else:
                    self._append(f"{identity[0]} {identity[1]} {name}\n")
            except OSError as exc:
                self._broken = True
                logger.warning("cannot write the creator record %s (%s): what this process creates in %s is "
                               "not swept if it is killed", self._path(), exc, self.directory)

    def removed(self, name: str) -> None:
        """``name`` was unlinked by this process; the record goes with the last listed name."""
        with self._lock:
            if self._creator is None or self._creator.pid != os.getpid() or self._live.pop(name, None) is None:
                return
            if not self._live and not self._broken:
                try:
                    os.unlink(self._path())
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    logger.debug("creator record %s stays: %s", self._path(), exc)
                self._lines = 0

    def _open(self, flags: int, truncate: bool = False) -> int:
        fd = os.open(self._path(), flags | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise PermissionError(f"{self._path()} is not a regular file of uid {os.geteuid()}: not writing to it")
        if truncate:
            os.ftruncate(fd, 0)
        return fd

    def _append(self, line: str) -> None:
        if self._lines == 0:
            try:
                fd = self._open(os.O_CREAT | os.O_EXCL)
            except FileExistsError:  # ours from before (pid and start time are unique per boot)
                fd = self._open(0, truncate=True)
            line = self._creator.header() + line
        else:
            fd = self._open(os.O_APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        self._lines += 1

    def _rewrite(self) -> None:
        """The record with only the live names, replaced in one rename."""
        tmp = self._path() + ".tmp"
        text = self._creator.header() + "".join(f"{i[0]} {i[1]} {n}\n" for n, i in self._live.items())
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.rename(tmp, self._path())
        self._lines = len(self._live)
