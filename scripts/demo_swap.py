#!/usr/bin/env python3
"""Demo on the embedded default: an engine launches TP=2 CTM processes through
engine_hooks, swaps random blocks of a small model out to host memory and back,
verifies every byte on every rank and prints the figures."""
from __future__ import annotations

import argparse
import logging
import time

import _common  # noqa: F401
from _common import quiet_paddle, setup_logging

quiet_paddle()

import numpy as np  # noqa: E402

from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--swap-blocks", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="blocks per swap task")
    parser.add_argument("--shape", default="8,64,128", help="kv_heads,block_size,head_dim")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    setup_logging(args.verbose)
    heads, block_size, head_dim = (int(x) for x in args.shape.split(","))
    if not 0 < args.swap_blocks <= args.num_blocks or args.batch < 1 or args.tp < 1:
        parser.error("need 0 < --swap-blocks <= --num-blocks, --batch >= 1 and --tp >= 1")
    spec = CacheSpec(num_layers=args.layers, num_blocks=args.num_blocks, kv_heads=heads, block_size=block_size,
                     head_dim=head_dim)
    block_bytes = heads * block_size * head_dim * 2
    print(f"model: TP={args.tp}, {args.layers} layers, K+V bf16 {spec.cache_shape} per rank, "
          f"{block_bytes // 1024} KiB per layer-block", flush=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    with CacheTransferService(spec, tp=args.tp, num_cpu_blocks=args.swap_blocks) as svc:
        print(f"started {args.tp} CTM processes (pids {list(svc.pids().values())}) in {time.perf_counter() - t0:.1f}s",
              flush=True)
        views = {(r, kind, layer): svc.platform.raw_view(t)
                 for r, caches in enumerate(svc.caches.tensors) for kind, ts in caches.items() for layer, t in enumerate(ts)}
        for v in views.values():
            v[:] = rng.integers(0, 256, v.shape, dtype=np.uint8)
        original = {k: v.copy() for k, v in views.items()}
        gpu = rng.permutation(args.num_blocks)[: args.swap_blocks]
        cpu = rng.permutation(args.swap_blocks)
        batches = [(gpu[i:i + args.batch], cpu[i:i + args.batch]) for i in range(0, args.swap_blocks, args.batch)]
        nbytes = args.swap_blocks * block_bytes * 2 * args.layers * args.tp
        figures = {}
        for name, submit in (("device->host", svc.swap_to_cpu), ("host->device", svc.swap_to_gpu)):
            if name == "host->device":
                for v in views.values():  # the evicted device blocks were reused by other requests
                    v[gpu] = 0
            t = time.perf_counter()
            futures = [submit(g, c) for g, c in batches]
            for f in futures:
                f.result(timeout=60)
            seconds = time.perf_counter() - t
            figures[name] = seconds
            print(f"{name}: {len(batches)} tasks, {nbytes / 2**20:.0f} MiB over {args.tp} ranks in "
                  f"{seconds * 1e3:.1f} ms = {nbytes / seconds / 1e9:.2f} GB/s", flush=True)
        bad = [k for k, v in views.items() if not np.array_equal(v, original[k])]
        verified = sum(len(gpu) for _ in views)
        rtts = []
        for i in range(300):
            t = time.perf_counter()
            svc.swap_to_cpu([int(gpu[i % len(gpu)])], [int(cpu[i % len(cpu)])]).result(timeout=10)
            rtts.append((time.perf_counter() - t) * 1e3)
        per_rank = block_bytes * 2 * args.layers
        print(f"one-block swap round trip ({per_rank / 2**20:.1f} MiB per rank): p50 {np.median(rtts):.3f} ms, "
              f"p99 {np.percentile(rtts, 99):.3f} ms (300 tasks, TP={args.tp})")
    if bad:
        print(f"CORRUPT: {len(bad)} caches differ, e.g. rank/kind/layer {bad[0]}")
        return 1
    print(f"verified {verified} layer-blocks bit-exact on {args.tp} ranks; CTMs stopped, segments removed")
    print("OK")
    return 0


if __name__ == "__main__":
    logging.getLogger("engine_hooks").setLevel(logging.WARNING)
    raise SystemExit(main())
