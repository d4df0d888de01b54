"""Property tests of the rank's task scheduler (cache_manager/rank/scheduler.py, DESIGN §3.8).

Random sequences of tasks over a few shared resources, on real thread pools and the real clock
(the scheduler takes no clock), with short bodies, late I/Os, failing bodies and deadlines.  The
submitting thread plays the CTM's serve thread: it submits in order and calls ``expire_waiting``
between submissions and while it waits.  Checked for every run:

* tasks that share a resource start in submission order and never overlap (a late I/O counts
  as part of its task until it ends); a task also waits for what an earlier *dropped* task on its
  resources was waiting for (a dropped waiter keeps its place);
* no task starts after its deadline: the scheduler's own last clock reading before the body ran
  (observed through a recording wrapper of its ``time`` module) is not past the deadline;
* a waiter dropped at its deadline is answered at or after the deadline and soon after it;
* every task gets exactly one answer, plus one release note exactly when its answer said
  ``released=False``; an answer never leaves before its body returned;
* everything is released at the end: a later task on every resource starts.
"""
import logging
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cache_manager.cache_tasks import Outcome
from cache_manager.rank import scheduler as scheduler_mod
from cache_manager.rank.scheduler import FAIL, TaskScheduler

LOG = logging.getLogger("test_scheduler_order")
LOG.addHandler(logging.NullHandler())
LOG.propagate = False
RESOURCES = [("gpu", 0), ("gpu", 1), ("gpu", 2), ("cpu", 0), ("cpu", 1)]
MS = 1e-3
LATE_ANSWER = 0.5  # s: how long after its deadline a dropped waiter may be answered (2 shared cores)

_seen = threading.local()  # .last: the scheduler's last time.monotonic() reading on this thread


def _recording_monotonic() -> float:
    now = time.monotonic()
    _seen.last = now
    return now


@pytest.fixture(autouse=True)
def _observed_clock(monkeypatch):
    """The scheduler reads the real clock through a wrapper that remembers, per thread, the last
    value it read: the body of a task sees the value the start decision was made on."""
    fake = types.SimpleNamespace(monotonic=_recording_monotonic, perf_counter=time.perf_counter)
    monkeypatch.setattr(scheduler_mod, "time", fake)


task_plan = st.fixed_dictionaries({
    "resources": st.sets(st.sampled_from(RESOURCES), min_size=1, max_size=3),
    "pool": st.sampled_from(["swap", "storage"]),
    "duration_ms": st.sampled_from([0, 0, 1, 2, 4]),
    "late_ms": st.one_of(st.none(), st.sampled_from([1, 3, 6])),  # an I/O that outlives the answer
    "deadline_ms": st.one_of(st.none(), st.none(), st.integers(-3, 25)),  # relative to the submission
    "inline": st.booleans(),
    "raises": st.sampled_from([False, False, False, True]),
    "drop_value": st.sampled_from([FAIL, 0]),
    "gap_ms": st.sampled_from([0, 0, 0, 1, 3]),
})


class Run:
    """One run's scheduler, its pools and what it observed."""

    def __init__(self):
        self.pools = {"swap": ThreadPoolExecutor(3, thread_name_prefix="swap"),
                      "storage": ThreadPoolExecutor(2, thread_name_prefix="storage")}
        self.late_pool = ThreadPoolExecutor(4, thread_name_prefix="late")
        self.lock = threading.Lock()
        self.answers: list[tuple[float, object]] = []  # (monotonic time sent, RankResult)
        self.starts: dict[str, float] = {}  # task id -> the time its body started
        self.checked: dict[str, float | None] = {}  # task id -> the scheduler's last clock reading before it
        self.returned: dict[str, float] = {}  # task id -> the time its body returned
        self.released: dict[str, float] = {}  # task id -> the time nothing of it touched its resources
        self.sched = TaskScheduler(self.pools, rank=0, send=self.send, log=LOG)

    def send(self, result):
        with self.lock:
            self.answers.append((time.monotonic(), result))

    def body(self, tid: str, plan: dict):
        def run():
            self.checked[tid] = getattr(_seen, "last", None)
            _seen.last = None  # a later body on this thread must see a reading of its own
            self.starts[tid] = time.monotonic()
            if plan["duration_ms"]:
                time.sleep(plan["duration_ms"] * MS)
            if plan["raises"]:
                self.returned[tid] = self.released[tid] = time.monotonic()
                raise ValueError(f"task {tid} fails")
            if plan["late_ms"] is None:
                self.returned[tid] = self.released[tid] = time.monotonic()
                return tid

            def late_io():
                time.sleep(plan["late_ms"] * MS)
                self.released[tid] = time.monotonic()  # before the future completes: the scheduler's cue

            fut = self.late_pool.submit(late_io)
            self.returned[tid] = time.monotonic()
            return Outcome(value=tid, still_running=fut)
        return run

    def close(self):
        for pool in [*self.pools.values(), self.late_pool]:
            pool.shutdown(wait=True)


def wait_for(run: Run, cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the scheduler left tasks unanswered"
        run.sched.expire_waiting()
        time.sleep(0.5 * MS)


def messages_by_task(run: Run) -> dict[str, list[tuple[float, object]]]:
    by: dict[str, list] = {}
    for at, result in run.answers:
        by.setdefault(result.task_id, []).append((at, result))
    return by


def all_answered(run: Run, ids):
    by = messages_by_task(run)
    for tid in ids:
        msgs = by.get(tid, [])
        if not msgs or (not msgs[0][1].released and len(msgs) < 2):
            return False
    return True


def execute(plans):
    run = Run()
    try:
        ids, deadlines = [], {}
        for seq, plan in enumerate(plans):
            tid = f"t{seq}"
            ids.append(tid)
            if plan["gap_ms"]:
                time.sleep(plan["gap_ms"] * MS)
            deadline = None if plan["deadline_ms"] is None else time.monotonic() + plan["deadline_ms"] * MS
            deadlines[tid] = deadline
            run.sched.submit(tid, seq, plan["pool"], plan["resources"], deadline, run.body(tid, plan),
                             drop_value=plan["drop_value"], inline=plan["inline"])
            run.sched.expire_waiting()
        wait_for(run, lambda: all_answered(run, ids))
        time.sleep(10 * MS)  # a stray second answer or release note would arrive by now
        check(run, plans, ids, deadlines)

        # Everything is released: a later task on every resource starts (and nothing is held).
        probes = []
        for i, r in enumerate(RESOURCES):
            tid = f"probe{i}"
            probes.append(tid)
            run.sched.submit(tid, len(plans) + i, "swap", [r], time.monotonic() + 5.0,
                             lambda tid=tid: run.starts.__setitem__(tid, time.monotonic()))
        wait_for(run, lambda: all_answered(run, probes))
        by = messages_by_task(run)
        for tid in probes:
            assert by[tid][0][1].ok and tid in run.starts, f"{tid}: {by[tid][0][1].error}"
        assert run.sched.active() == 0 and run.sched.pending() == 0
        return run
    finally:
        run.close()


def check(run: Run, plans, ids, deadlines):
    by = messages_by_task(run)
    assert set(by) == set(ids), f"answers for unknown tasks: {set(by) - set(ids)}"
    for tid, plan in zip(ids, plans):
        msgs = by[tid]
        (at, first), rest = msgs[0], msgs[1:]
        started = tid in run.starts
        if first.released:
            assert rest == [], f"{tid}: {len(msgs)} answers, want 1"
        else:
            assert started and plan["late_ms"] is not None, f"{tid}: a release note without a late I/O"
            assert len(rest) == 1 and rest[0][1].released, f"{tid}: want one release note, got {len(rest)}"
            assert rest[0][0] >= run.released[tid], f"{tid}: release note before its I/O ended"
        if started:
            assert at >= run.returned[tid], f"{tid}: answered before its body returned"
            if plan["raises"]:
                assert not first.ok and "ValueError" in first.error
            else:
                assert first.ok and first.value == tid, first.error
            if deadlines[tid] is not None:
                seen = run.checked[tid]
                assert seen is not None and seen <= deadlines[tid], \
                    f"{tid} started {run.starts[tid] - deadlines[tid]:.4f}s after its deadline (checked at {seen})"
        else:  # dropped: answered at its deadline, never run
            assert deadlines[tid] is not None, f"{tid} has no deadline but never started"
            assert deadlines[tid] <= at <= deadlines[tid] + LATE_ANSWER, \
                f"{tid} dropped {at - deadlines[tid]:.4f}s after its deadline"
            if plan["drop_value"] is FAIL:
                assert not first.ok and "DeadlineExceeded" in first.error
            else:
                assert first.ok and first.value == 0

    # Order: Y must start after X released whenever X precedes Y through a chain of tasks, each
    # sharing a resource with the next (direct sharing, or a dropped waiter keeping its place).
    n = len(plans)
    before = [set() for _ in range(n)]  # indices that Y must wait for
    last_on: dict = {}
    for y, plan in enumerate(plans):
        for r in plan["resources"]:
            if r in last_on:
                x = last_on[r]
                before[y] |= before[x] | {x}
            last_on[r] = y
    for y in range(n):
        ty = ids[y]
        if ty not in run.starts:
            continue
        for x in before[y]:
            tx = ids[x]
            if tx in run.starts:
                assert run.starts[tx] <= run.starts[ty], f"{ty} started before earlier {tx} on a shared resource"
                assert run.released[tx] <= run.starts[ty], \
                    f"{ty} started {run.released[tx] - run.starts[ty]:.4f}s before earlier {tx} released"
    # Per resource, the start order is the submission order among the tasks that started.
    for r in RESOURCES:
        on_r = [ids[i] for i, p in enumerate(plans) if r in p["resources"] and ids[i] in run.starts]
        assert sorted(on_r, key=run.starts.__getitem__) == on_r, f"{r}: start order {on_r}"


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(task_plan, min_size=1, max_size=24))
def test_random_task_mixes_keep_order_deadlines_answers_and_releases(plans):
    execute(plans)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(task_plan.map(lambda p: {**p, "resources": {RESOURCES[0], *p["resources"]}}),
                min_size=2, max_size=30))
def test_one_hot_resource_serialises_every_task_in_submission_order(plans):
    # Every task touches gpu 0: all of them run one at a time, in order, whatever their pools.
    execute(plans)


def test_a_dropped_waiter_keeps_its_place_for_a_task_on_other_resources():
    # A on r0 runs 0.6 s; B on r0+r1 is dropped at its deadline while waiting for A; C on r1 only
    # must still wait for A (through B), though it shares no resource with A.
    plans = [
        {"resources": {RESOURCES[0]}, "pool": "swap", "duration_ms": 600, "late_ms": None, "deadline_ms": None,
         "inline": False, "raises": False, "drop_value": FAIL, "gap_ms": 0},
        {"resources": {RESOURCES[0], RESOURCES[1]}, "pool": "swap", "duration_ms": 0, "late_ms": None,
         "deadline_ms": 5, "inline": False, "raises": False, "drop_value": FAIL, "gap_ms": 0},
        {"resources": {RESOURCES[1]}, "pool": "storage", "duration_ms": 0, "late_ms": None, "deadline_ms": None,
         "inline": True, "raises": False, "drop_value": 0, "gap_ms": 20},
    ]
    run = execute(plans)
    assert "t1" not in run.starts and "t2" in run.starts
    (dropped_at, dropped), = [(at, r) for at, r in run.answers if r.task_id == "t1"]
    assert dropped_at < run.released["t0"] - 0.3, "the waiter was answered when A ended, not at its deadline"
    assert run.starts["t2"] >= run.released["t0"]
