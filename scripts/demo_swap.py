#!/usr/bin/env python3
"""Demo on the embedded default: the caches of a small model (2 ranks, 4 layers) swapped
device -> host -> device with random block ids, every byte checked, bandwidth printed."""
from __future__ import annotations

import argparse
import time

import _common  # noqa: F401
from _common import quiet_paddle

quiet_paddle()

import numpy as np  # noqa: E402

from ops.cpu import CpuPlatform  # noqa: E402


def raw(platform: CpuPlatform, tensor) -> np.ndarray:
    return platform.raw_view(tensor).reshape(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--swap-blocks", type=int, default=128)
    parser.add_argument("--shape", default="8,64,128", help="kv_heads,block_size,head_dim")
    args = parser.parse_args()
    heads, block_size, head_dim = (int(x) for x in args.shape.split(","))
    if not 0 < args.swap_blocks <= args.num_blocks:
        parser.error(f"--swap-blocks {args.swap_blocks} must be in 1..--num-blocks ({args.num_blocks})")
    shape = [args.num_blocks, heads, block_size, head_dim]
    block_bytes = heads * block_size * head_dim * 2
    platform = CpuPlatform(instance=f"demo{time.monotonic_ns()}")
    rng = np.random.default_rng(0)
    print(f"model: {args.ranks} ranks x {args.layers} layers, K+V bf16 {shape}, "
          f"{block_bytes // 1024} KiB per layer-block; swapping {args.swap_blocks} random blocks")
    ok = True
    moved = {"d2h": [0, 0.0], "h2d": [0, 0.0]}
    try:
        for rank in range(args.ranks):
            caches = {kv: [platform.empty(shape, "bfloat16") for _ in range(args.layers)] for kv in "kv"}
            host = {kv: [platform.host_alloc(args.swap_blocks * block_bytes) for _ in range(args.layers)] for kv in "kv"}
            for kv in "kv":
                for c in caches[kv]:
                    raw(platform, c)[:] = rng.integers(0, 256, raw(platform, c).size, dtype=np.uint8)
            original = {kv: [raw(platform, c).copy() for c in caches[kv]] for kv in "kv"}
            dev_ids = rng.permutation(args.num_blocks)[: args.swap_blocks]
            host_ids = rng.permutation(args.swap_blocks)
            nbytes = 2 * args.layers * args.swap_blocks * block_bytes
            for direction, mode in (("d2h", 0), ("h2d", 1)):
                if mode == 1:  # the device blocks were evicted and reused: scribble over them
                    for kv in "kv":
                        for c in caches[kv]:
                            raw(platform, c)[:] = 0
                t0 = time.perf_counter()
                for kv in "kv":
                    platform.swap_cache_all_layers(caches[kv], host[kv], args.swap_blocks, dev_ids, host_ids, 0, mode)
                moved[direction][0] += nbytes
                moved[direction][1] += time.perf_counter() - t0
            for kv in "kv":
                for layer, c in enumerate(caches[kv]):
                    got = raw(platform, c).reshape(args.num_blocks, -1)[dev_ids]
                    want = original[kv][layer].reshape(args.num_blocks, -1)[dev_ids]
                    if not np.array_equal(got, want):
                        print(f"MISMATCH rank {rank} layer {layer} {kv.upper()}")
                        ok = False
            print(f"rank {rank}: {2 * args.layers * args.swap_blocks} layer-blocks out and back, "
                  f"{'verified bit-exact' if ok else 'CORRUPT'}")
            for kv in "kv":
                for p in host[kv]:
                    platform.host_free(p)
                for c in caches[kv]:
                    platform.free(c)
    finally:
        from ops.shm import unlink_segments
        unlink_segments(platform.segment_prefix)
    for direction, (nbytes, seconds) in moved.items():
        print(f"{direction}: {nbytes / 2**20:.0f} MiB in {seconds * 1e3:.1f} ms = {nbytes / seconds / 1e9:.2f} GB/s")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
