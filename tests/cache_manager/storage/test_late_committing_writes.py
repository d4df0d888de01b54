"""A staged write that may still store after its task answered lets go of its device blocks at the
answer (issue 33 item 3).

Real TP=2 CTMs over ``tests/late_commit_store.py``: ``batch_set`` stalls past the task's deadline
after its commit began (``committing``: a file store whose disk froze mid-append), or in a backend
that cannot refuse a commit (``unrefusing``: Mooncake's put).  The late call reads only the staging
snapshot, so:

* the task answers at its deadline with 0 blocks and ``future.released`` done with the answer
  (before: released only when the stalled call returned);
* a swap out and back of the same device blocks, put right behind the write, runs and is
  bit-exact while the call is still stalled (before: it waited behind the write);
* an RL clear racing the late call still waits for it (the rank counts it in flight);
* the objects it stores after the answer hold the snapshot's bytes, not those the engine wrote
  into the blocks after the answer (the deviation from DESIGN §3.8 is the snapshot's bytes only).
"""
from __future__ import annotations

import json
import os
import re
import time

import numpy as np
import pytest

from cache_manager.cache_data import KV_CACHE_STATUS_SIGNAL, KVCacheStatus
from tests.late_commit_store import MODES
from tests.service_helpers import SMALL, block_bytes, fill_distinct, start_service, write_random_blocks
from transfer_factory.keys import chain_hash_ids
from transfer_factory.kvcache_storage import OK

PLUGIN_ENV = {"CTM_STORAGE_PLUGINS": "latecommit=tests.late_commit_store:LateCommitStore"}
TIMEOUT_S = 0.5      # the write task's budget
STALL_S = 3.0        # how long its batch_set stalls, its commit begun (or not refusable)
EVIDENCE = {"committing": r"late call may still store its objects \(it had begun committing\)",
            "unrefusing": r"late call may still store its objects \(latecommit cannot refuse a commit\)"}


def _rank_log(svc, rank: int) -> str:
    with open(os.path.join(svc.log_dir, f"cache_transfer_manager_rank{rank}.log")) as f:
        return f.read()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("late", MODES)
def test_a_late_write_that_may_still_store_releases_its_blocks_with_its_answer(tmp_path, late):
    stall_dir, root, model = tmp_path / "stall", tmp_path / "store", tmp_path / "model"
    stall_dir.mkdir()
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP1-20251103-aaaa\n")
    svc = start_service(SMALL, storage_backend="latecommit", storage_transfer="staged", extra_env=PLUGIN_ENV,
                        storage_options={"root": str(root), "stall_dir": str(stall_dir), "fsync": False,
                                         "late": late},
                        model_id=str(model), model_version="RL-STEP1")
    done = [stall_dir / f"batch_set.done.{r}" for r in (0, 1)]
    try:
        fill_distinct(svc, seed=21)
        blocks, slots = [1, 2], [0, 1]
        snapshot = block_bytes(svc, blocks)
        hashes = chain_hash_ids([f"late-{late}-0", f"late-{late}-1"])
        (stall_dir / "batch_set").write_text(str(STALL_S))
        t0 = time.monotonic()
        future = svc.write_storage(hashes, blocks, timeout=TIMEOUT_S)
        swap_out = svc.swap_to_cpu(blocks, slots, timeout=STALL_S)  # the same device blocks, right behind it
        assert future.result(timeout=TIMEOUT_S + 10) == []            # the answer: 0 blocks, at the deadline
        future.released.result(timeout=0.5)                           # and the blocks with it
        assert time.monotonic() - t0 < STALL_S - 1.0, "the write waited for its stalled call"
        swap_out.result(timeout=STALL_S - 1.0)
        write_random_blocks(svc, blocks, seed=22)                     # the engine reuses the blocks
        svc.swap_to_gpu(blocks, slots, timeout=STALL_S).result(timeout=STALL_S)
        assert _same(block_bytes(svc, blocks), snapshot), "the swap behind the late write is not bit-exact"
        assert all((stall_dir / f"batch_set.entered.{r}").exists() for r in (0, 1))
        assert not any(p.exists() for p in done), "the late call returned before the swap: nothing was shown"
        reused = write_random_blocks(svc, blocks, seed=23)
        for r in (0, 1):
            assert re.search(EVIDENCE[late], _rank_log(svc, r)), f"rank {r}: no log line says what may still land"

        svc.clear_caches(timeout=30)                                  # races the stalled calls: waits for them
        assert svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] == KVCacheStatus.CLEARED
        assert all(p.exists() for p in done), "the clear finished before a call that may still store returned"
        for path in done:
            codes = json.loads(path.read_text())
            assert codes == [OK] * len(codes) and codes, f"{path.name}: {codes}"  # stored after the answer
        (stall_dir / "batch_set").unlink()

        # Restored at the same model version (the same namespace): what landed is the snapshot's bytes.
        svc.restore_caches(timeout=60)
        fill_distinct(svc, seed=24)
        assert svc.read_storage(hashes, [5, 6]).result(timeout=30) == [5, 6]
        got = block_bytes(svc, [5, 6])
        assert _same(got, snapshot), "a late object does not hold the snapshot's bytes"
        assert not any(np.array_equal(got[k], reused[k]) for k in got)
    finally:
        svc.shutdown()
