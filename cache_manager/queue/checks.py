"""Strict checks of authenticated queue bodies, and the drop/error counters of the queue's threads.

An authenticated peer is still not trusted to send well-formed data: a bug or a version skew
must cost one dropped message, never a thread.  Every check here returns the reason a body
is refused (or raises ``Refused``) instead of letting a ``TypeError``, ``OverflowError`` or an
unhashable key surface later in the code that acts on the value.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import types
import typing
from typing import Any, Callable

from cache_manager.queue import wire
from cache_manager.cache_tasks import RankResult

MAX_INT = 1 << 62
MAX_FLOAT = 1e15
MAX_NAME_CHARS = 256
MAX_TASK_ID_CHARS = 1024
MAX_TEXT_CHARS = 1 << 20
MAX_BARRIER_TIMEOUT = 24 * 3600.0
ENVELOPE_KEYS = frozenset({"type"})


class Refused(ValueError):
    """A body that is authenticated but malformed."""


class DropLog:
    """Counts dropped frames by reason and logs them without letting a flood of garbage flood the log."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.count = 0
        self.by_reason: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # the server's I/O thread and the thread that pumps both drop

    def __call__(self, reason: str, detail: str, peer: str) -> None:
        with self._lock:
            self.count += 1
            self.by_reason[reason] += 1
            count = self.count
        if count <= 20 or count % 1000 == 0:  # the first ones, then a sample
            self.log.warning("dropped frame from %s: %s: %s (%d dropped so far)", peer, reason, detail, count)

    def reasons(self) -> dict[str, int]:
        with self._lock:
            return dict(self.by_reason)

    def continued(self, problem: str | None, env: wire.Envelope, peer: str) -> dict | None:
        """The body of a frame that continues its stream (``problem`` is None), or None: a
        replayed, reordered or foreign frame is dropped before its body is parsed."""
        if problem:
            self("replayed", problem, peer)
            return None
        return self.parsed(env, peer)

    def parsed(self, env: wire.Envelope, peer: str) -> dict | None:
        """The body of an opened frame, or None: a body that is not bounded plain data is
        dropped as malformed and counted here."""
        try:
            return wire.parse_body(env.payload)
        except wire.BadFrame as exc:
            self("malformed", str(exc), peer)
            return None


class LoopErrors:
    """Counts iterations of a long-lived loop that raised; the loop logs, counts and carries on."""

    def __init__(self, log: logging.Logger, what: str):
        self.log, self.what, self.count = log, what, 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        """Call from an ``except`` block: logs the exception being handled."""
        with self._lock:
            self.count += 1
            count = self.count
        if count <= 20 or count % 1000 == 0:
            self.log.exception("%s: one iteration failed (%d so far); carrying on", self.what, count)


# -- primitive checks ------------------------------------------------------------
def is_int(value: Any) -> bool:
    return type(value) is int and -MAX_INT <= value <= MAX_INT


def is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and -MAX_FLOAT <= value <= MAX_FLOAT


def is_text(value: Any, limit: int = MAX_TEXT_CHARS) -> bool:
    return type(value) is str and len(value) <= limit


def barrier_fields(body: dict) -> tuple[str, int, float]:
    """(name, value, timeout) of a barrier body, or ``Refused``."""
    extra = set(body) - ENVELOPE_KEYS - {"name", "value", "timeout"}
    if extra:
        raise Refused(f"barrier with unknown fields {sorted(extra)}")
    name, value, timeout = body.get("name"), body.get("value", 0), body.get("timeout")
    if not is_text(name, MAX_NAME_CHARS):
        raise Refused(f"barrier name {name!r:.80} is not a string of at most {MAX_NAME_CHARS} characters")
    if not is_int(value):
        raise Refused(f"barrier value {value!r:.80} is not an integer within +-2**62")
    if not is_number(timeout) or not 0 <= timeout <= MAX_BARRIER_TIMEOUT:
        raise Refused(f"barrier timeout {timeout!r:.80} is not a number of seconds in [0, {MAX_BARRIER_TIMEOUT:g}]")
    return name, value, float(timeout)


# -- RankResult ------------------------------------------------------------------
# Why a value is not of a scalar annotation, or None; ``_type_problem`` and the compiled per-field
# checks of results both use these.
_SCALAR_PROBLEMS: dict[Any, Callable[[Any], str | None]] = {
    Any: lambda value: None,
    object: lambda value: None,
    type(None): lambda value: None if value is None else "is not None",
    bool: lambda value: None if type(value) is bool else "is not a bool",
    int: lambda value: None if is_int(value) else "is not an integer within +-2**62",
    float: lambda value: None if is_number(value) else f"is not a finite number within +-{MAX_FLOAT:g}",
    str: lambda value: None if is_text(value) else f"is not a string of at most {MAX_TEXT_CHARS} characters",
    bytes: lambda value: None if type(value) is bytes else "is not bytes",
}


def _type_problem(value: Any, tp: Any) -> str | None:
    """Why ``value`` is not a ``tp`` (a field annotation), or None.  The wire already bounded
    the depth and refused non-plain data, so this only checks shape and ranges."""
    scalar = _SCALAR_PROBLEMS.get(tp)
    if scalar is not None:
        return scalar(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, arm) for arm in args]
        return None if None in problems else " and ".join(p for p in problems if p)
    if origin is list:
        if type(value) is not list:
            return "is not a list"
        problems = (_type_problem(v, args[0]) for v in value) if args else ()
        return next((f"has an item that {p}" for p in problems if p), None)
    if origin is dict:
        if type(value) is not dict:
            return "is not a map"
        problems = (_type_problem(v, args[1]) for v in value.values()) if args else ()
        return next((f"has a value that {p}" for p in problems if p), None)
    return f"has a field type {tp!r} the queue cannot check"


def _result_schema() -> tuple[dict[str, Any], frozenset[str]]:
    hints = typing.get_type_hints(RankResult)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(RankResult)}
    required = frozenset(f.name for f in dataclasses.fields(RankResult)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return fields, required


_RESULT_FIELDS, _RESULT_REQUIRED = _result_schema()


def _checkable(tp: Any) -> bool:
    if tp in _SCALAR_PROBLEMS:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict:  # keys are strings on the wire; only the values need a check
        return not args or _checkable(args[1])
    if origin in (typing.Union, types.UnionType, list):
        return all(map(_checkable, args))
    return False


def _compiled_check(tp: Any) -> Callable[[Any], str | None]:
    """``_type_problem`` for one annotation, with a scalar's check looked up once: every result
    of every task passes here, on the engine's queue thread."""
    return _SCALAR_PROBLEMS.get(tp) or (lambda value: _type_problem(value, tp))


_RESULT_CHECKS = {name: (_compiled_check(tp), tp is float) for name, tp in _RESULT_FIELDS.items()}
_RESULT_KEYS = frozenset(_RESULT_FIELDS)


def unsupported_result_fields() -> list[str]:
    """Fields of ``RankResult`` whose annotation ``_type_problem`` cannot check (logged by the server at start)."""
    return [name for name, tp in _RESULT_FIELDS.items() if not _checkable(tp)]


def rank_result_from_body(body: dict, rank: int, num_ranks: int) -> RankResult:
    """A ``RankResult`` built field by field from ``dataclasses.fields(RankResult)``, or ``Refused``.

    Unknown fields refuse the body rather than being ignored: nothing is silently lost.
    ``rank`` is the rank of the connection the body came on; a body that claims another is refused."""
    extra = body.keys() - ENVELOPE_KEYS - _RESULT_KEYS
    if extra:
        raise Refused(f"result with unknown fields {sorted(extra)[:8]}")
    missing = _RESULT_REQUIRED - body.keys()
    if missing:
        raise Refused(f"result without {sorted(missing)}")
    kwargs = {}
    checks = _RESULT_CHECKS
    for name, value in body.items():  # a result sends only what differs from the defaults
        if name in ENVELOPE_KEYS:
            continue
        check, is_float = checks[name]
        problem = check(value)
        if problem:
            raise Refused(f"result field {name!r} = {value!r:.80} {problem}")
        kwargs[name] = float(value) if is_float else value
    if not is_text(kwargs["task_id"], MAX_TASK_ID_CHARS):
        raise Refused(f"result task_id longer than {MAX_TASK_ID_CHARS} characters")
    if not 0 <= kwargs["rank"] < num_ranks or kwargs["rank"] != rank:
        raise Refused(f"result claims rank {kwargs['rank']} on rank {rank}'s connection")
    return RankResult(**kwargs)
