"""Fault knobs of the EMS contract stand-in (tests only; not the Huawei SDK).

Tests steer processes that use the stand-in from outside, through ``$EMS_STANDIN_DIR/faults.json``
(re-read at every call; missing or empty = no faults).  Keys, every one optional:

* ``"raise_on_call": {"save": N, ...}``: the Nth call (1-based, per process, per method) raises
  ``EmsException(EMS_INTERNAL_ERROR)``;
* ``"raise": ["load", ...]``: every call of those methods raises ``EMS_INTERNAL_ERROR``;
* ``"sleep_s": {"save": 3.0, ...}``: the call first sleeps that long, ignoring ``option.timeout``;
* ``"timeout": ["load", ...]``: the call waits ``option.timeout`` ms, then raises ``EMS_TIMEOUT``;
* ``"save_first_k": k``: every save stores only its first k blocks (``success = min(k, total)``);
* ``"unhealthy": true``: ``check_health()`` is False; save/load/exists raise ``EMS_UNHEALTHY``.

Method names are ``save``, ``load``, ``exists`` and ``check_health`` (``timeout``: not
``check_health``, which has no option); ``async_save``/``async_load`` count as ``save``/``load``.
An unknown key, method or a value of the wrong type raises ``ValueError`` (a broken test set-up
must not look like an SDK failure).  Every call also appends ``"<pid> <method>\\n"`` to
``$EMS_STANDIN_DIR/calls.log`` (O_APPEND; ``<method>`` as called, e.g. ``async_save``).

A knob decided at call time is applied by ``FaultPlan.apply``: sleep, then unhealthy, then the
raise knobs, then the timeout; for an async call that happens on its background thread.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import EmsErrorCode, EmsException
from .options import is_int

METHODS = ("save", "load", "exists", "check_health")
_WITH_OPTION = ("save", "load", "exists")
_KEYS = ("raise_on_call", "raise", "sleep_s", "timeout", "save_first_k", "unhealthy")
FAULTS_FILE = "faults.json"
CALLS_LOG = "calls.log"
_PARSE_RETRIES = 20  # a test rewriting the file in place may be caught half-way: retry briefly


@dataclass(frozen=True)
class FaultPlan:
    """The faults one call is subject to, decided when it was made."""

    method: str
    sleep_s: float = 0.0
    unhealthy: bool = False
    raise_internal: bool = False
    timeout: bool = False
    save_first_k: Optional[int] = None

    def apply(self, timeout_ms: Optional[int]) -> None:
        """Sleep and raise as the knobs say (``check_health`` reports ``unhealthy`` itself)."""
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        if self.unhealthy and self.method != "check_health":
            raise EmsException(EmsErrorCode.EMS_UNHEALTHY, f"{self.method}: EMS is unhealthy (fault knob)")
        if self.raise_internal:
            raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"{self.method}: injected internal error (fault knob)")
        if self.timeout and timeout_ms is not None:
            time.sleep(timeout_ms / 1000.0)
            raise EmsException(EmsErrorCode.EMS_TIMEOUT, f"{self.method}: timed out after {timeout_ms} ms (fault knob)")


class FaultInjector:
    """Reads the knobs of one ``EMS_STANDIN_DIR``, counts calls and logs them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._pid = os.getpid()

    def begin(self, method: str, called_as: str) -> FaultPlan:
        """Log and count one call of ``method`` (made as ``called_as``) and decide its faults."""
        if method not in METHODS:
            raise ValueError(f"unknown EMS stand-in method {method!r}")
        self._log(called_as)
        with self._lock:
            if self._pid != os.getpid():  # a forked child counts its own calls
                self._pid, self._counts = os.getpid(), {}
            n = self._counts.get(method, 0) + 1
            self._counts[method] = n
        knobs = self.read()
        first_k = knobs.get("save_first_k") if method == "save" else None
        return FaultPlan(
            method=method,
            sleep_s=float(knobs.get("sleep_s", {}).get(method, 0.0)),
            unhealthy=bool(knobs.get("unhealthy", False)),
            raise_internal=method in knobs.get("raise", ()) or knobs.get("raise_on_call", {}).get(method) == n,
            timeout=method in knobs.get("timeout", ()),
            save_first_k=first_k,
        )

    def read(self) -> dict[str, Any]:
        """The current knobs, validated (``{}`` when the file is missing or empty)."""
        path = self.root / FAULTS_FILE
        for attempt in range(_PARSE_RETRIES):
            try:
                text = path.read_text()
            except FileNotFoundError:
                return {}
            if not text.strip():
                return {}
            try:
                knobs = json.loads(text)
                break
            except json.JSONDecodeError as exc:
                if attempt == _PARSE_RETRIES - 1:
                    raise ValueError(f"EMS stand-in: {path} is not valid JSON: {exc}") from None
                time.sleep(0.005)
        check_knobs(knobs, str(path))
        return knobs

    def _log(self, called_as: str) -> None:
        fd = os.open(self.root / CALLS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {called_as}\n".encode())
        finally:
            os.close(fd)


def check_knobs(knobs: Any, where: str) -> None:
    """Raise ``ValueError`` unless ``knobs`` is a valid fault-knob mapping."""
    def bad(msg: str) -> ValueError:
        return ValueError(f"EMS stand-in fault knobs in {where}: {msg}")

    if not isinstance(knobs, dict):
        raise bad(f"must be a JSON object, got {type(knobs).__name__}")
    unknown = sorted(set(knobs) - set(_KEYS))
    if unknown:
        raise bad(f"unknown key(s) {unknown}; known: {list(_KEYS)}")

    def methods(key: str, allowed: tuple[str, ...], names: Any) -> None:
        for name in names:
            if name not in allowed:
                raise bad(f"{key}: unknown method {name!r}; known: {list(allowed)}")

    for key in ("raise_on_call", "sleep_s"):
        table = knobs.get(key, {})
        if not isinstance(table, dict):
            raise bad(f"{key} must be an object of method -> number")
        methods(key, METHODS, table)
        for name, value in table.items():
            if key == "raise_on_call" and (not is_int(value) or value < 1):
                raise bad(f"raise_on_call[{name!r}] must be an int >= 1, got {value!r}")
            if key == "sleep_s" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise bad(f"sleep_s[{name!r}] must be a number >= 0, got {value!r}")
    for key, allowed in (("raise", METHODS), ("timeout", _WITH_OPTION)):
        names = knobs.get(key, [])
        if not isinstance(names, list):
            raise bad(f"{key} must be a list of method names")
        methods(key, allowed, names)
    first_k = knobs.get("save_first_k")
    if first_k is not None and (not is_int(first_k) or first_k < 0):
        raise bad(f"save_first_k must be an int >= 0, got {first_k!r}")
    if not isinstance(knobs.get("unhealthy", False), bool):
        raise bad(f"unhealthy must be true or false, got {knobs['unhealthy']!r}")
