#!/usr/bin/env python3
"""What per-request transfer records cost a task (DESIGN §4.2, ``engine_hooks.core.transfer_records``).

One CacheTransferService (--tp ranks, a small cache: 2 layers x 64 blocks, kv_heads 2, block_size 16,
head_dim 64) runs one-block swap round trips, one in flight at a time, alternating swap_to_cpu and
swap_to_gpu, in slices of 100 that alternate between three paths:

  floor      no request id: not recorded (the default path of a task without one)
  recorded   with a request id: recorded (OpenTelemetry installed, no tracer provider: no span kept)
  traced     with a request id and an SDK tracer provider (batch span processor, in-memory exporter):
             one span per task

Each path's round trip p50 is a ratio to the floor of the same run.  Target (printed, not asserted):
a recorded task's p50 <= 1.25x the floor (a one-block task: the worst case, its fixed cost
is all there is to it).  Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import quiet_paddle, rounded  # (puts the repo on sys.path)

quiet_paddle()

from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402

SPEC = CacheSpec(num_layers=2, num_blocks=64, kv_heads=2, block_size=16, head_dim=64)
SLICE = 100


def round_trips(svc: CacheTransferService, n: int, request_id: str | None, start: int) -> list[float]:
    out = []
    for i in range(start, start + n):
        swap = svc.swap_to_cpu if i % 2 == 0 else svc.swap_to_gpu
        t = time.perf_counter()
        swap([i % 64], [i % 64], request_id=request_id and f"{request_id}-{i // 8}").result(timeout=30)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tasks", type=int, default=1500, help="round trips per path")
    args = p.parse_args()
    times: dict[str, list[float]] = {"floor": [], "recorded": [], "traced": []}
    provider = None
    with CacheTransferService(SPEC, tp=args.tp, num_cpu_blocks=64) as svc:
        round_trips(svc, 50, "warm", 0)
        i = 0
        while len(times["floor"]) < args.tasks:
            for path in ("floor", "recorded", "traced"):
                if path == "traced" and provider is None:
                    provider = sdk_provider()
                if provider is not None:
                    provider.active = path == "traced"
                times[path] += round_trips(svc, SLICE, None if path == "floor" else path, i)
                i += SLICE
    p50 = {k: statistics.median(v) for k, v in times.items()}
    p99 = {k: sorted(v)[int(len(v) * 0.99)] for k, v in times.items()}
    result = {"tp": args.tp, "tasks_per_path": len(times["floor"]),
              **{f"{k}_p50_ms": p50[k] for k in times}, **{f"{k}_p99_ms": p99[k] for k in times},
              "recorded_ratio": p50["recorded"] / p50["floor"], "traced_ratio": p50["traced"] / p50["floor"],
              "recorded_target": 1.25}
    print(f"{'path':<10} {'p50 ms':>8} {'p99 ms':>8} {'x floor':>8}")
    for k in times:
        print(f"{k:<10} {p50[k]:8.3f} {p99[k]:8.3f} {p50[k] / p50['floor']:8.3f}")
    print(f"target: recorded p50 <= {result['recorded_target']}x the floor: "
          f"{'met' if result['recorded_ratio'] <= result['recorded_target'] else 'MISSED'}")
    print(json.dumps({k: rounded(v) for k, v in result.items()}))
    return 0


def sdk_provider():
    """The global tracer provider: an SDK one whose spans go to an in-memory exporter through a
    batch processor, switched on and off between slices (a sampler that reads ``active``)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class Switch(Sampler):
        def should_sample(self, *args, **kwargs) -> SamplingResult:
            return SamplingResult(Decision.RECORD_AND_SAMPLE if provider.active else Decision.DROP)

        def get_description(self) -> str:
            return "bench switch"

    provider = TracerProvider(sampler=Switch())
    provider.active = False
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


if __name__ == "__main__":
    raise SystemExit(main())
