"""State of the pyACL stand-in shared by every process of a test (tests only).

Everything lives under ``$ACL_STANDIN_DIR``:

* ``dev<id>.mem``: the memory of device ``id``, one sparse file of ``device_bytes`` (default 1 GiB,
  ``$ACL_STANDIN_DEVICE_BYTES`` when the first process creates ``state.json``); bytes move with
  ``os.pread``/``os.pwrite``, never through a host mapping;
* ``state.json``: the allocation and export table, rewritten atomically under an exclusive
  ``fcntl.flock`` of ``state.lock``::

      {"config": {"device_bytes": N, "device_count": N},
       "allocs": [{"dev": 0, "off": 0, "size": 4096, "pid": 123}, ...],
       "exports": {"<key>": {"dev": 0, "off": 0, "size": 4096, "alloc_off": 0, "pid": 123,
                             "flags": 1, "pids": [456], "importers": {"456": 1}}}}

Entries of processes that are gone are dropped the next time the table is opened, as the driver
reclaims a dead process's memory (an export stays while a live importer still holds it).
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

ENV_DIR = "ACL_STANDIN_DIR"
ENV_DEVICE_BYTES = "ACL_STANDIN_DEVICE_BYTES"
ENV_DEVICE_COUNT = "ACL_STANDIN_DEVICE_COUNT"
DEFAULT_DEVICE_BYTES = 1 << 30
DEFAULT_DEVICE_COUNT = 8
MAX_DEVICES = 16

# Opaque device addresses: never mapped in any process (the user half of x86-64 and aarch64
# address spaces has room; mmap does not place anything this low-middle by itself).
DEV_BASE = 0x5A00_0000_0000
DEV_STRIDE = 1 << 36  # per device: [0, 2**35) own allocations, [2**35, 2**36) imported mappings
IMPORT_BIAS = 1 << 35
DEVICE_PAGE = 4096  # allocation granularity and the alignment an IPC export needs
POISON = 0xA5  # fresh device memory is not zeroed on hardware; the stand-in fills it with this

STATE_FILE = "state.json"
LOCK_FILE = "state.lock"
_CHUNK = 1 << 20


def standin_dir() -> Path:
    """``$ACL_STANDIN_DIR``; a missing variable is a broken test set-up, not an aclError."""
    value = os.environ.get(ENV_DIR)
    if not value:
        raise RuntimeError(f"the pyACL stand-in needs ${ENV_DIR}: a directory shared by the test's processes")
    return Path(value)


def device_base(dev: int) -> int:
    return DEV_BASE + dev * DEV_STRIDE


def is_device_address(addr: int) -> bool:
    return DEV_BASE <= addr < DEV_BASE + MAX_DEVICES * DEV_STRIDE


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw, 0)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None


def _gc(state: dict[str, Any]) -> None:
    """Drop what dead processes held, as the driver does when a process exits."""
    pids = {a["pid"] for a in state["allocs"]} | {e["pid"] for e in state["exports"].values()}
    for e in state["exports"].values():
        pids |= {int(p) for p in e["importers"]}
    dead = {p for p in pids if not pid_alive(p)}
    if not dead:
        return
    for key, e in list(state["exports"].items()):
        e["importers"] = {p: n for p, n in e["importers"].items() if int(p) not in dead}
        if e["pid"] in dead and not e["importers"]:
            del state["exports"][key]
    kept = {(e["dev"], e["alloc_off"]) for e in state["exports"].values()}
    state["allocs"] = [a for a in state["allocs"] if a["pid"] not in dead or (a["dev"], a["off"]) in kept]


class Shared:
    """One process's handle on ``$ACL_STANDIN_DIR``: the table and the device files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._config: Optional[tuple[int, int]] = None

    # -- the table ---------------------------------------------------------
    @contextmanager
    def table(self) -> Iterator[dict[str, Any]]:
        """The table, locked against every process; written back if the block changed it and did not raise."""
        with open(self.root / LOCK_FILE, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                state = self._load()
                before = json.dumps(state, sort_keys=True)
                _gc(state)
                if state["config"] is None:
                    state["config"] = self._config_from_env()
                self._config = (state["config"]["device_bytes"], state["config"]["device_count"])
                yield state
                after = json.dumps(state, sort_keys=True)
                if after != before:
                    tmp = self.root / f"{STATE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
                    tmp.write_text(after)
                    os.replace(tmp, self.root / STATE_FILE)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _load(self) -> dict[str, Any]:
        try:
            text = (self.root / STATE_FILE).read_text()
        except FileNotFoundError:
            text = ""
        if not text.strip():
            return {"config": None, "allocs": [], "exports": {}}
        return json.loads(text)

    @staticmethod
    def _config_from_env() -> dict[str, int]:
        nbytes = _env_int(ENV_DEVICE_BYTES, DEFAULT_DEVICE_BYTES)
        count = _env_int(ENV_DEVICE_COUNT, DEFAULT_DEVICE_COUNT)
        if nbytes <= 0 or nbytes % DEVICE_PAGE or nbytes > IMPORT_BIAS:
            raise ValueError(f"${ENV_DEVICE_BYTES}={nbytes} must be a positive multiple of {DEVICE_PAGE} <= 2**35")
        if not 1 <= count <= MAX_DEVICES:
            raise ValueError(f"${ENV_DEVICE_COUNT}={count} must be in 1..{MAX_DEVICES}")
        return {"device_bytes": nbytes, "device_count": count}

    def config(self) -> tuple[int, int]:
        """``(device_bytes, device_count)``, fixed by the first process that made the table."""
        if self._config is None:
            with self.table():
                pass  # table() caches the config, so calls made inside a table() block never re-lock
        assert self._config is not None
        return self._config

    # -- allocation --------------------------------------------------------
    def allocate(self, state: dict[str, Any], dev: int, size: int, pid: int) -> Optional[int]:
        """First fit of ``size`` (a page multiple) on ``dev``; the file offset, or None when full."""
        device_bytes = state["config"]["device_bytes"]
        spans = sorted((a["off"], a["off"] + a["size"]) for a in state["allocs"] if a["dev"] == dev)
        at = 0
        for start, end in spans:
            if start - at >= size:
                break
            at = max(at, end)
        if device_bytes - at < size:
            return None
        state["allocs"].append({"dev": dev, "off": at, "size": size, "pid": pid})
        return at

    # -- bytes -------------------------------------------------------------
    def fd(self, dev: int) -> int:
        with self._fd_lock:
            fd = self._fds.get(dev)
            if fd is None:
                fd = os.open(self.root / f"dev{dev}.mem", os.O_RDWR | os.O_CREAT, 0o600)
                nbytes = self.config()[0]
                if os.fstat(fd).st_size < nbytes:
                    os.ftruncate(fd, nbytes)  # sparse: no disk until written
                self._fds[dev] = fd
            return fd

    def read_into(self, dev: int, off: int, view: memoryview) -> None:
        fd, done = self.fd(dev), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"short read of dev{dev}.mem at {off + done}")
            done += n

    def write_from(self, dev: int, off: int, view: memoryview) -> None:
        fd, done = self.fd(dev), 0
        while done < len(view):
            n = os.pwrite(fd, view[done:], off + done)
            if n <= 0:
                raise OSError(f"short write of dev{dev}.mem at {off + done}")
            done += n

    def fill(self, dev: int, off: int, size: int, byte: int) -> None:
        chunk = memoryview(bytes([byte]) * min(size, _CHUNK))
        for at in range(0, size, _CHUNK):
            self.write_from(dev, off + at, chunk[: min(_CHUNK, size - at)])

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
