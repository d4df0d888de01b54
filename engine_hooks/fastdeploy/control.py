"""FastDeploy's control requests through the ``EngineCacheQueue`` façade: ``put_transfer_task((CacheStatus.CTRL,
ControlRequest))`` for ``pause``, ``resume``, ``update_weights``, ``sleep`` and ``wakeup``, answered by a
``ControlResponse`` that ``get_control_response(request_id, timeout)`` returns (docs/fastdeploy.md,
"Control tasks").

* A request is FastDeploy's ``ControlRequest`` (any object with ``request_id``, ``method`` and ``args``)
  or a plain dict with those keys.  Without a usable ``request_id`` nothing can be answered:
  ``ValueError``.  An unknown method or malformed ``args`` is answered at once with ``error_code`` 400,
  naming it; nothing is sent.
* Only ``tags`` of ``args`` travels to the ranks (sleep/wakeup: FastDeploy's comma-separated string
  or a list; ``weight,kv_cache`` when absent), as a list of strings: the wire carries plain data only.
* The response is FastDeploy's shape: ``request_id``, ``error_code`` (200, else 400 or 500),
  ``error_message`` naming each failing, silent or dead rank, ``result`` (each rank's answer, by rank).
"""
from __future__ import annotations

import collections
import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from cache_manager.cache_data import CONTROL_COMMAND_PREFIX, CONTROL_METHODS, CacheStatus

from ..core.errors import RankDiedError, TaskFailedError, TaskTimeoutError

OK, BAD_REQUEST, FAILED = 200, 400, 500
MAX_KEPT = 1000  # answered responses nobody has read yet, newest kept
MAX_TAGS, MAX_TAG_CHARS = 16, 64
MAX_REQUEST_ID_CHARS = 200  # the ranks' barrier is named after it (and a suffix), and a name holds 256 characters


@dataclass
class ControlResponse:
    """FastDeploy's ``ControlResponse``: its field names, so an engine reads it unchanged."""

    request_id: str
    error_code: int = OK
    error_message: str | None = None
    result: Any = None

    @property
    def ok(self) -> bool:
        return self.error_code == OK

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ControlCall:
    """A checked control request: what goes to the ranks, and whom to answer."""

    request_id: str
    method: str
    args: dict  # plain data for the wire

    def wire_task(self) -> dict:
        return {"event_type": int(CacheStatus.CTRL), "task_id": self.request_id,
                "command": CONTROL_COMMAND_PREFIX + self.method, "args": dict(self.args)}


class ControlRefused(ValueError):
    """A control request with a request id that cannot run (unknown method, bad args): it is answered
    at once with ``response``, and nothing is sent."""

    def __init__(self, response: ControlResponse):
        super().__init__(response.error_message)
        self.response = response


def is_control_item(item: Any) -> bool:
    """Whether ``item`` is ``(CacheStatus.CTRL, request)``, with FastDeploy's enum member or an int."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return False
    event = item[0].value if isinstance(item[0], enum.Enum) else item[0]
    return type(event) is int and event == CacheStatus.CTRL


def parse_control_request(request: Any) -> ControlCall:
    """``request`` (an object or a dict with ``request_id``, ``method``, ``args``) as a ``ControlCall``;
    ``ValueError`` without a usable request id, ``ControlRefused`` (answered) for the rest."""
    get = request.get if isinstance(request, dict) else lambda name, default=None: getattr(request, name, default)
    request_id = get("request_id")
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or request_id == "" \
            or len(str(request_id)) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"control request {type(request).__name__}: request_id {request_id!r:.80} must be a "
                         f"non-empty string of at most {MAX_REQUEST_ID_CHARS} characters (or an integer)")
    rid = str(request_id)
    method, args = get("method"), get("args")
    if not isinstance(method, str) or method not in CONTROL_METHODS:
        raise ControlRefused(ControlResponse(rid, BAD_REQUEST, f"unknown control method {method!r:.80}: the cache "
                                             f"transfer managers serve {', '.join(CONTROL_METHODS)}"))
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise ControlRefused(ControlResponse(rid, BAD_REQUEST, f"{method}: args must be a dict, got "
                                             f"{type(args).__name__}"))
    wire_args = {}
    if method in ("sleep", "wakeup") and args.get("tags") is not None:
        wire_args["tags"] = _tags(rid, method, args["tags"])
    return ControlCall(rid, method, wire_args)


def _tags(rid: str, method: str, tags: Any) -> list[str]:
    if isinstance(tags, str):
        tags = [t.strip() for t in tags.split(",") if t.strip()]
    if not isinstance(tags, (list, tuple)) or len(tags) > MAX_TAGS \
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_TAG_CHARS for t in tags):
        raise ControlRefused(ControlResponse(rid, BAD_REQUEST, f"{method}: tags {tags!r:.80} must be a comma-separated "
                                             f"string or a list of at most {MAX_TAGS} names"))
    return list(tags)


def response_from(call: ControlCall, future: Future) -> ControlResponse:
    """The engine's answer to ``call`` once its task resolved: each rank's answer, or why not."""
    error = future.exception()
    if error is None:
        return ControlResponse(call.request_id, OK, None, list(future.result()))
    if isinstance(error, TaskFailedError):
        detail = "; ".join(f"rank {r}: {why}" for r, why in error.failures.items())
        message = f"{call.method} failed on {detail}"
    elif isinstance(error, (TaskTimeoutError, RankDiedError)):  # their message names the silent or dead rank
        message = f"{call.method}: {error}"
    else:
        message = f"{call.method}: {type(error).__name__}: {error}"
    return ControlResponse(call.request_id, FAILED, message, None)


def rank_response(response: ControlResponse, rank: int, ranks: int) -> ControlResponse:
    """Rank ``rank``'s part of ``response``, as FastDeploy reads one per rank: its own answer, or the
    error (which names every failing, silent or dead rank)."""
    result = response.result
    if response.ok and isinstance(result, list) and len(result) == ranks:
        result = result[rank]
    return ControlResponse(response.request_id, response.error_code, response.error_message, result)


class ControlResponses:
    """Responses waiting to be read, by request id, and who waits for them: one response for all ranks
    (``wait``) and, for FastDeploy's per-rank queues (``engine_hooks.fastdeploy.fmq``), each rank's part
    in answer order (``next_for_rank``).  Each kind keeps at most ``MAX_KEPT`` unread."""

    def __init__(self, ranks: int = 1) -> None:
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._answered: collections.OrderedDict[str, ControlResponse] = collections.OrderedDict()
        self._ranks = ranks
        self._by_rank = [collections.deque(maxlen=MAX_KEPT) for _ in range(ranks)]

    def expect(self, request_id: str) -> None:
        """A request was sent; ``ValueError`` if one under the same id is still in flight.  An unread
        response under the same id is stale now (FastDeploy reuses ``pause_transfer``, and reads its
        per-rank queues instead): it is dropped, with its per-rank parts still unread."""
        with self._cond:
            if request_id in self._pending:
                raise ValueError(f"control request_id {request_id!r:.80} is already in flight: use a new id")
            self._answered.pop(request_id, None)
            for box in self._by_rank:
                stale = [r for r in box if r.request_id == request_id]
                for r in stale:
                    box.remove(r)
            self._pending.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request was never sent (submission raised)."""
        with self._cond:
            self._pending.discard(request_id)

    def answer(self, response: ControlResponse) -> None:
        with self._cond:
            self._pending.discard(response.request_id)
            self._answered[response.request_id] = response
            while len(self._answered) > MAX_KEPT:
                self._answered.popitem(last=False)
            for rank, box in enumerate(self._by_rank):
                box.append(rank_response(response, rank, self._ranks))
            self._cond.notify_all()

    def next_for_rank(self, rank: int) -> ControlResponse | None:
        """The oldest unread response of rank ``rank`` (its part of a request's answer), or None."""
        with self._cond:
            box = self._by_rank[rank % self._ranks]
            return box.popleft() if box else None

    def wait(self, request_id: Any, timeout: float) -> ControlResponse:
        """The response to ``request_id`` (read once); ``TimeoutError`` if none within ``timeout`` seconds,
        ``KeyError`` for an id never put (or already read)."""
        rid = str(request_id)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while rid not in self._answered:
                if rid not in self._pending:
                    raise KeyError(f"no control request {rid!r:.80} is in flight or answered")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"control request {rid!r:.80} not answered within {timeout:g}s")
                self._cond.wait(left)
            return self._answered.pop(rid)
