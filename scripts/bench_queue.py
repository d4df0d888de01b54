#!/usr/bin/env python3
"""Task-queue overhead of the CTM service: idle CPU, one-block round trip, pipelined throughput.

For each --tp (one CacheTransferService each, a small cache: 2 layers x 64 blocks,
kv_heads 2, block_size 16, head_dim 64, bf16, 64 host blocks) it measures:
  idle CPU     utime+stime of every CTM pid (/proc/<pid>/stat) over --idle-seconds with no
               task in flight, as percent of one core per rank (and the max over ranks)
  round trip   --tasks one-block swap tasks, one in flight at a time, alternating
               swap_to_cpu / swap_to_gpu; submit -> future.result() per task (p50/p90/p99)
               and tasks/s = count / total elapsed (after ~50 warm-up tasks)
  pipelined    --pipelined one-block swap tasks all submitted before any is waited for;
               tasks/s = count / elapsed
  floor        a bare zmq fan-out round trip to the same number of processes, one small
               HMAC'd msgpack frame out and one back (scripts/zmq_floor.py), measured in the same
               run: slices of 100 of our round trips alternate with 100 floor rounds
Targets (DESIGN §5, printed, not asserted): idle rank < 1% of a core, p50 <= 1.5x and p99 <= 3x
the floor.
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import Future

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import quiet_paddle

quiet_paddle()

import numpy as np  # noqa: E402

from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402
from zmq_floor import FloorRanks  # noqa: E402

NUM_BLOCKS = 64
SPEC = CacheSpec(num_layers=2, num_blocks=NUM_BLOCKS, kv_heads=2, block_size=16, head_dim=64,
                 cache_dtype="bfloat16")
RESULT_TIMEOUT = 60.0
WARMUP_TASKS = 50
SLICE = 100  # round trips per interleaved slice (ours, then the floor's)
SETTLE_SECONDS = 1.0
IDLE_TARGET_PCT = 1.0
P50_OVER_FLOOR = 1.5
P99_OVER_FLOOR = 3.0


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (every thread), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5); fields[0] is field 3


def idle_cpu(svc: CacheTransferService, seconds: float) -> dict[int, float]:
    """Percent of one core each rank used over ``seconds`` with nothing in flight."""
    hz = os.sysconf("SC_CLK_TCK")
    pids = svc.pids()
    before = {rank: cpu_ticks(pid) for rank, pid in pids.items()}
    t0 = time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - t0
    after = {rank: cpu_ticks(pid) for rank, pid in pids.items()}
    return {rank: 100.0 * (after[rank] - before[rank]) / hz / elapsed for rank in sorted(pids)}


def swap(svc: CacheTransferService, i: int) -> Future:
    """The i-th one-block task: even i to host, odd i back to the device, block i mod 64 on both sides."""
    block = [i % NUM_BLOCKS]
    return (svc.swap_to_cpu if i % 2 == 0 else svc.swap_to_gpu)(block, block)


def round_trips(svc: CacheTransferService, floor: FloorRanks, count: int) -> tuple[np.ndarray, float, np.ndarray]:
    """Per-task latency (ms) of ``count`` tasks run one at a time, their total elapsed seconds
    (floor rounds excluded), and the floor's per-round latency, measured in interleaved slices
    of ``SLICE`` so that drift on a shared machine hits both alike."""
    for i in range(WARMUP_TASKS):
        swap(svc, i).result(RESULT_TIMEOUT)
    floor.round_trips(0, WARMUP_TASKS)
    lat = np.empty(count)
    floors = []
    elapsed = 0.0
    for lo in range(0, count, SLICE):
        start = time.perf_counter()
        for i in range(lo, min(lo + SLICE, count)):
            t0 = time.perf_counter()
            swap(svc, i).result(RESULT_TIMEOUT)
            lat[i] = (time.perf_counter() - t0) * 1e3
        elapsed += time.perf_counter() - start
        floors.append(floor.round_trips(min(SLICE, count - lo)))
    return lat, elapsed, np.concatenate(floors)


def pipelined(svc: CacheTransferService, count: int) -> float:
    """Seconds to submit ``count`` tasks up front and see every one resolve."""
    t0 = time.perf_counter()
    futures = [swap(svc, i) for i in range(count)]
    for f in futures:
        f.result(RESULT_TIMEOUT)
    return time.perf_counter() - t0


def bench_tp(tp: int, args: argparse.Namespace) -> dict:
    with CacheTransferService(SPEC, tp=tp, num_cpu_blocks=NUM_BLOCKS, task_timeout=RESULT_TIMEOUT) as svc, \
            FloorRanks(tp) as floor_ranks:
        time.sleep(SETTLE_SECONDS)
        idle = idle_cpu(svc, args.idle_seconds)
        lat, elapsed, floor = round_trips(svc, floor_ranks, args.tasks)
        pipe_elapsed = pipelined(svc, args.pipelined)
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    f50, f99 = np.percentile(floor, [50, 99])
    return {
        "tp": tp,
        "idle_cpu_pct_max_rank": round(max(idle.values()), 3),
        "idle_cpu_pct_per_rank": [round(idle[r], 3) for r in sorted(idle)],
        "rtt_p50_ms": round(float(p50), 4),
        "rtt_p90_ms": round(float(p90), 4),
        "rtt_p99_ms": round(float(p99), 4),
        "tasks_per_s": round(args.tasks / elapsed, 1),
        "pipelined_tasks_per_s": round(args.pipelined / pipe_elapsed, 1),
        "floor_p50_ms": round(float(f50), 4),
        "floor_p99_ms": round(float(f99), 4),
        "p50_over_floor": round(float(p50 / f50), 3),
        "p99_over_floor": round(float(p99 / f99), 3),
    }


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel sizes to run")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU window")
    parser.add_argument("--tasks", type=int, default=1000, help="one-at-a-time tasks timed (at least 500 for the report)")
    parser.add_argument("--pipelined", type=int, default=1000, help="tasks submitted before waiting for any")
    args = parser.parse_args()
    if any(tp < 1 for tp in args.tp):
        parser.error(f"--tp {args.tp} must hold positive integers")
    if not args.idle_seconds > 0:
        parser.error(f"--idle-seconds {args.idle_seconds} must be positive")
    if args.tasks < 1 or args.pipelined < 1:
        parser.error("--tasks and --pipelined must be positive")

    print(f"cache: {SPEC.num_layers} layers x {NUM_BLOCKS} blocks, [{SPEC.kv_heads},{SPEC.block_size},"
          f"{SPEC.head_dim}] {SPEC.cache_dtype}; idle {args.idle_seconds:g}s, {args.tasks} round trips "
          f"(+{WARMUP_TASKS} warm-up), {args.pipelined} pipelined; {os.cpu_count()} cores", flush=True)
    header = (f"{'tp':>3} {'idle%/rank':>18} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
              f"{'tasks/s':>9} {'pipe tasks/s':>13} {'floor p50/p99':>14} {'x floor':>11}  targets")
    print(header)
    runs = []
    for tp in args.tp:
        r = bench_tp(tp, args)
        runs.append(r)
        idle_cells = "/".join(f"{x:.2f}" for x in r["idle_cpu_pct_per_rank"])
        targets = f"idle<{IDLE_TARGET_PCT:g}%: {verdict(r['idle_cpu_pct_max_rank'] < IDLE_TARGET_PCT)}"
        targets += (f", p50<={P50_OVER_FLOOR:g}x: {verdict(r['p50_over_floor'] <= P50_OVER_FLOOR)}"
                    f", p99<={P99_OVER_FLOOR:g}x: {verdict(r['p99_over_floor'] <= P99_OVER_FLOOR)}")
        floor = f"{r['floor_p50_ms']:.3f}/{r['floor_p99_ms']:.3f}"
        ratio = f"{r['p50_over_floor']:.2f}/{r['p99_over_floor']:.2f}"
        print(f"{tp:>3} {idle_cells:>18} {r['rtt_p50_ms']:8.3f} {r['rtt_p90_ms']:8.3f} {r['rtt_p99_ms']:8.3f} "
              f"{r['tasks_per_s']:9.0f} {r['pipelined_tasks_per_s']:13.0f} {floor:>14} {ratio:>11}  {targets}",
              flush=True)
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
