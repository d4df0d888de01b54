#!/usr/bin/env python3
"""Storage throughput: raw Mooncake calls against the CTM's storage tasks, and FileStore.

In one run, on the same bytes (a TP=2 model, 4 layers, K+V bf16, 128 KiB per layer-block,
so one storage object of 512 KiB per block, kind and rank; --blocks blocks per task):
  mooncake raw    batch_put_from / batch_get_into of the same objects from this process,
                  one client per rank share, the shares in parallel threads
  mooncake task   write_storage / read_storage futures through TP=2 CTM processes, on the
                  default path (auto: staged, a swap_cache_layout pass through a staging
                  buffer, so that a late call never touches a device block) and, for
                  comparison, the opt-in direct path (the store reads/writes the caches in
                  place); the headline figures and ratios are the default path's
  file            FileStore batch_set / batch_get of the same objects (fsync on), and the
                  same tasks through CTMs with the file backend
Each figure is the median of --reps repetitions (fresh keys for every write).  Prints a
table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from typing import Callable

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import quiet_paddle

quiet_paddle()

import numpy as np  # noqa: E402

from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402
from ops.cpu import CpuPlatform  # noqa: E402
from transfer_factory.file_store import FileStore  # noqa: E402
from transfer_factory.keys import chain_hash_ids  # noqa: E402
from transfer_factory.mooncake_master import LocalMooncakeMaster  # noqa: E402
from transfer_factory.mooncake_store import MooncakeStore  # noqa: E402

TP = 2
SEGMENT = 1 << 30


def median_gbps(nbytes: int, runs: list[float]) -> float:
    return nbytes / statistics.median(runs) / 1e9


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def parallel(fns: list[Callable[[], object]]) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def fill_caches(svc: CacheTransferService) -> None:
    rng = np.random.default_rng(0)
    for caches in svc.caches.tensors:
        for layers in caches.values():
            for t in layers:
                view = svc.platform.raw_view(t)
                view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)


def raw_round(stores: list, ptrs: list[list[int]], size: int, tag: str) -> tuple[float, float]:
    """Each store writes, then reads, its share of the objects (one share per rank), in parallel."""
    keys = [[f"bench/{tag}/{r}/{i}" for i in range(len(p))] for r, p in enumerate(ptrs)]
    results: list = [None] * len(stores)

    def put(r: int) -> None:
        results[r] = stores[r].batch_set(keys[r], ptrs[r], [size] * len(ptrs[r]))

    def get(r: int) -> None:
        results[r] = stores[r].batch_get(keys[r], ptrs[r], [size] * len(ptrs[r]))

    write = timed(lambda: parallel([lambda r=r: put(r) for r in range(len(stores))]))
    if not all(x == 0 for res in results for x in res):
        raise RuntimeError(f"raw put failed: {results}")
    read = timed(lambda: parallel([lambda r=r: get(r) for r in range(len(stores))]))
    if not all(x == size for res in results for x in res):
        raise RuntimeError(f"raw get failed: {results}")
    return write, read


def task_round(svc: CacheTransferService, blocks: int, tag: str) -> tuple[float, float]:
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    keys = chain_hash_ids([f"{tag}-{i}" for i in range(blocks)])
    write = timed(lambda: _expect(svc.write_storage(keys, src, timeout=120).result(180), src, "write"))
    read = timed(lambda: _expect(svc.read_storage(keys, dst, timeout=120).result(180), dst, "read"))
    return write, read


def interleaved(reps: int, rounds: dict[str, Callable[[str], tuple[float, float]]]) -> dict[str, list[list[float]]]:
    """Runs each kind of round once to warm up, then ``reps`` times, interleaved so that the
    shared machine's drift hits every figure alike; returns write and read times per kind."""
    times = {name: [[], []] for name in rounds}
    for rep in range(reps + 1):
        for name, run in rounds.items():
            w, r = run(f"{name}-{rep}")
            if rep:
                times[name][0].append(w)
                times[name][1].append(r)
    return times


def _expect(got: list[int], want: list[int], what: str) -> None:
    if got != want:
        raise RuntimeError(f"{what} task moved {len(got)} of {len(want)} blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per task")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.blocks < 1 or args.layers < 1 or args.reps < 1:
        parser.error("--blocks, --layers and --reps must be positive")
    _common.setup_logging(args.verbose)
    spec = CacheSpec(num_layers=args.layers, num_blocks=2 * args.blocks, kv_heads=8, block_size=64, head_dim=128)
    object_bytes = args.layers * spec.kv_heads * spec.block_size * spec.head_dim * 2
    objects_per_rank = 2 * args.blocks  # K and V
    out: dict[str, float | str] = {}
    print(f"TP={TP}, {args.layers} layers, {object_bytes // 1024} KiB per object, {args.blocks} blocks per task "
          f"({TP * objects_per_rank * object_bytes / 2**20:.0f} MiB per task), median of {args.reps}", flush=True)

    platform = CpuPlatform(instance=f"bench-storage-{time.monotonic_ns()}")
    buffers = [platform.host_alloc(objects_per_rank * object_bytes) for _ in range(TP)]
    for b in buffers:
        view = platform.host_buffer(b, objects_per_rank * object_bytes)
        view[:] = np.random.default_rng(1).integers(0, 256, view.size, dtype=np.uint8)
    ptrs = [[b + i * object_bytes for i in range(objects_per_rank)] for b in buffers]
    task_bytes = TP * objects_per_rank * object_bytes

    with LocalMooncakeMaster(lease_ttl_ms=10000) as master:
        options = {**master.config(), "global_segment_size": SEGMENT, "local_buffer_size": 64 << 20}
        stores = [MooncakeStore(namespace="bench", rank=r, options=options) for r in range(TP)]
        raw_w: list[float] = []
        raw_r: list[float] = []
        try:
            for s, b in zip(stores, buffers):
                s.register_buffer(b, objects_per_rank * object_bytes)
            for path in ("auto", "direct"):
                # The raw rounds run while the CTMs are up, so that objects land in the same
                # set of mounted segments, local and remote alike, for both.
                with CacheTransferService(spec, tp=TP, storage_backend="mooncake", storage_options=options,
                                          storage_transfer=path, model_id=f"bench/{path}", task_timeout=120,
                                          max_model_len=spec.block_size * args.blocks) as svc:
                    fill_caches(svc)
                    times = interleaved(args.reps, {
                        "raw": lambda tag: raw_round(stores, ptrs, object_bytes, f"{path}-{tag}"),
                        "task": lambda tag: task_round(svc, args.blocks, f"{path}-{tag}"),
                    })
                raw_w += times["raw"][0]
                raw_r += times["raw"][1]
                w, r = median_gbps(task_bytes, times["raw"][0]), median_gbps(task_bytes, times["raw"][1])
                tw, tr = median_gbps(task_bytes, times["task"][0]), median_gbps(task_bytes, times["task"][1])
                out[f"mooncake_task_{path}_write_gbps"], out[f"mooncake_task_{path}_read_gbps"] = tw, tr
                out[f"mooncake_task_{path}_write_ratio"], out[f"mooncake_task_{path}_read_ratio"] = tw / w, tr / r
                print(f"{path:6s} path: raw write {w:5.2f} GB/s, task {tw:5.2f} GB/s ({tw / w:.2f}x) | "
                      f"raw read {r:5.2f} GB/s, task {tr:5.2f} GB/s ({tr / r:.2f}x)", flush=True)
        finally:
            for s in stores:
                s.close()
    out["mooncake_raw_write_gbps"] = median_gbps(task_bytes, raw_w)
    out["mooncake_raw_read_gbps"] = median_gbps(task_bytes, raw_r)
    best = "auto"  # what a user gets by default, never the better of two picked afterwards
    out["mooncake_task_path"] = best
    out["mooncake_task_write_gbps"] = out[f"mooncake_task_{best}_write_gbps"]
    out["mooncake_task_read_gbps"] = out[f"mooncake_task_{best}_read_gbps"]
    out["mooncake_write_ratio"] = out[f"mooncake_task_{best}_write_ratio"]  # against the raw rounds of its own run
    out["mooncake_read_ratio"] = out[f"mooncake_task_{best}_read_ratio"]

    with tempfile.TemporaryDirectory(prefix="bench-file-") as root:
        store = FileStore(namespace="bench", rank=0, options={"root": root})
        flat = [p for share in ptrs for p in share]
        writes, reads = [], []
        for rep in range(args.reps):
            keys = [f"bench/raw/{rep}/{i}" for i in range(len(flat))]
            writes.append(timed(lambda: store.batch_set(keys, flat, [object_bytes] * len(flat))))
            reads.append(timed(lambda: store.batch_get(keys, flat, [object_bytes] * len(flat))))
        store.close()
        nbytes = len(flat) * object_bytes
        out.update(file_write_gbps=median_gbps(nbytes, writes), file_read_gbps=median_gbps(nbytes, reads))
        print(f"file (fsync)      write {out['file_write_gbps']:6.2f} GB/s   read {out['file_read_gbps']:6.2f} GB/s",
              flush=True)
        with CacheTransferService(spec, tp=TP, storage_backend="file", storage_options={"root": root},
                                  model_id="bench/file", task_timeout=120,
                                  max_model_len=spec.block_size * args.blocks) as svc:
            fill_caches(svc)
            times = interleaved(args.reps, {"task": lambda tag: task_round(svc, args.blocks, f"file-{tag}")})
        tw, tr = median_gbps(task_bytes, times["task"][0]), median_gbps(task_bytes, times["task"][1])
        out.update(file_task_write_gbps=tw, file_task_read_gbps=tr)
        print(f"file task         write {tw:6.2f} GB/s   read {tr:6.2f} GB/s", flush=True)
    for b in buffers:
        platform.host_free(b)
    print(f"mooncake task path (default): {best}; ratios write {out['mooncake_write_ratio']:.2f}, "
          f"read {out['mooncake_read_ratio']:.2f} (target >= 0.8)")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))


if __name__ == "__main__":
    main()
