"""CacheMetrics: counters, histogram, gauges, the /metrics endpoint, and a real TaskTracker feeding it."""
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import RankResult
from engine_hooks.core.errors import TaskFailedError, TaskTimeoutError
from engine_hooks.core.metrics import CacheMetrics, tiers_from_sources
from engine_hooks.core.task_tracker import TaskTracker


def result(task_id="t", rank=0, ok=True, bytes_moved=0, calls=None, failures=None):
    res = RankResult(task_id, rank, ok, value=[] if ok else None, error=None if ok else "boom", bytes_moved=bytes_moved)
    if calls is not None:
        setattr(res, "storage_calls", calls)
    if failures is not None:
        setattr(res, "storage_failures", failures)
    return res


def task(event, task_id="t"):
    return {"event_type": int(event), "task_id": task_id}


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def metrics():
    m = CacheMetrics()
    yield m
    m.close()


def test_observe_counts_outcomes_bytes_and_latency(metrics):
    metrics.observe(task(CacheStatus.SWAP2CPU), "ok", 0.002, {0: result(bytes_moved=100), 1: result(rank=1, bytes_moved=100)})
    metrics.observe(task(CacheStatus.SWAP2GPU), "failed", 0.5, {0: result(bytes_moved=64), 1: result(rank=1, ok=False)})
    metrics.observe(task(CacheStatus.SWAP2GPU), "timed_out", 3.0, {0: result(bytes_moved=32)})
    metrics.observe(task(CacheStatus.CTRL), "ok", 0.0003, {0: result(), 1: result(rank=1)})
    metrics.observe(task(CacheStatus.SWAP2CPU), "rank_died", 0.0, {})
    metrics.observe(task(CacheStatus.SWAP2CPU), "closed", 1.0, {0: result(bytes_moved=7)})
    snap = metrics.snapshot()
    assert snap["tasks_total"]["swap_to_cpu"] == {"ok": 1, "failed": 0, "timed_out": 0, "rank_died": 1, "closed": 1}
    assert snap["tasks_total"]["swap_to_gpu"]["failed"] == 1 and snap["tasks_total"]["swap_to_gpu"]["timed_out"] == 1
    assert snap["tasks_total"]["control"]["ok"] == 1
    assert snap["tasks_total"]["read_storage"] == dict.fromkeys(("ok", "failed", "timed_out", "rank_died", "closed"), 0)
    # bytes that moved, moved: failed, timed-out and closed tasks' partial moves count
    assert snap["bytes_moved_total"] == {"device_to_host": 207, "host_to_device": 96, "to_storage": 0,
                                         "from_storage": 0}
    # rank_died and closed tasks are not timed
    assert snap["latency_count"] == {"swap_to_cpu": 1, "swap_to_gpu": 2, "read_storage": 0, "write_storage": 0,
                                     "control": 1}
    assert snap["latency_sum"]["swap_to_gpu"] == pytest.approx(3.5)
    assert metrics.registry.get_sample_value("ctm_task_latency_seconds_bucket",
                                             {"kind": "control", "le": "0.0005"}) == 1
    assert metrics.registry.get_sample_value("ctm_task_latency_seconds_bucket",
                                             {"kind": "swap_to_gpu", "le": "1.0"}) == 1
    assert metrics.registry.get_sample_value("ctm_task_latency_seconds_bucket",
                                             {"kind": "swap_to_gpu", "le": "+Inf"}) == 2


def test_finished_tasks_are_counted_by_every_collection_flush_and_full_queue(metrics, monkeypatch):
    """``observe`` only queues (it runs while a caller waits for the GIL); what is queued is in
    every scrape, and counted by ``flush`` and by a full queue without anyone scraping."""
    port = metrics.serve(0)
    metrics.observe(task(CacheStatus.SWAP2CPU), "ok", 0.002, {0: result(bytes_moved=10)})
    assert metrics.tasks.labels("swap_to_cpu", "ok")._value.get() == 0, "counted on the queue thread"
    assert scrape(port)[("ctm_tasks_total", (("kind", "swap_to_cpu"), ("outcome", "ok")))] == 1
    metrics.observe(task(CacheStatus.SWAP2GPU), "ok", 0.002, {0: result(bytes_moved=20)})
    metrics.flush()
    assert metrics.bytes_moved.labels("host_to_device")._value.get() == 20
    monkeypatch.setattr("engine_hooks.core.metrics.MAX_UNCOUNTED", 3)
    for _ in range(3):
        metrics.observe(task(CacheStatus.CTRL), "ok", 0.001, {})
    assert metrics.tasks.labels("control", "ok")._value.get() == 3
    assert metrics.snapshot()["tasks_total"]["control"]["ok"] == 3


def test_storage_calls_from_rank_results(metrics):
    metrics.bind(backend="file")
    metrics.observe(task(CacheStatus.GPU2STORAGE), "ok", 0.01,
                    {0: result(bytes_moved=4096, calls=3, failures=0), 1: result(rank=1, bytes_moved=4096, calls=3)})
    metrics.observe(task(CacheStatus.STORAGE2GPU), "failed", 0.01,
                    {0: result(bytes_moved=1024, calls=2, failures=1), 1: result(rank=1, ok=False, calls=1, failures=1)})
    metrics.observe(task(CacheStatus.STORAGE2GPU), "ok", 0.01, {0: result(bytes_moved=10)})  # no such fields: 0
    metrics.observe(task(CacheStatus.SWAP2CPU), "ok", 0.01, {0: result(calls=9, failures=9)})  # not storage
    snap = metrics.snapshot()
    assert snap["storage_calls_total"] == {"file": {"read": 3, "write": 6}}
    assert snap["storage_call_failures_total"] == {"file": {"read": 2, "write": 0}}
    assert snap["bytes_moved_total"]["to_storage"] == 8192
    assert snap["bytes_moved_total"]["from_storage"] == 1034


def test_tiers_cascade_from_lease_sources(metrics):
    served, missed = tiers_from_sources(["device", "device", "host", "storage", "miss", "miss"])
    assert served == {"device": 2, "host": 1, "storage": 1}
    assert missed == {"device": 4, "host": 3, "storage": 2}  # storage missed = computed
    metrics.record_sources(["device", "device", "host", "storage", "miss", "miss"])
    metrics.record_sources(["miss", "miss"])  # e.g. a failed swap-in: the lease says miss
    metrics.record_lookup({"storage": 5}, {"device": 5, "host": 5})
    snap = metrics.snapshot()["tier_blocks_total"]
    assert snap == {"device": {"served": 2, "missed": 11}, "host": {"served": 1, "missed": 10},
                    "storage": {"served": 6, "missed": 4}}
    with pytest.raises(ValueError):
        metrics.record_sources(["elsewhere"])
    with pytest.raises(ValueError):
        metrics.record_lookup({"miss": 1}, {})


def test_gauges_read_at_scrape_time(metrics):
    state = {"in_flight": 3, "queue": 1}
    assert metrics.snapshot()["in_flight"] != metrics.snapshot()["in_flight"]  # NaN until bound
    metrics.bind(in_flight=lambda: state["in_flight"], queue_depth=lambda: state["queue"], ranks_up=lambda: 2)
    snap = metrics.snapshot()
    assert (snap["in_flight"], snap["queue_depth"], snap["ranks_up"]) == (3, 1, 2)
    state["in_flight"] = 0
    assert metrics.registry.get_sample_value("ctm_tasks_in_flight") == 0

    def broken():
        raise RuntimeError("tracker gone")
    metrics.bind(ranks_up=broken)  # a failing callable must not break the scrape
    assert metrics.registry.get_sample_value("ctm_ranks_up") != metrics.registry.get_sample_value("ctm_ranks_up")


def test_serve_scrape_close_frees_port():
    m = CacheMetrics()
    m.bind(in_flight=lambda: 4, queue_depth=lambda: 2, ranks_up=lambda: 2, backend="mooncake")
    m.observe(task(CacheStatus.SWAP2CPU), "ok", 0.001, {0: result(bytes_moved=10), 1: result(rank=1, bytes_moved=5)})
    m.observe(task(CacheStatus.GPU2STORAGE), "failed", 0.2, {0: result(ok=False, calls=2, failures=2)})
    m.record_sources(["device", "miss"])
    port = m.serve(0)
    try:
        assert port > 0
        with pytest.raises(RuntimeError):
            m.serve(0)
        samples = scrape(port)
        assert samples[("ctm_tasks_total", (("kind", "swap_to_cpu"), ("outcome", "ok")))] == 1
        assert samples[("ctm_tasks_total", (("kind", "write_storage"), ("outcome", "failed")))] == 1
        assert samples[("ctm_bytes_moved_total", (("direction", "device_to_host"),))] == 15
        assert samples[("ctm_task_latency_seconds_count", (("kind", "swap_to_cpu"),))] == 1
        assert samples[("ctm_tier_blocks_total", (("result", "served"), ("tier", "device")))] == 1
        assert samples[("ctm_tier_blocks_total", (("result", "missed"), ("tier", "storage")))] == 1
        assert samples[("ctm_storage_calls_total", (("backend", "mooncake"), ("direction", "write")))] == 2
        assert samples[("ctm_storage_call_failures_total", (("backend", "mooncake"), ("direction", "write")))] == 2
        assert samples[("ctm_tasks_in_flight", ())] == 4
        assert samples[("ctm_queue_depth", ())] == 2
        assert samples[("ctm_ranks_up", ())] == 2
    finally:
        m.close()
    m.close()  # idempotent
    with pytest.raises(OSError):
        scrape(port)
    # The port is free again: no listener holds it (SO_REUSEADDR, as every server sets it, only
    # steps over the TIME_WAIT of the scrape's connection), and a new instance can serve on it.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    again = CacheMetrics()
    try:
        assert again.serve(port) == port
        assert scrape(port)[("ctm_tasks_total", (("kind", "swap_to_cpu"), ("outcome", "ok")))] == 0
    finally:
        again.close()


def test_two_instances_do_not_collide():
    a, b = CacheMetrics(), CacheMetrics()
    try:
        a.observe(task(CacheStatus.SWAP2GPU), "ok", 0.01, {0: result(bytes_moved=1)})
        pa, pb = a.serve(0), b.serve(0)
        assert pa != pb
        key = ("ctm_tasks_total", (("kind", "swap_to_gpu"), ("outcome", "ok")))
        assert scrape(pa)[key] == 1 and scrape(pb)[key] == 0
    finally:
        a.close()
        b.close()


def test_real_tracker_outcomes_are_counted(metrics):
    tracker = TaskTracker(tp=2)
    metrics.attach(tracker, backend="file")
    assert metrics.snapshot()["ranks_up"] == 2

    t_ok, f_ok, _ = tracker.begin({"event_type": int(CacheStatus.SWAP2CPU), "swap_node_ids": [], "gpu_block_ids": [1],
                                   "cpu_block_ids": [2]}, timeout=10)
    t_bad, f_bad, _ = tracker.begin({"event_type": int(CacheStatus.STORAGE2GPU)}, timeout=10)
    t_late, f_late, _ = tracker.begin({"event_type": int(CacheStatus.GPU2STORAGE)}, timeout=10)
    snap = metrics.snapshot()
    assert (snap["in_flight"], snap["queue_depth"]) == (3, 3)

    tracker.on_result(result(t_ok["task_id"], 0, bytes_moved=1000))
    assert (tracker.in_flight(), tracker.queue_depth()) == (3, 2)
    tracker.on_result(result(t_ok["task_id"], 1, bytes_moved=1000))
    tracker.on_result(result(t_bad["task_id"], 0, bytes_moved=512, calls=1))
    tracker.on_result(result(t_bad["task_id"], 1, ok=False, calls=1, failures=1))
    tracker.on_result(result(t_late["task_id"], 0, bytes_moved=256, calls=2))
    assert (tracker.in_flight(), tracker.queue_depth()) == (1, 0)
    tracker.expire(time.monotonic() + 60)  # rank 1 never answers the write

    assert f_ok.result(0)[0] == CacheStatus.SWAP2CPU
    with pytest.raises(TaskFailedError):
        f_bad.result(0)
    with pytest.raises(TaskTimeoutError):
        f_late.result(0)
    tracker.mark_down(1, "test")
    snap = metrics.snapshot()
    assert snap["tasks_total"]["swap_to_cpu"]["ok"] == 1
    assert snap["tasks_total"]["read_storage"]["failed"] == 1
    assert snap["tasks_total"]["write_storage"]["timed_out"] == 1
    assert snap["bytes_moved_total"] == {"device_to_host": 2000, "host_to_device": 0, "to_storage": 256,
                                         "from_storage": 512}
    assert snap["storage_calls_total"]["file"] == {"read": 2, "write": 2}
    assert snap["storage_call_failures_total"]["file"] == {"read": 1, "write": 0}
    assert sum(snap["latency_count"].values()) == 3
    assert (snap["in_flight"], snap["queue_depth"], snap["ranks_up"]) == (0, 0, 1)

    _, f_dead, sent = tracker.begin({"event_type": int(CacheStatus.SWAP2GPU)}, timeout=10)  # rank 1 is down
    assert not sent and f_dead.exception(0) is not None
    tracker.mark_up(1)
    tracker.begin({"event_type": int(CacheStatus.CTRL)}, timeout=10)
    tracker.close()
    snap = metrics.snapshot()
    assert snap["tasks_total"]["swap_to_gpu"]["rank_died"] == 1
    assert snap["tasks_total"]["control"]["closed"] == 1
    assert sum(snap["latency_count"].values()) == 3  # rank_died and closed are not timed


def _swap_task():
    return {"event_type": int(CacheStatus.SWAP2CPU), "swap_node_ids": [], "gpu_block_ids": [1], "cpu_block_ids": [2]}


def _complete(tracker, task_id):
    for rank in range(tracker.tp):
        tracker.on_result(RankResult(task_id, rank, True))


def test_tracker_keeps_nothing_per_completed_task():
    """An engine runs for days: what the tracker keeps must not grow with the tasks it has seen."""
    import gc
    import tracemalloc

    tracker = TaskTracker(tp=2)
    for _ in range(200):  # warm up whatever is allocated once
        t, f, _ = tracker.begin(_swap_task(), timeout=10)
        _complete(tracker, t["task_id"])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            t, f, _ = tracker.begin(_swap_task(), timeout=10)
            _complete(tracker, t["task_id"])
            assert f.result(0)[0] == CacheStatus.SWAP2CPU
        del t, f
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10, f"the tracker grew by {grown} bytes over 20,000 tasks"
    assert tracker.latencies_ms == [] and tracker.in_flight() == 0


def test_tracker_busy_time_counts_overlaps_once_and_no_idle_gap():
    tracker = TaskTracker(tp=1, record_latencies=True)
    t0 = time.perf_counter()
    a, _, _ = tracker.begin(_swap_task(), timeout=10)
    b, _, _ = tracker.begin(_swap_task(), timeout=10)  # overlaps a
    time.sleep(0.05)
    _complete(tracker, a["task_id"])
    time.sleep(0.05)
    _complete(tracker, b["task_id"])
    idle_from = time.perf_counter()
    time.sleep(0.2)  # nothing in flight
    idle = time.perf_counter() - idle_from
    c, _, _ = tracker.begin(_swap_task(), timeout=10)
    time.sleep(0.05)
    assert tracker.busy_seconds() >= 0.15  # a task still in flight counts up to now
    tracker.fail(c["task_id"], RuntimeError("boom"))
    busy = tracker.busy_seconds()
    assert 0.15 <= busy <= time.perf_counter() - t0 - idle, busy
    assert len(tracker.latencies_ms) == 2  # recorded on request: a and b completed, c failed
    time.sleep(0.05)
    assert tracker.busy_seconds() == busy  # idle again: the clock stands still
