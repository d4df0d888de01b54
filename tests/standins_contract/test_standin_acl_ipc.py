"""Unit tests of the pyACL contract stand-in (tests/standins/acl): IPC across two processes.

An exported device allocation imported by a second process that reads and writes it through its
own pointer, with pid validation off and on, and importers closing first.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

from tests.standin_acl_helpers import (D2H, DEVICE_BYTES, H2D, N, STANDINS, acl_standin, get, ok, pattern,
                                       put)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "acl"


@pytest.fixture
def acl(monkeypatch: pytest.MonkeyPatch, root: Path) -> Iterator[ModuleType]:
    """The stand-in as ``acl``, initialised, this thread on device 0; forgotten after the test."""
    yield from acl_standin(monkeypatch, root)


# -- IPC across two processes ------------------------------------------------------------
IMPORTER = r"""
import ctypes, json, sys
import acl
assert acl.init() == 0 and acl.rt.set_device(0) == 0
print(json.dumps({"pid": acl.rt.device_get_bare_tgid()[0]}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "import":
        n = cmd["n"]
        ptr, ret = acl.rt.ipc_mem_import_by_key(cmd["key"], 0)
        out = {"ret": ret}
        if ret == 0:
            host, _ = acl.rt.malloc_host(n)
            out["read"] = acl.rt.memcpy(host, n, ptr, n, 2)
            out["data"] = ctypes.string_at(host, n).hex()
            ctypes.memset(host, 0x3C, n)
            out["write"] = acl.rt.memcpy(ptr, n, host, n, 1)
            out["foreign"] = acl.rt.memcpy(host, n, cmd["exporter_ptr"], n, 2)
    else:
        out = {"ret": acl.rt.ipc_mem_close(cmd["key"])}
    print(json.dumps(out), flush=True)
"""


class Importer:
    def __init__(self, root: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(STANDINS), ACL_STANDIN_DIR=str(root),
                   ACL_STANDIN_DEVICE_BYTES=str(DEVICE_BYTES))
        self.proc = subprocess.Popen([sys.executable, "-c", IMPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self.pid = self._read()["pid"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"importer exited with {self.proc.wait()}"
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


def test_ipc_across_processes(acl: ModuleType, root: Path) -> None:
    data = pattern(N, seed=5)
    dev, host = ok(acl.rt.malloc(N, 0)), ok(acl.rt.malloc_host(N))
    put(host, data)
    assert acl.rt.memcpy(dev, N, host, N, H2D) == 0
    child = Importer(root)
    try:
        # pid validation off: any process may import
        key = ok(acl.rt.ipc_mem_get_export_key(dev, N, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION))
        out = child.ask(op="import", key=key, n=N, exporter_ptr=dev)
        assert out["ret"] == 0 and out["read"] == 0 and bytes.fromhex(out["data"]) == data
        assert out["write"] == 0
        assert out["foreign"] == acl.ACL_ERROR_RT_PARAM_INVALID  # the exporter's address means nothing there
        assert acl.rt.memcpy(host, N, dev, N, D2H) == 0 and get(host, N) == b"\x3c" * N  # same memory
        # importers close first
        assert acl.rt.ipc_mem_close(key) == acl.ACL_ERROR_RT_IPC_ERROR
        assert acl.rt.free(dev) == acl.ACL_ERROR_RT_MEMORY_FREE
        assert child.ask(op="close", key=key)["ret"] == 0
        assert child.ask(op="close", key=key)["ret"] == acl.ACL_ERROR_RT_INVALID_HANDLE
        assert acl.rt.ipc_mem_close(key) == 0
        assert child.ask(op="import", key=key, n=N, exporter_ptr=dev)["ret"] == acl.ACL_ERROR_RT_INVALID_HANDLE
        # pid validation on: only whitelisted pids import
        key = ok(acl.rt.ipc_mem_get_export_key(dev, N, 65, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT))
        assert child.ask(op="import", key=key, n=N, exporter_ptr=dev)["ret"] == acl.ACL_ERROR_RT_NO_PERMISSION
        assert acl.rt.ipc_mem_set_import_pid(key, [child.pid]) == 0
        assert child.ask(op="import", key=key, n=N, exporter_ptr=dev)["ret"] == 0
        assert child.ask(op="close", key=key)["ret"] == 0
        assert acl.rt.ipc_mem_close(key) == 0
        assert acl.rt.free(dev) == 0
    finally:
        child.close()
