"""A write stalled on a frozen store answers inside its budget (issue 33 item 3), for real.

The file store's root is on a loop-mounted ext4 that the test freezes (``fsfreeze -f``) under a
FastDeploy-façade engine at TP=2.  A write put then gets as far as its append, its commit begun,
and blocks there in D state until the thaw.  Its device blocks were copied into the staging buffer
before the call, so:

* its done signal(s) come within the task's timeout + the queue's ``storage_grace``, the store still
  frozen, reporting only the blocks stored so far (none of this write's);
* a SWAP2CPU then SWAP2GPU of the same device blocks, put right behind the write, run and are
  bit-exact, the store still frozen;
* after the thaw the late call lands the snapshot's bytes (not those the engine wrote into the
  blocks after the answer), a later write and read round trip is bit-exact, and the engine's close
  leaves no segment behind.

Before the change the done signal came at the thaw and the swaps waited behind the write (dropped at
their deadline).  Every wait is bounded; the store is always thawed, then unmounted.
"""
from __future__ import annotations

import os
import re
import time
from typing import Any

import numpy as np

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import ReadStorageTask
from tests.fastdeploy_engine import FastDeployEngine
from tests.fastdeploy_types import FDWriteStorageTask
from tests.frozen_fs import loop_ext4

TIMEOUT_S = 2.0      # the frozen write's budget
GRACE_S = 0.5        # the queue's storage_grace
SLACK_S = 1.0        # process scheduling, the queue's polling
SWAP_TIMEOUT_S = 8.0  # the queue's task_timeout (swaps): before the change they waited behind the write past it
SETTLE_S = 0.3       # after a task's first done signal, how long to wait for more copies of it


class DoneSignals:
    """Every done signal the engine's queue hands out, by task id (FastDeploy's recv thread)."""

    def __init__(self, engine: FastDeployEngine) -> None:
        self.engine = engine
        self.seen: list[tuple] = []

    def poll(self) -> None:
        while (item := self.engine.queue.get_transfer_done_signal()) is not None:
            self.seen.append(item)

    def of(self, task_id: str) -> list[tuple]:
        return [s for s in self.seen if s[1] == task_id]

    def wait_for(self, task_id: str, timeout: float) -> list[tuple]:
        """The task's signals: at least one within ``timeout``, then any copies within ``SETTLE_S``."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if self.of(task_id):
                break
            assert time.monotonic() < deadline, \
                f"no done signal for {task_id} within {timeout:.1f}s (seen: {[s[:2] for s in self.seen]})"
            time.sleep(0.005)
        settle = time.monotonic() + SETTLE_S
        while time.monotonic() < settle:
            self.poll()
            time.sleep(0.01)
        return self.of(task_id)


def _write(engine: FastDeployEngine, task_id: str, keys: list[str], blocks: list[int], timeout: float) -> None:
    engine.queue.put_transfer_task((CacheStatus.GPU2STORAGE, FDWriteStorageTask(
        task_id=task_id, keys=keys, token_ids=None, gpu_block_ids=blocks, timeout=timeout)))


def _read(engine: FastDeployEngine, task_id: str, keys: list[str], blocks: list[int], timeout: float) -> None:
    engine.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask(task_id, keys, [], blocks, 0,
                                                                             timeout=timeout)))


def _blocks_of(signals: list[tuple]) -> list[int]:
    """The block list every signal of one storage task reports (they must agree)."""
    assert signals and all(s[3] == signals[0][3] for s in signals), signals
    return list(signals[0][3])


def _bytes(engine: FastDeployEngine, blocks: list[int]) -> dict[Any, np.ndarray]:
    return {k: v[blocks].copy() for k, v in engine.views().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _rank_log(engine: FastDeployEngine, rank: int) -> str:
    with open(engine.procs[rank].log_path) as f:
        return f.read()


def _blocked_in_d_state(pid: int) -> bool:
    """Whether a thread of ``pid`` sleeps uninterruptibly (a writer of the frozen store)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "D":
                    return True
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return False


def _swap(engine: FastDeployEngine, signals: DoneSignals, event: CacheStatus, task_id: str, blocks: list[int],
          slots: list[int]) -> None:
    nodes = [31, 32]
    engine.queue.put_transfer_task((event, task_id, nodes, blocks, slots))
    got = signals.wait_for(task_id, SWAP_TIMEOUT_S)
    assert got and all(s == (event, task_id, nodes, blocks, slots) for s in got), got


def test_a_write_stalled_on_a_frozen_store_answers_in_budget_and_frees_its_blocks(tmp_path):
    with loop_ext4(tmp_path) as fs:
        engine = FastDeployEngine(tp=2, storage_root=str(fs.mount / "kv"), storage_grace=GRACE_S,
                                  task_timeout=SWAP_TIMEOUT_S)
        try:
            engine.start()
            signals = DoneSignals(engine)
            engine.fill(seed=31)
            _write(engine, "w-before", ["frz-a0", "frz-a1"], [1, 2], timeout=10.0)
            assert _blocks_of(signals.wait_for("w-before", 20.0)) == [1, 2]  # the segments exist: appends next

            blocks, slots, keys = [3, 4], [0, 1], ["frz-b0", "frz-b1"]
            snapshot = _bytes(engine, blocks)
            try:
                fs.freeze()
                t0 = time.monotonic()
                _write(engine, "w-frozen", keys, blocks, timeout=TIMEOUT_S)
                engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "s-out", [31, 32], blocks, slots))
                frozen = signals.wait_for("w-frozen", TIMEOUT_S + GRACE_S + SLACK_S)
                answered_s = time.monotonic() - t0
                assert answered_s <= TIMEOUT_S + GRACE_S + SLACK_S, answered_s
                assert _blocks_of(frozen) == [], frozen            # none of this write's blocks is stored
                got = signals.wait_for("s-out", SWAP_TIMEOUT_S)     # put behind the write, on its blocks
                assert got and all(s == (CacheStatus.SWAP2CPU, "s-out", [31, 32], blocks, slots) for s in got), got
                for view in engine.views().values():
                    view[blocks] = 0                               # the engine reuses the blocks
                _swap(engine, signals, CacheStatus.SWAP2GPU, "s-in", blocks, slots)
                assert _same(_bytes(engine, blocks), snapshot), "the swaps behind the frozen write are not bit-exact"
                assert engine.queue.failed_tasks() == {}
                for rank, proc in engine.procs.items():           # the store is still frozen: the calls block
                    assert _blocked_in_d_state(proc.pid), f"rank {rank}: no writer blocked on the frozen store"
                    assert re.search(r"late call may still store its objects \(it had begun committing\)",
                                     _rank_log(engine, rank)), f"rank {rank}: the write did not block in its commit"
                engine.fill(seed=32)                               # the engine writes new bytes into every block
                reused = _bytes(engine, blocks)
            finally:
                fs.thaw()  # before anything waits for a CTM: its writer only wakes at the thaw

            # The late calls land after the thaw, with the snapshot's bytes.
            landed, deadline, n = [], time.monotonic() + 20.0, 0
            while landed != [12, 13]:
                assert time.monotonic() < deadline, f"the late write never landed after the thaw: {landed}"
                n += 1
                _read(engine, f"r-late-{n}", keys, [12, 13], timeout=5.0)
                landed = _blocks_of(signals.wait_for(f"r-late-{n}", 10.0))
            got = _bytes(engine, [12, 13])
            assert _same(got, snapshot), "a late object does not hold the snapshot's bytes"
            assert not any(np.array_equal(got[k], reused[k]) for k in got)

            # A later round trip on the thawed store.
            after = ["frz-c0", "frz-c1"]
            engine.fill(seed=33)
            want = _bytes(engine, [5, 6])
            _write(engine, "w-after", after, [5, 6], timeout=10.0)
            assert _blocks_of(signals.wait_for("w-after", 20.0)) == [5, 6]
            _read(engine, "r-after", after, [14, 15], timeout=10.0)
            assert _blocks_of(signals.wait_for("r-after", 20.0)) == [14, 15]
            assert _same(_bytes(engine, [14, 15]), want), "the round trip after the thaw is not bit-exact"
        finally:
            leftovers = engine.close()  # thawed above: no CTM is left blocked on the store
        assert leftovers == []
        assert all(not p.alive() for p in engine.procs.values())
    assert not os.path.ismount(fs.mount), "the loop file system was left mounted"
