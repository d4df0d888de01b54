"""Call counts and fault knobs of the LLM-DataDist stand-in (tests only).

Knobs live in ``$ACL_STANDIN_DIR/llm_datadist_faults.json`` (next to the pyACL stand-in's
``faults.json``), re-read at every call, so a test steers CTM processes it did not start.  Keys,
every one optional:

* ``"fail": {"swap_blocks": 3, "register_blocks_cache": [1, 2]}``: those calls (1-based, counted per
  process as ``standin_calls()`` counts them, from the last ``standin_reset_calls()``) raise
  ``LLMException`` (status ``LLM_INJECTED_FAULT``) before doing anything;
* ``"max_addresses": 240``: the registered-address limit of some releases (default 256);
* ``"staging_blocks": N``: blocks of the swap-in staging area (default 4);
* ``"stall_ms": {"pull_blocks": 300}``: those transfer calls take that much longer (bounded by
  sync_kv_timeout: past it they raise ``LLM_TIMEOUT`` and break their link);
* ``"link_down": [cluster ids] | true``: links to or from those clusters are down: ``link_clusters``
  to them and transfers over them fail with ``LLM_LINK_FAILED`` at once;
* ``"unreachable": [cluster ids] | true``: ``link_clusters`` to them gets no answer and fails
  (``LLM_LINK_FAILED``) when its timeout ends;
* ``"mem_status": "PREPARING" | "FAILED"``: what ``query_register_mem_status`` answers;
  ``"preparing_queries": N``: its first N answers per comm_id are ``PREPARING``.

An unknown key, call name or a value of the wrong type raises ``ValueError`` (a broken test set-up).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ._types import LLMException, LLMStatusCode, is_int

FAULTS_FILE = "llm_datadist_faults.json"
API_NAMES = ("init", "finalize", "cache_manager", "register_blocks_cache", "unregister_cache",
             "create_cpu_cache", "swap_blocks", "register_cache", "remove_cache_key", "link_clusters",
             "unlink_clusters", "link", "unlink", "query_register_mem_status", "pull_blocks", "push_blocks",
             "push_cache", "pull_cache")
TRANSFER_CALLS = ("pull_blocks", "push_blocks", "push_cache", "pull_cache")
_INTS = ("max_addresses", "staging_blocks", "preparing_queries")
_CLUSTER_LISTS = ("link_down", "unreachable")
MEM_STATUSES = ("OK", "PREPARING", "FAILED")


class _Calls:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()


_CALLS = _Calls()


def _calls() -> _Calls:
    global _CALLS
    if _CALLS.pid != os.getpid():  # a forked child counts from zero
        _CALLS = _Calls()
    return _CALLS


def count(name: str, n: int = 1) -> int:
    """Add ``n`` to ``name``'s count; the new count."""
    calls = _calls()
    with calls.lock:
        calls.counts[name] += n
        return calls.counts[name]


def standin_calls() -> dict[str, int]:
    """Test-only: API calls of this process by name (failed calls too), and the pyACL calls the
    stand-in made for them: ``"acl.rt.memcpy"``, ``"acl.rt.malloc"``, ``"acl.rt.free"``."""
    calls = _calls()
    with calls.lock:
        return dict(calls.counts)


def standin_reset_calls() -> None:
    """Test-only: zero the counts (the ``"fail"`` knob counts from here too)."""
    calls = _calls()
    with calls.lock:
        calls.counts.clear()


def _root() -> Path:
    value = os.environ.get("ACL_STANDIN_DIR")
    if not value:
        raise RuntimeError("the LLM-DataDist stand-in runs on the pyACL stand-in and needs $ACL_STANDIN_DIR")
    return Path(value)


def _check(knobs: Any) -> dict[str, Any]:
    if not isinstance(knobs, dict):
        raise ValueError(f"{FAULTS_FILE} must hold a JSON object")
    for key, value in knobs.items():
        if key in _INTS:
            if not is_int(value) or value <= 0:
                raise ValueError(f"{FAULTS_FILE}: {key!r} must be a positive integer")
        elif key == "fail":
            if not isinstance(value, dict):
                raise ValueError(f"{FAULTS_FILE}: 'fail' must map call names to N or [N, ...]")
            for name, nth in value.items():
                if name not in API_NAMES:
                    raise ValueError(f"{FAULTS_FILE}: unknown call {name!r} in 'fail' (known: {', '.join(API_NAMES)})")
                if not ((is_int(nth) and nth > 0) or (isinstance(nth, list) and all(is_int(n) and n > 0 for n in nth))):
                    raise ValueError(f"{FAULTS_FILE}: 'fail'[{name!r}] must be a positive integer or a list of them")
        elif key == "stall_ms":
            if not isinstance(value, dict) or not all(
                    name in TRANSFER_CALLS and is_int(ms) and ms > 0 for name, ms in value.items()):
                raise ValueError(f"{FAULTS_FILE}: 'stall_ms' must map transfer calls {TRANSFER_CALLS} to positive ms")
        elif key in _CLUSTER_LISTS:
            if value is not True and not (isinstance(value, list) and all(is_int(c) and c >= 0 for c in value)):
                raise ValueError(f"{FAULTS_FILE}: {key!r} must be true or a list of cluster ids")
        elif key == "mem_status":
            if value not in MEM_STATUSES:
                raise ValueError(f"{FAULTS_FILE}: 'mem_status' must be one of {MEM_STATUSES}")
        else:
            raise ValueError(f"{FAULTS_FILE}: unknown knob {key!r}")
    return knobs


def knobs() -> dict[str, Any]:
    """The knobs now in force."""
    path = _root() / FAULTS_FILE
    for attempt in range(20):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return {}
        if not text.strip():
            return {}
        try:
            return _check(json.loads(text))
        except json.JSONDecodeError:
            if attempt == 19:
                raise ValueError(f"{path} is not valid JSON") from None
            time.sleep(0.005)
    return {}


@contextmanager
def counted(name: str) -> Iterator[None]:
    """Count a call of ``name``, then raise the ``"fail"`` knob's fault if this call is picked."""
    nth = count(name)
    spec = knobs().get("fail", {}).get(name)
    if spec is not None and (nth == spec if is_int(spec) else nth in spec):
        raise LLMException(f"[{name}] injected fault on call {nth}", LLMStatusCode.LLM_INJECTED_FAULT)
    yield
