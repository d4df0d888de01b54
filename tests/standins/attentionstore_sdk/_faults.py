"""Fault knobs of the AttentionStore SDK stand-in (tests only).

Loading ``$ATTENTIONSTORE_STANDIN_DIR/faults.json`` (re-read at every call), the per-process,
per-method call counts that ``"raise_on_call"`` counts, the ``calls.log`` record of every call,
and the injection of the faults the knobs ask for.  See ``attentionstore_sdk.sdk`` for the knobs.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ._checks import is_int
from .utils.err import AttentionStoreSDKError

NOT_READY_MESSAGE = "cuda memory not ready"
FAULT_METHODS = ("match", "read", "write")

_call_lock = threading.Lock()
_call_counts: dict[str, int] = {}  # per process, per method: what "raise_on_call" counts


@dataclass(frozen=True)
class Faults:
    not_ready_until: float | None = None
    raise_on_call: Mapping[str, int] = field(default_factory=dict)
    raise_always: frozenset[str] = frozenset()
    sleep_s: Mapping[str, float] = field(default_factory=dict)
    timeout: frozenset[str] = frozenset()
    write_first_k: int | None = None


_FAULT_KEYS = {"not_ready_until", "raise_on_call", "raise", "sleep_s", "timeout", "write_first_k"}


def _fault_methods(key: str, value: object) -> frozenset[str]:
    if not isinstance(value, list) or any(m not in FAULT_METHODS for m in value):
        raise ValueError(f"faults.json {key!r} must be a list of {FAULT_METHODS}, got {value!r}")
    return frozenset(value)


def _fault_map(key: str, value: object, is_valid: Callable[[Any], bool]) -> dict[str, Any]:
    if not isinstance(value, dict) or any(m not in FAULT_METHODS or not is_valid(v) for m, v in value.items()):
        raise ValueError(f"faults.json {key!r} has a bad method or value: {value!r}")
    return dict(value)


def load_faults(root: Path) -> Faults:
    """The knobs of ``root/faults.json`` as they are now (re-read at every call)."""
    try:
        text = (root / "faults.json").read_text()
    except FileNotFoundError:
        return Faults()
    if not text.strip():
        return Faults()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{root / 'faults.json'} is not JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) - _FAULT_KEYS:
        raise ValueError(f"faults.json must be an object with keys among {sorted(_FAULT_KEYS)}, got {data!r}")
    until = data.get("not_ready_until")
    if until is not None and (isinstance(until, bool) or not isinstance(until, (int, float))):
        raise ValueError(f"faults.json 'not_ready_until' must be epoch seconds, got {until!r}")
    first_k = data.get("write_first_k")
    if first_k is not None and (not is_int(first_k) or first_k < 0):
        raise ValueError(f"faults.json 'write_first_k' must be an int >= 0, got {first_k!r}")
    return Faults(
        not_ready_until=None if until is None else float(until),
        raise_on_call=_fault_map("raise_on_call", data.get("raise_on_call", {}), lambda v: is_int(v) and v >= 1),
        raise_always=_fault_methods("raise", data.get("raise", [])),
        sleep_s=_fault_map("sleep_s", data.get("sleep_s", {}),
                           lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
        timeout=_fault_methods("timeout", data.get("timeout", [])),
        write_first_k=first_k,
    )


def log_call(root: Path, method: str) -> None:
    """Append ``"<pid> <method>"`` to ``root/calls.log`` (``O_APPEND``: one line per call)."""
    fd = os.open(root / "calls.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()} {method}\n".encode())
    finally:
        os.close(fd)


def _count_call(method: str) -> int:
    with _call_lock:
        _call_counts[method] = _call_counts.get(method, 0) + 1
        return _call_counts[method]


def begin_call(root: Path, method: str) -> tuple[Faults, int]:
    """Log and count the call, read the knobs, and hang first if ``sleep_s`` says so."""
    log_call(root, method)
    nth = _count_call(method)
    faults = load_faults(root)
    pause = faults.sleep_s.get(method)
    if pause:
        time.sleep(pause)
    return faults, nth


def inject(method: str, faults: Faults, nth: int, timeout: float) -> None:
    """Raise (after waiting ``timeout`` for the ``"timeout"`` knob) if a knob fails this call."""
    if faults.not_ready_until is not None and time.time() < faults.not_ready_until:
        raise AttentionStoreSDKError(NOT_READY_MESSAGE)
    if method in faults.raise_always:
        raise AttentionStoreSDKError(f"injected failure of {method}")
    if faults.raise_on_call.get(method) == nth:
        raise AttentionStoreSDKError(f"injected failure of {method} call {nth}")
    if method in faults.timeout:
        time.sleep(timeout)
        raise AttentionStoreSDKError("timeout")
