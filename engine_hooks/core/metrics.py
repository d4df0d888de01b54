"""CacheMetrics: the CTM service's counters in the Prometheus text format operators already scrape.

Every instance has its own ``CollectorRegistry`` (never the process-wide default), so two services
in one process never collide.  Metrics (all prefixed ``ctm_``):

``ctm_task_latency_seconds{kind}`` (histogram, 0.1 ms .. 30 s)
    Seconds from submission to the last rank's answer (outcomes ``ok`` and ``failed``) or to the
    expiry of the deadline (``timed_out``).  Tasks cut short by a rank death or by shutdown are not
    observed: their time says nothing about the transfer.
``ctm_tasks_total{kind, outcome}`` (counter)
    Every finished task, once.  ``kind``: swap_to_cpu, swap_to_gpu, read_storage, write_storage,
    control (``other`` for an event type outside these); ``outcome``: ok, failed, timed_out,
    rank_died, closed (the TaskTracker's outcomes).
``ctm_bytes_moved_total{direction}`` (counter)
    The sum over ranks of ``RankResult.bytes_moved`` (the ranks' own reports) of every task,
    whatever its outcome: bytes that moved, moved.  ``direction``: device_to_host (swap_to_cpu),
    host_to_device (swap_to_gpu), to_storage (write_storage), from_storage (read_storage).
``ctm_tier_blocks_total{tier, result}`` (counter)
    Prefix-cache lookups, per block, in cascade order device -> host -> storage.  For tier T:
    ``served``: blocks whose contents came from T (storage: blocks loaded from storage);
    ``missed``: blocks that T did not serve, because a later tier served them or nobody did.
    So ``served + missed`` of the device tier is every block looked up, each tier's
    ``served / (served + missed)`` is its hit ratio among the blocks that reached it, and
    ``ctm_tier_blocks_total{tier="storage", result="missed"}`` is the blocks that had to be
    computed (storage is the last tier: there is no separate ``miss`` tier).  A load that failed
    (a swap-in or storage read whose task failed) did not serve its blocks: the prefix cache
    rewrites them to ``miss`` in ``Lease.sources``, and they count as missed at every tier.
    Fed by ``record_sources(lease.sources)`` or ``record_lookup(served, missed)``.
``ctm_tasks_in_flight``, ``ctm_queue_depth``, ``ctm_ranks_up`` (gauges)
    Read at scrape time from the callables given to ``bind`` (e.g. ``tracker.in_flight``,
    ``tracker.queue_depth`` -- tasks submitted that no rank has answered yet --, ``tracker.ranks_up``);
    NaN until bound or when the callable raises.
``ctm_pd_digest_mismatches_total`` (counter)
    P/D blocks pulled whose bytes differed from the prefill's digests: failed, never counted (sum over
    ranks of ``RankResult.digest_mismatches``; ``engine_hooks.pd``, digests on).
``ctm_storage_calls_total{backend, direction}``, ``ctm_storage_call_failures_total{backend, direction}``
    (counters) The storage backend calls the ranks report for storage tasks (sum over ranks of
    ``RankResult.storage_calls`` / ``storage_failures``, 0 where a result lacks them);
    ``direction``: read, write; ``backend``: the name given to ``bind``.

Finished tasks are counted in batches: ``observe`` runs on the engine's queue thread right after
a caller's future resolved, while that caller waits for the GIL, so it only queues the task.
The queue is counted into the metrics at every collection (a scrape, ``snapshot``), at every
``flush`` (the service's supervisor calls it each heartbeat) and whenever it holds
``MAX_UNCOUNTED`` tasks.  In a loop of one-block swaps, counting at once cost 33 us of a 335 us
round trip at TP=1.

Use::

    metrics = CacheMetrics()
    metrics.attach(svc.tracker, backend=svc.storage_backend)   # observer + gauges
    port = metrics.serve(0)                                    # http://127.0.0.1:<port>/metrics
    ...
    metrics.close()
"""
from __future__ import annotations

import collections
import importlib.metadata
import logging
import math
import socket
import threading
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from cache_manager.cache_data import CacheStatus

logger = logging.getLogger(__name__)

KINDS = {
    int(CacheStatus.SWAP2CPU): "swap_to_cpu",
    int(CacheStatus.SWAP2GPU): "swap_to_gpu",
    int(CacheStatus.STORAGE2GPU): "read_storage",
    int(CacheStatus.GPU2STORAGE): "write_storage",
    int(CacheStatus.CTRL): "control",
}
OUTCOMES = ("ok", "failed", "timed_out", "rank_died", "closed")
DIRECTIONS = {"swap_to_cpu": "device_to_host", "swap_to_gpu": "host_to_device",
              "write_storage": "to_storage", "read_storage": "from_storage"}
STORAGE_DIRECTIONS = {"read_storage": "read", "write_storage": "write"}
TIERS = ("device", "host", "storage")  # cascade order
RESULTS = ("served", "missed")
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)
TIMED_OUTCOMES = ("ok", "failed", "timed_out")
MAX_UNCOUNTED = 4096  # finished tasks queued before the observer counts them itself


def kind_of(task: Mapping[str, Any]) -> str:
    return KINDS.get(task.get("event_type"), "other")  # type: ignore[arg-type]


def tiers_from_sources(sources: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(served, missed) per tier from a ``Lease.sources`` list (device/host/storage/miss per position)."""
    served = dict.fromkeys(TIERS, 0)
    missed = dict.fromkeys(TIERS, 0)
    for source in sources:
        depth = TIERS.index(source) if source in TIERS else len(TIERS)
        if source != "miss" and depth == len(TIERS):
            raise ValueError(f"unknown block source {source!r}; expected one of {TIERS + ('miss',)}")
        for tier in TIERS[:depth]:
            missed[tier] += 1
        if depth < len(TIERS):
            served[source] += 1
    return served, missed


def _prometheus_returns_server() -> bool:
    try:
        major, minor = (int(x) for x in importlib.metadata.version("prometheus_client").split(".")[:2])
    except Exception:
        return True
    return (major, minor) >= (0, 17)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _CountingRegistry(CollectorRegistry):
    """A registry that counts the queued tasks before every collection, so a scrape is exact."""

    def __init__(self, before_collect: Callable[[], None]):
        super().__init__(auto_describe=True)
        self._before_collect = before_collect

    def collect(self):  # type: ignore[override]
        self._before_collect()
        yield from super().collect()


class CacheMetrics:
    def __init__(self) -> None:
        self._uncounted: collections.deque = collections.deque()
        self._count_lock = threading.Lock()
        self.registry = _CountingRegistry(self.flush)
        r = self.registry
        self.latency = Histogram("ctm_task_latency_seconds", "Task latency, submission to the last rank's answer",
                                 ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.tasks = Counter("ctm_tasks", "Finished tasks by kind and outcome", ["kind", "outcome"], registry=r)
        self.bytes_moved = Counter("ctm_bytes_moved", "Bytes the ranks reported moving, summed over ranks",
                                   ["direction"], registry=r)
        self.tier_blocks = Counter("ctm_tier_blocks", "Prefix-cache blocks served or missed per tier "
                                   "(storage missed = computed)", ["tier", "result"], registry=r)
        self.storage_calls = Counter("ctm_storage_calls", "Storage backend calls the ranks reported",
                                     ["backend", "direction"], registry=r)
        self.storage_failures = Counter("ctm_storage_call_failures", "Storage backend calls that failed",
                                        ["backend", "direction"], registry=r)
        self.digest_mismatches = Counter("ctm_pd_digest_mismatches", "P/D blocks pulled whose bytes differed from "
                                         "the prefill's digests (failed, never counted)", registry=r)
        self._sources: dict[str, Callable[[], float] | None] = {"in_flight": None, "queue_depth": None,
                                                                "ranks_up": None}
        for name, metric, doc in (("in_flight", "ctm_tasks_in_flight", "Tasks submitted and not yet resolved"),
                                  ("queue_depth", "ctm_queue_depth", "Tasks submitted that no rank has answered yet"),
                                  ("ranks_up", "ctm_ranks_up", "Ranks that are up")):
            Gauge(metric, doc, registry=r).set_function(lambda name=name: self._read(name))
        self.backend = "none"
        self._lock = threading.Lock()
        self._children: dict[tuple, Any] = {}  # (metric, label values) -> its child, see _child
        self._server: Any = None
        self._thread: threading.Thread | None = None
        # Series that exist (at 0) before anything happens, so dashboards and rate() see them.
        for kind in KINDS.values():
            self.latency.labels(kind)
            for outcome in OUTCOMES:
                self.tasks.labels(kind, outcome)
        for direction in DIRECTIONS.values():
            self.bytes_moved.labels(direction)
        for tier in TIERS:
            for result in RESULTS:
                self.tier_blocks.labels(tier, result)

    # ------------------------------------------------------------------ feeding
    def bind(self, in_flight: Callable[[], float] | None = None, queue_depth: Callable[[], float] | None = None,
             ranks_up: Callable[[], float] | None = None, backend: str | None = None) -> None:
        """Callables the gauges read at scrape time, and the storage backend's name (a label)."""
        for name, fn in (("in_flight", in_flight), ("queue_depth", queue_depth), ("ranks_up", ranks_up)):
            if fn is not None:
                self._sources[name] = fn
        if backend is not None:
            self.backend = str(backend)
            for direction in STORAGE_DIRECTIONS.values():
                self.storage_calls.labels(self.backend, direction)
                self.storage_failures.labels(self.backend, direction)

    def attach(self, tracker: Any, backend: str | None = None) -> None:
        """Observe ``tracker``'s tasks and read its gauges (``in_flight``, ``queue_depth``, ``ranks_up``)."""
        tracker.observers.append(self.observe)
        self.bind(in_flight=tracker.in_flight, queue_depth=getattr(tracker, "queue_depth", None),
                  ranks_up=tracker.ranks_up, backend=backend)

    def _read(self, name: str) -> float:
        fn = self._sources[name]
        if fn is None:
            return math.nan
        try:
            return float(fn())
        except Exception:
            logger.exception("metrics: reading %s failed", name)
            return math.nan

    def observe(self, task: Mapping[str, Any], outcome: str, seconds: float, results: Mapping[int, Any]) -> None:
        """The TaskTracker observer: one call per finished task.  Queues it (see the module docstring)."""
        self._uncounted.append((task, outcome, seconds, results))
        if len(self._uncounted) >= MAX_UNCOUNTED:
            self.flush()

    def flush(self) -> None:
        """Count every queued task into the metrics now."""
        with self._count_lock:
            while self._uncounted:
                self._count(*self._uncounted.popleft())

    def _count(self, task: Mapping[str, Any], outcome: str, seconds: float, results: Mapping[int, Any]) -> None:
        kind = kind_of(task)
        self._child(self.tasks, kind, outcome).inc()
        if outcome in TIMED_OUTCOMES and seconds >= 0:
            self._child(self.latency, kind).observe(seconds)
        direction = DIRECTIONS.get(kind)
        if direction is not None:
            moved = sum(max(0, int(getattr(res, "bytes_moved", 0) or 0)) for res in results.values())
            if moved:
                self._child(self.bytes_moved, direction).inc(moved)
        mismatches = sum(max(0, int(getattr(res, "digest_mismatches", 0) or 0)) for res in results.values())
        if mismatches:
            self.digest_mismatches.inc(mismatches)
        storage = STORAGE_DIRECTIONS.get(kind)
        if storage is not None:
            calls = sum(max(0, int(getattr(res, "storage_calls", 0) or 0)) for res in results.values())
            failures = sum(max(0, int(getattr(res, "storage_failures", 0) or 0)) for res in results.values())
            self._child(self.storage_calls, self.backend, storage).inc(calls)
            self._child(self.storage_failures, self.backend, storage).inc(failures)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client checks and locks on every
        ``labels`` call, and every finished task takes two or three of them on the engine's queue thread."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record_lookup(self, served: Mapping[str, int], missed: Mapping[str, int]) -> None:
        """Add per-tier block counts (see the module docstring for what served and missed mean)."""
        for result, counts in (("served", served), ("missed", missed)):
            for tier, n in counts.items():
                if tier not in TIERS:
                    raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
                if n < 0:
                    raise ValueError(f"block count {n} for tier {tier!r} must not be negative")
                if n:
                    self.tier_blocks.labels(tier, result).inc(n)

    def record_sources(self, sources: Iterable[str]) -> None:
        """Count one lookup from its ``Lease.sources`` (after any failed load turned positions to ``miss``)."""
        self.record_lookup(*tiers_from_sources(sources))

    # ------------------------------------------------------------------ exposition
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: a free one); returns the port it listens on."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"already serving on port {self._server.server_address[1]}")
            returns_server = _prometheus_returns_server()
            if port == 0 and not returns_server:
                port = _free_port(host)  # an old prometheus_client cannot tell which port it took
            started = start_http_server(port, addr=host, registry=self.registry)
            if isinstance(started, tuple):
                self._server, self._thread = started
                port = int(self._server.server_address[1])
            else:
                logger.warning("prometheus_client too old to stop its server; it lives until exit")
            logger.info("metrics served on http://%s:%d/metrics", host, port)
            return port

    def close(self) -> None:
        """Stop the HTTP server and free its port; idempotent."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    # ------------------------------------------------------------------ inspection
    def snapshot(self) -> dict[str, Any]:
        """Current values: nested dicts of the counters, latency count/sum per kind, the gauges."""
        snap: dict[str, Any] = {"tasks_total": {}, "bytes_moved_total": {}, "tier_blocks_total": {},
                                "storage_calls_total": {}, "storage_call_failures_total": {},
                                "latency_count": {}, "latency_sum": {}}
        nested = {"ctm_tasks_total": ("tasks_total", "kind", "outcome"),
                  "ctm_tier_blocks_total": ("tier_blocks_total", "tier", "result"),
                  "ctm_storage_calls_total": ("storage_calls_total", "backend", "direction"),
                  "ctm_storage_call_failures_total": ("storage_call_failures_total", "backend", "direction")}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name in nested:
                    key, outer, inner = nested[s.name]
                    snap[key].setdefault(s.labels[outer], {})[s.labels[inner]] = s.value
                elif s.name == "ctm_pd_digest_mismatches_total":
                    snap["pd_digest_mismatches_total"] = s.value
                elif s.name == "ctm_bytes_moved_total":
                    snap["bytes_moved_total"][s.labels["direction"]] = s.value
                elif s.name == "ctm_task_latency_seconds_count":
                    snap["latency_count"][s.labels["kind"]] = s.value
                elif s.name == "ctm_task_latency_seconds_sum":
                    snap["latency_sum"][s.labels["kind"]] = s.value
        for name in self._sources:
            snap[name] = self._read(name)
        return snap
