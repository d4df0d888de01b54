"""Fault knobs of the pyACL stand-in (tests only): ``$ACL_STANDIN_DIR/faults.json``.

Re-read at every call (missing or empty = no knobs), so a test steers processes it did not start.
Keys, every one optional:

* ``"batch_not_supported": true``: ``acl.rt.memcpy_batch_async`` returns
  ``(SIZE_MAX, ACL_ERROR_RT_FEATURE_NOT_SUPPORT)`` as a runtime without aclrtMemcpyBatchAsync does;
* ``"fail": {"memcpy": 3, "synchronize_stream": [1, 2]}``: those calls (1-based, counted per process
  as ``acl.standin_calls()`` counts them, so from the last ``standin_reset_calls()``) return
  ``fail_code`` and do nothing (a failed ``synchronize_stream`` drops the stream's queued copies);
* ``"fail_code": 507899``: the code ``"fail"`` returns (default ``ACL_ERROR_RT_INTERNAL_ERROR``);
* ``"batch_limit": N``: a batched copy of more than N copies is refused with ``ACL_ERROR_INVALID_PARAM``;
* ``"poison": false``: fresh device memory is left as the backing file has it (default: filled with 0xA5);
* ``"export_whole_allocation": true``: ``ipc_mem_get_export_key`` accepts only a whole allocation.

An unknown key, an unknown call name or a value of the wrong type raises ``ValueError`` (a broken
test set-up must not look like an aclError).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ._errors import ACL_ERROR_RT_INTERNAL_ERROR

FAULTS_FILE = "faults.json"
API_NAMES = (
    "init", "finalize",
    "set_device", "reset_device", "get_device", "get_device_count", "device_get_bare_tgid",
    "malloc", "free", "malloc_host", "free_host",
    "memcpy", "memcpy_async", "memcpy_batch_async",
    "create_stream", "destroy_stream", "synchronize_stream", "synchronize_device",
    "ipc_mem_get_export_key", "ipc_mem_set_import_pid", "ipc_mem_import_by_key", "ipc_mem_close",
)
_BOOLS = ("batch_not_supported", "poison", "export_whole_allocation")
_INTS = ("fail_code", "batch_limit")
_PARSE_RETRIES = 20  # a test rewriting the file may be caught half-way


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(knobs: Any) -> dict[str, Any]:
    if not isinstance(knobs, dict):
        raise ValueError(f"{FAULTS_FILE} must hold a JSON object, not {type(knobs).__name__}")
    for key, value in knobs.items():
        if key in _BOOLS:
            if not isinstance(value, bool):
                raise ValueError(f"{FAULTS_FILE}: {key!r} must be true or false")
        elif key in _INTS:
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{FAULTS_FILE}: {key!r} must be a positive integer")
        elif key == "fail":
            if not isinstance(value, dict):
                raise ValueError(f"{FAULTS_FILE}: 'fail' must map call names to N or [N, ...]")
            for name, nth in value.items():
                if name not in API_NAMES:
                    raise ValueError(f"{FAULTS_FILE}: unknown call {name!r} in 'fail' (known: {', '.join(API_NAMES)})")
                ok = (_is_int(nth) and nth > 0) or (isinstance(nth, list) and all(_is_int(n) and n > 0 for n in nth))
                if not ok:
                    raise ValueError(f"{FAULTS_FILE}: 'fail'[{name!r}] must be a positive integer or a list of them")
        else:
            raise ValueError(f"{FAULTS_FILE}: unknown knob {key!r}")
    return knobs


def load(root: Path) -> dict[str, Any]:
    """The knobs now in force."""
    path = root / FAULTS_FILE
    for attempt in range(_PARSE_RETRIES):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return {}
        if not text.strip():
            return {}
        try:
            return _check(json.loads(text))
        except json.JSONDecodeError:
            if attempt == _PARSE_RETRIES - 1:
                raise ValueError(f"{path} is not valid JSON") from None
            time.sleep(0.005)
    return {}


def injected(knobs: dict[str, Any], name: str, nth: int) -> int:
    """The code the ``nth`` call of ``name`` must fail with, or 0."""
    spec = knobs.get("fail", {}).get(name)
    if spec is None:
        return 0
    hit = nth == spec if isinstance(spec, int) else nth in spec
    return int(knobs.get("fail_code", ACL_ERROR_RT_INTERNAL_ERROR)) if hit else 0
