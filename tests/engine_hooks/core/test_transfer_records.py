"""Per-request transfer records (DESIGN §4.2, issue 36 item 2): every task a request id carries is
recorded with its kind, ranks, the bytes each rank reports, its stage times and its outcome; as
OpenTelemetry spans too; logs name the request only by its hash."""
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from cache_manager.cache_data import CacheStatus
from engine_hooks.core.errors import RankDiedError, TaskFailedError, TaskTimeoutError
from engine_hooks.core.task_future import TaskFuture
from engine_hooks.core.transfer_records import MAX_REQUEST_ID_CHARS, TransferRecords, request_tag
from engine_hooks.prefix_cache import TieredPrefixCache
from tests.prefix_cache_helpers import stopped
from tests.service_helpers import start_service, views
from transfer_factory.keys import chain_hash_ids

REQ = "tenant-7/conversation-42/turn-3"  # what must never reach a log


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    service = start_service(storage_backend="file", log_dir=str(root / "logs"),
                            storage_options={"root": str(root / "store"), "fsync": False})
    yield service
    service.shutdown()


@pytest.fixture(scope="module")
def spans():
    """Spans of the global tracer provider (an SDK provider, set once per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def block_bytes_of_rank(svc, rank: int) -> int:
    """Bytes one block holds on one rank, every cache and layer: what moving it reports there."""
    return sum(v.shape[1] for (r, _, _), v in views(svc).items() if r == rank)


def settled(svc, request_id: str, tasks: int) -> list:
    records = svc.transfers(request_id)
    assert len(records) == tasks
    assert all(r.outcome is not None for r in records), records  # recorded before the future woke us
    return records


def test_a_requests_swaps_and_storage_tasks_are_recorded_with_what_the_ranks_moved(svc):
    futures = [svc.swap_to_cpu([1, 2, 3], [0, 1, 2], request_id=REQ)]
    futures[-1].result(timeout=20)
    futures.append(svc.swap_to_gpu([4, 5, 6], [0, 1, 2], request_id=REQ))
    futures[-1].result(timeout=20)
    futures.append(svc.write_storage(["rec-a", "rec-b", "rec-c"], [4, 5, 6], request_id=REQ))
    assert futures[-1].result(timeout=20) == [4, 5, 6]
    futures.append(svc.read_storage(["rec-a", "rec-b", "rec-c"], [7, 8, 9], request_id=REQ))
    assert futures[-1].result(timeout=20) == [7, 8, 9]
    svc.swap_to_cpu([1], [3]).result(timeout=20)  # no request id: not recorded
    for f in futures:
        f.released.result(timeout=5)

    records = settled(svc, REQ, 4)
    assert [r.kind for r in records] == ["swap_out", "swap_in", "storage_write", "storage_read"]
    assert [r.task_id for r in records] == [f.rank_results[0].task_id for f in futures]
    per_rank = {rank: 3 * block_bytes_of_rank(svc, rank) for rank in range(svc.tp)}
    for record, future in zip(records, futures):
        assert record.request_id == REQ and record.ranks == [0, 1] and record.blocks == 3
        assert record.outcome == "ok" and record.failing_ranks == {} and record.error is None
        assert record.bytes_per_rank == {r: res.bytes_moved for r, res in future.rank_results.items()} == per_rank
        assert record.bytes == sum(per_rank.values())
        assert record.queued <= record.started <= record.done <= record.released
        assert record.to_dict()["bytes"] == record.bytes
    assert all(a.queued <= b.queued for a, b in zip(records, records[1:]))
    assert REQ in svc.tracker.records.request_ids()
    assert len(svc.tracker.records.request_ids()) == len(set(svc.tracker.records.request_ids()))
    slowest = svc.slowest_requests(10)
    assert REQ in [s.request_id for s in slowest]


def test_a_task_failing_on_its_ranks_records_the_outcome_and_each_failing_rank(svc):
    with pytest.raises(TaskFailedError):
        svc.swap_to_cpu([2, 99], [0, 1], request_id="bad-block").result(timeout=20)
    (record,) = settled(svc, "bad-block", 1)
    assert record.outcome == "failed" and record.kind == "swap_out"
    assert sorted(record.failing_ranks) == [0, 1]
    assert all("device block id 99" in why for why in record.failing_ranks.values())
    assert record.queued <= record.started <= record.done


def test_a_task_a_stalled_rank_does_not_answer_records_a_timeout_naming_it(svc):
    with stopped(svc, 1):
        future = svc.swap_to_cpu([3], [4], timeout=1.5, request_id="stalled")  # rank 0 answers well before
        with pytest.raises(TaskTimeoutError):
            future.result(timeout=10)
        (record,) = settled(svc, "stalled", 1)
        assert record.outcome == "timeout" and list(record.failing_ranks) == [1]
        assert record.released is None  # rank 1 may still copy
        assert record.bytes_per_rank.keys() == {0}  # rank 0 answered
    future.released.result(timeout=10)
    assert svc.transfers("stalled")[0].released >= record.done


def test_request_ids_are_checked_before_anything_is_sent(svc):
    before = svc.tracker.records.request_ids()
    for bad, what in ((7, "be a str"), ("", "have 1 to"), ("x" * (MAX_REQUEST_ID_CHARS + 1), "have 1 to")):
        with pytest.raises(ValueError, match=f"request_id must {what}"):
            svc.swap_to_cpu([1], [0], request_id=bad)
        with pytest.raises(ValueError, match=f"request_id must {what}"):
            svc.read_storage(["k"], [1], request_id=bad, layerwise=True)
    assert svc.tracker.records.request_ids() == before and svc.tracker.in_flight() == 0


def test_each_recorded_task_is_an_opentelemetry_span_with_the_hashed_request(svc, spans):
    spans.clear()
    svc.swap_to_cpu([1, 2], [5, 6], request_id="otel-req").result(timeout=20)
    with pytest.raises(TaskFailedError):
        svc.swap_to_gpu([1], [99], request_id="otel-req").result(timeout=20)
    svc.swap_to_cpu([1], [5]).result(timeout=20)  # unrecorded: no span
    records = settled(svc, "otel-req", 2)
    got = {s.attributes["ctm.task_id"]: s for s in spans.get_finished_spans()}
    assert sorted(got) == sorted(r.task_id for r in records)
    for record in records:
        span = got[record.task_id]
        assert span.name == f"ctm.{record.kind}"
        assert span.attributes["ctm.request"] == request_tag("otel-req")
        assert "otel-req" not in str(dict(span.attributes))
        assert span.attributes["ctm.bytes"] == record.bytes and span.attributes["ctm.outcome"] == record.outcome
        assert list(span.attributes["ctm.ranks"]) == [0, 1]
        assert [e.name for e in span.events] == ["queued", "started", "done", "released"]
        assert span.start_time == int(record.queued * 1e9) and span.end_time == int(record.released * 1e9)
    ok, failed = got[records[0].task_id], got[records[1].task_id]
    assert ok.status.status_code != StatusCode.ERROR and ok.attributes["ctm.bytes"] > 0
    assert failed.status.status_code == StatusCode.ERROR
    assert list(failed.attributes["ctm.failing_ranks"]) == [0, 1]


def test_logs_carry_the_request_hashed_never_raw_nor_its_keys(svc, caplog):
    caplog.set_level(logging.DEBUG)
    svc.write_storage(["secret-key-1"], [3], request_id=REQ).result(timeout=20)
    with pytest.raises(TaskFailedError):
        svc.swap_to_gpu([99], [0], request_id=REQ).result(timeout=20)
    settled(svc, REQ, len(svc.transfers(REQ)))
    lines = [r.getMessage() for r in caplog.records if "req=" in r.getMessage()]
    assert len(lines) >= 2
    assert all(f"req={request_tag(REQ)}" in line and "secret-key-1" not in line for line in lines)
    assert REQ not in caplog.text
    for name in os.listdir(svc.log_dir):  # nor does it reach the ranks
        with open(os.path.join(svc.log_dir, name), errors="replace") as f:
            assert REQ not in f.read()


def test_a_rank_killed_mid_task_records_rank_died_naming_it(tmp_path):
    svc = start_service(log_dir=str(tmp_path))
    try:
        task = {"event_type": int(CacheStatus.CTRL), "command": "sleep", "args": {"seconds": 30}}
        held = svc.submit(task, timeout=60, request_id="killed")
        time.sleep(0.2)
        os.kill(svc.pids()[1], signal.SIGKILL)
        with pytest.raises(RankDiedError):
            held.result(timeout=10)
        (record,) = settled(svc, "killed", 1)
        assert record.kind == "control" and record.outcome == "rank_died"
        assert list(record.failing_ranks) == [1] and "signal 9" in record.failing_ranks[1]
    finally:
        svc.shutdown()
    assert svc.transfers("killed")[0].outcome == "rank_died"


def test_a_leases_request_id_goes_with_every_task_the_prefix_cache_makes_for_it(svc):
    cache = TieredPrefixCache(svc, num_device_blocks=4, num_host_blocks=8, write_policy="write_through",
                              task_timeout=20.0)

    def serve(hashes, request_id):
        lease = cache.acquire(hashes, request_id=request_id)
        cache.commit(lease)
        cache.release(lease)
        assert cache.drain(20.0)
        return lease

    a, b = chain_hash_ids(["lease-a0", "lease-a1"]), chain_hash_ids([f"lease-b{i}" for i in range(4)])
    serve(a, "lease-a")  # computed, written through at its release
    serve(b, "lease-b")  # evicts a to host to make room, and is written through
    assert serve(a, "lease-c").sources == ["host", "host"]  # evicts half of b, swaps a in

    def kinds(request_id):
        return [r.kind for r in settled(svc, request_id, len(svc.transfers(request_id)))]

    assert kinds("lease-a") == ["storage_read", "storage_write"]  # a miss is looked for in storage first
    assert kinds("lease-b") == ["swap_out", "storage_read", "storage_write"]
    assert kinds("lease-c") == ["swap_out", "swap_in"]
    records = [r for rid in ("lease-a", "lease-b", "lease-c") for r in svc.transfers(rid)]
    assert all(r.outcome == "ok" for r in records)
    assert all((r.bytes == 0) == (r.kind == "storage_read") for r in records)  # the reads found nothing


# ---------------------------------------------------------------------------- the store alone
def _record(records: TransferRecords, request_id: str, task_id: str) -> TaskFuture:
    future = TaskFuture()
    records.watch(records.open(request_id, {"event_type": 1, "task_id": task_id, "gpu_block_ids": [1]}, [0]), future)
    return future


def test_the_records_keep_the_last_requests_and_tasks_dropping_the_oldest_first():
    records = TransferRecords(capacity=3, tasks_per_request=2)
    for i in range(5):
        _record(records, f"r{i}", f"t{i}").set_result(None)
    assert records.request_ids() == ["r2", "r3", "r4"] and records.dropped_requests == 2
    assert records.transfers("r0") == []
    _record(records, "r2", "t5")  # a new task: r2 is the latest request now
    _record(records, "r5", "t6")
    assert records.request_ids() == ["r4", "r2", "r5"]
    _record(records, "r2", "t7")
    assert [r.task_id for r in records.transfers("r2")] == ["t5", "t7"]  # at most 2 per request
    assert [r.outcome for r in records.transfers("r2")] == [None, None]  # in flight
    assert [s.request_id for s in records.slowest_requests(5)] == ["r4"]  # in-flight requests left out
    off = TransferRecords(capacity=0)
    assert off.open("r", {"event_type": 1}, [0]) is None and off.request_ids() == []


def test_without_opentelemetry_records_work_and_nothing_is_traced():
    code = """
import sys
sys.modules["opentelemetry"] = None  # not importable
from engine_hooks.core import transfer_spans
from engine_hooks.core.task_future import TaskFuture
from engine_hooks.core.transfer_records import TransferRecords
assert not transfer_spans.available()
records = TransferRecords()
future = TaskFuture()
live = records.open("r", {"event_type": 2, "task_id": "t0"}, [0, 1])
records.watch(live, future)
future.let_go()
future.set_result(None)
(record,) = records.transfers("r")
assert record.outcome == "ok" and record.kind == "swap_in" and record.released is not None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
