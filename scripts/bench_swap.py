#!/usr/bin/env python3
"""Block-copy bandwidth of the CPU platform against a contiguous memcpy of the same bytes.

For 4 KiB and 128 KiB blocks (per layer-block), random block ids on both sides and at
least 256 MiB per figure, it times, in one run:
  memcpy            one contiguous copy of the same number of bytes, same thread count
  all_layers d2h/h2d  swap_cache_all_layers both ways
  layout d2h/h2d      swap_cache_layout (block-major staging buffer) both ways
Each figure is the median of --reps repetitions.  Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import quiet_paddle

quiet_paddle()

import numpy as np  # noqa: E402

from ops.cpu import CpuPlatform  # noqa: E402
from ops.layout import tensor_info  # noqa: E402
from ops import _block_copy  # noqa: E402

MiB = 1 << 20


def median_seconds(fns: dict, reps: int) -> dict:
    """Median time of each function; repetitions are interleaved so that the shared
    machine's drift hits every figure alike."""
    for fn in fns.values():
        fn()  # warm-up: faults the pages in, so every rep measures copying only
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_block_size(platform: CpuPlatform, block_bytes: int, layers: int, total_bytes: int, reps: int, rng) -> dict:
    blocks_per_layer = total_bytes // (layers * block_bytes)  # blocks moved per layer
    device_blocks = blocks_per_layer * 2  # ids drawn from a cache twice that size
    elems = block_bytes // 2
    shape = [device_blocks, 1, 1, elems]  # bf16; only bytes per block matter to the copy
    caches = [platform.empty(shape, "bfloat16") for _ in range(layers)]
    for c in caches:
        info = tensor_info(c, "cache")
        np.ctypeslib.as_array((ctypes.c_uint8 * info.nbytes).from_address(info.ptr))[:] = 1
    host = [platform.host_alloc(blocks_per_layer * block_bytes) for _ in range(layers)]
    staging = platform.host_alloc(blocks_per_layer * layers * block_bytes)
    src = platform.host_alloc(total_bytes)
    dst = platform.host_alloc(total_bytes)
    moved = blocks_per_layer * layers * block_bytes
    # Write every buffer first: an untouched anonymous page reads as the shared zero
    # page, which would make the memcpy reference look faster than memory can go.
    for ptr, nbytes in [(p, blocks_per_layer * block_bytes) for p in host] + [
        (staging, blocks_per_layer * layers * block_bytes), (src, total_bytes), (dst, total_bytes)
    ]:
        platform.host_buffer(ptr, nbytes)[:] = 1

    dev_ids = rng.permutation(device_blocks)[:blocks_per_layer]
    host_ids = rng.permutation(blocks_per_layer)
    threads = platform.copy_threads
    ops = {
        "memcpy": lambda: _block_copy.copy_contiguous(dst, src, moved, threads),
        "all_layers_d2h": lambda: platform.swap_cache_all_layers(caches, host, blocks_per_layer, dev_ids, host_ids, 0, 0),
        "all_layers_h2d": lambda: platform.swap_cache_all_layers(caches, host, blocks_per_layer, dev_ids, host_ids, 0, 1),
        "layout_d2h": lambda: platform.swap_cache_layout(caches, staging, shape, dev_ids, host_ids, 0, 0),
        "layout_h2d": lambda: platform.swap_cache_layout(caches, staging, shape, dev_ids, host_ids, 0, 1),
    }
    result = {"block_bytes": block_bytes}
    for name, seconds in median_seconds(ops, reps).items():
        result[f"{name}_gbps"] = moved / seconds / 1e9
    for name in ("all_layers_d2h", "all_layers_h2d", "layout_d2h", "layout_h2d"):
        result[f"{name}_ratio"] = result[f"{name}_gbps"] / result["memcpy_gbps"]

    for ptr in host + [staging, src, dst]:
        platform.host_free(ptr)
    for c in caches:
        platform.free(c)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-bytes", type=int, nargs="+", default=[4096, 128 * 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per figure (at least 256 for the report)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="copy threads (default: CTM_COPY_THREADS or cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.reps < 1 or args.mib < 1 or args.layers < 1:
        parser.error("--reps, --mib and --layers must be positive")
    for b in args.block_bytes:
        if b <= 0 or b % 2:
            parser.error(f"--block-bytes {b} must be a positive even number of bytes")

    platform = CpuPlatform(instance=f"bench{time.monotonic_ns()}", copy_threads=args.threads)
    rng = np.random.default_rng(args.seed)
    results = []
    print(f"copy threads: {platform.copy_threads}, layers: {args.layers}, {args.mib} MiB per figure, "
          f"median of {args.reps}", flush=True)
    header = f"{'block':>8} {'memcpy':>8} {'all_d2h':>14} {'all_h2d':>14} {'layout_d2h':>14} {'layout_h2d':>14}"
    print(header + "\n" + " " * 8 + "   GB/s   " + "   GB/s (ratio)" * 4)
    for block_bytes in args.block_bytes:
        r = bench_block_size(platform, block_bytes, args.layers, args.mib * MiB, args.reps, rng)
        results.append(r)
        cells = [f"{r[f'{n}_gbps']:6.2f} ({r[f'{n}_ratio']:.2f})" for n in ("all_layers_d2h", "all_layers_h2d", "layout_d2h", "layout_h2d")]
        label = f"{block_bytes // 1024} KiB" if block_bytes % 1024 == 0 else f"{block_bytes} B"
        print(f"{label:>8} {r['memcpy_gbps']:8.2f} " + " ".join(f"{c:>14}" for c in cells), flush=True)
    print(json.dumps({"copy_threads": platform.copy_threads, "results": [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in results
    ]}))


if __name__ == "__main__":
    main()
