"""The replay's per-request transfer records (DESIGN §4.2, ``engine_hooks.core.transfer_records``).

Every replayed request carries an id (``request_id``: ``req-<trace line>``, with ``-t<tenant>`` when
``--tenants`` replays it once per tenant), passed to the prefix cache's ``acquire`` (and by ``--pd``
to the hand-off's pull or push), so every task made for it is recorded by the service that ran it.

At the end, ``slowest`` merges the records of every service of the run by request id (a P/D request's
tasks live on its prefill and its decode instance) and keeps the ``n`` requests whose tasks spanned the
longest; the JSON line's ``slowest_requests`` holds their timelines: per task its kind, the instance,
``start_ms`` (queued), ``run_ms`` (started on its first rank), ``end_ms`` (released, else done), offsets
from the request's first task, its bytes (as the ranks report them) and outcome.  ``plot_panel`` draws
them as a Gantt chart: one row per request, one bar per task (light while queued, full while running).
"""
from __future__ import annotations

from typing import Any, Sequence

SLOWEST = 5  # requests in the JSON line and the plot
KIND_COLORS = {"swap_out": "#2b8cbe", "swap_in": "#7bccc4", "storage_write": "#f0a04b", "storage_read": "#e6550d",
               "pd_pull": "#756bb1", "pd_push": "#9e9ac8", "control": "#969696"}


def request_id(line: int, tenant: Any = None) -> str:
    """The id a replayed request carries (its trace line, and its tenant's index when there are tenants)."""
    return f"req-{line}" if tenant is None else f"req-{line}-t{tenant.index}"


def _ms(t: float | None, t0: float) -> float | None:
    return None if t is None else round((t - t0) * 1e3, 3)


def timeline(request: str, tasks: list[tuple[str, Any]]) -> dict:
    """One request's timeline from its (instance, ``TransferRecord``) pairs."""
    tasks = sorted(tasks, key=lambda it: it[1].queued)
    t0 = tasks[0][1].queued
    end = max(r.end for _, r in tasks)
    return {"request_id": request, "total_ms": _ms(end, t0), "bytes": sum(r.bytes for _, r in tasks),
            "tasks": [{"kind": r.kind, "instance": instance, "start_ms": _ms(r.queued, t0),
                       "run_ms": _ms(r.started, t0), "end_ms": _ms(r.end, t0), "bytes": r.bytes,
                       "outcome": r.outcome, **({"failing_ranks": sorted(r.failing_ranks)} if r.failing_ranks else {})}
                      for instance, r in tasks]}


def slowest(services: Sequence[tuple[str, Any]], n: int = SLOWEST) -> list[dict]:
    """The ``n`` slowest requests' timelines over ``services`` ((instance name, service) pairs); a
    request with a task still in flight is left out."""
    merged: dict[str, list[tuple[str, Any]]] = {}
    for name, svc in services:
        for rid in svc.tracker.records.request_ids():
            merged.setdefault(rid, []).extend((name, r) for r in svc.transfers(rid))
    done = [timeline(rid, tasks) for rid, tasks in merged.items()
            if tasks and all(r.end is not None for _, r in tasks)]
    done.sort(key=lambda t: t["total_ms"], reverse=True)
    return done[:n]


def plot_panel(ax, requests: list[dict]) -> None:
    """A Gantt chart of ``requests`` (``slowest``'s timelines), the slowest on top."""
    seen = set()
    for row, req in enumerate(requests):
        y = len(requests) - 1 - row
        for task in req["tasks"]:
            color = KIND_COLORS.get(task["kind"], "#636363")
            run = task["run_ms"] if task["run_ms"] is not None else task["start_ms"]
            ax.broken_barh([(task["start_ms"], max(run - task["start_ms"], 0.0))], (y - 0.35, 0.7), color=color,
                           alpha=0.35)
            label = task["kind"] if task["kind"] not in seen else None
            seen.add(task["kind"])
            ax.broken_barh([(run, max(task["end_ms"] - run, 1e-3))], (y - 0.35, 0.7), color=color, label=label,
                           edgecolor="#c0392b" if task["outcome"] != "ok" else None)
    ax.set_yticks(range(len(requests)))
    ax.set_yticklabels([f"{r['request_id']} ({r['total_ms']:.1f} ms)" for r in reversed(requests)], fontsize=8)
    ax.set_xlabel("ms since the request's first task (light: queued, full: running)")
    ax.set_title(f"the {len(requests)} slowest requests' transfers", fontsize=10)
    if seen:
        ax.legend(loc="best", fontsize=7, ncol=3)
