"""Shared pieces of the pyACL contract stand-in tests (test_standin_acl*.py): the stand-in imported
fresh as ``acl`` and initialised, copy kinds, and host bytes put and got through pointers."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

STANDINS = Path(__file__).parent / "standins"
DEVICE_BYTES = 64 << 20
N = 64 << 10
D2H, H2D, D2D, H2H = 2, 1, 3, 0


def _purge_acl() -> None:
    for name in list(sys.modules):
        if name == "acl" or name.startswith("acl."):
            del sys.modules[name]


def acl_standin(monkeypatch: pytest.MonkeyPatch, root: Path) -> Iterator[ModuleType]:
    """Body of the ``acl`` fixture: the stand-in as ``acl``, its data in ``root``, initialised, this
    thread on device 0; forgotten after the test."""
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.setenv("ACL_STANDIN_DIR", str(root))
    monkeypatch.setenv("ACL_STANDIN_DEVICE_BYTES", str(DEVICE_BYTES))
    _purge_acl()
    import acl as module
    assert module.init() == 0
    assert module.rt.set_device(0) == 0
    try:
        yield module
    finally:
        monkeypatch.setenv("ACL_STANDIN_DIR", str(root))  # a test may have broken the set-up on purpose
        (root / "faults.json").unlink(missing_ok=True)
        module.finalize()
        _purge_acl()


def ok(result: tuple[Any, int]) -> Any:
    value, ret = result
    assert ret == 0, f"aclError {ret}"
    return value


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed * 13 + (i >> 8)) & 0xFF for i in range(n))


def put(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


def get(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)
