"""OpenTelemetry spans of recorded tasks (DESIGN §4.2), where the ``opentelemetry`` API is installed.

One span per task of a request (``transfer_records``), named ``ctm.<kind>``, from the global tracer
provider: it starts when the task is queued (in the submitting thread, so the engine's current span
is its parent) and ends when it is released (or done, if its record goes first).  Attributes: the
request's tag (a hash: ``ctm.request``, never the raw id), ``ctm.task_id``, ``ctm.kind``,
``ctm.ranks``, ``ctm.blocks``, ``ctm.bytes``, ``ctm.outcome``, ``ctm.failing_ranks``; an event per stage
(``queued``, ``started``, ``done``, ``released``); status ERROR when the task did not succeed.

Without the package nothing happens; an exporter that raises is logged and never disturbs a task.
Until the application installs a tracer provider (or where its sampler drops one), no span is kept.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TRACER_NAME = "cache_transfer_manager"

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace import Status, StatusCode
except ImportError:  # not installed: no spans
    _trace = None
_tracer = None  # the API's proxy tracer: it follows a provider installed after it was made


def available() -> bool:
    return _trace is not None


def start(kind: str, tag: str, task_id: str, ranks: list[int], blocks: int, start_ns: int) -> Any:
    """A started span for a task, or None (no OpenTelemetry, or it failed)."""
    if _trace is None:
        return None
    global _tracer
    try:
        if isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider):
            return None  # no provider installed (yet): the API would make a no-op span
        if _tracer is None:
            _tracer = _trace.get_tracer(TRACER_NAME)
        span = _tracer.start_span(
            f"ctm.{kind}", start_time=start_ns,
            attributes={"ctm.request": tag, "ctm.task_id": task_id, "ctm.kind": kind, "ctm.ranks": list(ranks),
                        "ctm.blocks": blocks})
        return span if span.is_recording() else None  # no provider installed (or sampled out): nothing to end
    except Exception:
        logger.exception("starting a span for task %s failed", task_id)
        return None


def finish(span: Any, record: Any, tag: str) -> None:
    """End ``span`` with what ``record`` (a ``TransferRecord``) says."""
    if span is None:
        return
    try:
        span.set_attribute("ctm.bytes", record.bytes)
        span.set_attribute("ctm.outcome", record.outcome or "unknown")
        if record.failing_ranks:
            span.set_attribute("ctm.failing_ranks", sorted(record.failing_ranks))
        for stage in ("queued", "started", "done", "released"):
            at = getattr(record, stage)
            if at is not None:
                span.add_event(stage, timestamp=int(at * 1e9))
        if record.outcome not in ("ok", None):
            span.set_status(Status(StatusCode.ERROR, f"req={tag} {record.kind} {record.outcome}"))
        end = record.end if record.end is not None else record.queued
        span.end(end_time=int(end * 1e9))
    except Exception:
        logger.exception("ending the span of task %s failed", record.task_id)
