#!/usr/bin/env python3
"""Storage throughput against raw calls on the same bytes, in one run: Mooncake and the file store.

Mooncake (a TP=2 model, 4 layers, K+V bf16, 128 KiB per layer-block, so one storage object of
512 KiB per block, kind and rank; --blocks blocks per task):
  raw             batch_put_from / batch_get_into of the same objects from this process, one
                  client per rank share, the shares in parallel threads
  task            write_storage / read_storage futures through TP=2 CTM processes on the path
                  ``--storage_transfer auto`` takes (``default_path``; today staged: the store
                  only reads and writes a staging buffer, so a late call never touches a device
                  block).  That is the headline: a benchmark reports the path a user gets by
                  default, never the better of two picked afterwards.  --direct also measures
                  the opt-in direct path, for comparison only.
File store, for objects of 16 KiB and of 512 KiB (--file-mib MiB per batch):
  write           FileStore batch_set: one call of all the objects, fresh keys, fsync on; raw: the
                  same bytes as one sequential write of one new file plus one fsync
  read            FileStore batch_get of those objects; raw: one sequential read of that file
                  (the page cache is warm in both)
  and the file backend's default path: the Mooncake-sized tasks through TP=2 CTMs, against each
                  rank's bytes written as one new file + fsync and read back, the ranks in parallel
                  threads (file_default_write_ratio / _read_ratio, target >= 0.9; median of
                  --file-task-reps)
Each figure is the median of --reps repetitions (fresh keys for every write), raw and store
rounds interleaved so that a shared machine's drift hits both alike.  Prints a table, then one
JSON line: default_path, mooncake_default_write_ratio / _read_ratio (the default path's task
throughput over the raw calls'), mooncake_raw_put_over_get, file: [{object_bytes, write_ratio,
read_ratio}, ...] (FileStore over raw file I/O), and the throughputs behind them.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Callable

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import quiet_paddle, rounded

quiet_paddle()

import numpy as np  # noqa: E402

from cache_manager.storage.staged_mover import resolve_transfer  # noqa: E402
from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402
from ops.cpu import CpuPlatform  # noqa: E402
from transfer_factory.file.store import FileStore  # noqa: E402
from transfer_factory.keys import chain_hash_ids  # noqa: E402
from scripts.local_mooncake_master import LocalMooncakeMaster  # noqa: E402
from transfer_factory.mooncake.store import MooncakeStore  # noqa: E402

TP = 2
SEGMENT = 1 << 30
FILE_OBJECT_BYTES = (16 << 10, 512 << 10)


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
    """Runs each kind of round once to warm up, then ``reps`` times, interleaved (and in turn
    first) so that the shared machine's drift hits every figure alike; returns write and read
    times per kind."""
    times = {name: [[], []] for name in rounds}
    names = list(rounds)
    for rep in range(reps + 1):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            w, r = rounds[name](f"{name}-{rep}")
            if rep:
                times[name][0].append(w)
                times[name][1].append(r)
    return times


def _expect(got: list[int], want: list[int], what: str) -> None:
    if got != want:
        raise RuntimeError(f"{what} task moved {len(got)} of {len(want)} blocks")


def write_new_file(path: str, data: np.ndarray) -> None:
    """The raw floor of a durable write: ``data`` as one new file, written sequentially, one fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_whole_file(path: str, into: np.ndarray) -> None:
    """The raw floor of a read: the file read sequentially into ``into``, which it must fill."""
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(into), 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise RuntimeError(f"raw read of {path} got {done} of {len(view)} bytes")
            done += got


def file_ratios(root: str, object_bytes: int, total: int, reps: int) -> dict[str, float]:
    """FileStore batch_set / batch_get of ``total // object_bytes`` objects against one sequential
    write (+ one fsync) and one sequential read of the same bytes in one file, same directory."""
    n = max(1, total // object_bytes)
    nbytes = n * object_bytes
    src = np.random.default_rng(object_bytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    ptrs = [src.ctypes.data + i * object_bytes for i in range(n)]
    dptrs = [dst.ctypes.data + i * object_bytes for i in range(n)]
    sizes = [object_bytes] * n
    store = FileStore(namespace="bench", rank=0, options={"root": os.path.join(root, "store"), "fsync": True})
    raw_path = os.path.join(root, "raw.bin")
    times: dict[str, list[float]] = {"raw_w": [], "raw_r": [], "store_w": [], "store_r": []}
    try:
        store.register_buffer(src.ctypes.data, nbytes)
        store.register_buffer(dst.ctypes.data, nbytes)

        for rep in range(reps + 1):
            keys = [f"bench/f{object_bytes}r{rep}b{i // 2:06d}/0/{'kv'[i % 2]}" for i in range(n)]
            if os.path.exists(raw_path):
                os.unlink(raw_path)  # a fresh file, as the store writes fresh keys
            order = ("raw", "store") if rep % 2 else ("store", "raw")
            got: dict[str, float] = {}
            for who in order:
                if who == "raw":
                    got["raw_w"] = timed(lambda: write_new_file(raw_path, src))
                    got["raw_r"] = timed(lambda: read_whole_file(raw_path, dst))
                else:
                    res: list = []
                    got["store_w"] = timed(lambda: res.extend(store.batch_set(keys, ptrs, sizes)))
                    if res != [0] * n:
                        raise RuntimeError(f"FileStore batch_set failed: {sorted(set(res))}")
                    res.clear()
                    got["store_r"] = timed(lambda: res.extend(store.batch_get(keys, dptrs, sizes)))
                    if res != sizes:
                        raise RuntimeError(f"FileStore batch_get failed: {sorted(set(res))}")
                if not np.array_equal(dst, src):
                    raise RuntimeError(f"{who} read back other bytes")
                dst[:] = 0
            if rep:  # the first is a warm-up
                for k, v in got.items():
                    times[k].append(v)
    finally:
        store.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"object_bytes": object_bytes, "objects": n,
            "write_ratio": med["raw_w"] / med["store_w"], "read_ratio": med["raw_r"] / med["store_r"],
            "raw_write_gbps": nbytes / med["raw_w"] / 1e9, "raw_read_gbps": nbytes / med["raw_r"] / 1e9,
            "store_write_gbps": nbytes / med["store_w"] / 1e9, "store_read_gbps": nbytes / med["store_r"] / 1e9}


def mooncake_rounds(args: argparse.Namespace, spec: CacheSpec, out: dict) -> None:
    object_bytes = args.layers * spec.kv_heads * spec.block_size * spec.head_dim * 2
    objects_per_rank = 2 * args.blocks  # K and V
    task_bytes = TP * objects_per_rank * object_bytes
    platform = CpuPlatform(instance=f"bench-storage-{time.monotonic_ns()}")
    buffers = [platform.host_alloc(objects_per_rank * object_bytes) for _ in range(TP)]
    for b in buffers:
        view = platform.host_buffer(b, objects_per_rank * object_bytes)
        view[:] = np.random.default_rng(1).integers(0, 256, view.size, dtype=np.uint8)
    ptrs = [[b + i * object_bytes for i in range(objects_per_rank)] for b in buffers]
    paths = ["auto"] + (["direct"] if args.direct else [])
    raw: dict[str, list[float]] = {}
    try:
        with LocalMooncakeMaster(lease_ttl_ms=10000) as master:
            options = {**master.config(), "global_segment_size": SEGMENT, "local_buffer_size": 64 << 20,
                       **args.mooncake_option}
            stores = [MooncakeStore(namespace="bench", rank=r, options=options) for r in range(TP)]
            try:
                for s, b in zip(stores, buffers):
                    s.register_buffer(b, objects_per_rank * object_bytes)
                for path in paths:
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
                    if path == "auto":
                        raw = {"write": times["raw"][0], "read": times["raw"][1]}
                    w, r = median_gbps(task_bytes, times["raw"][0]), median_gbps(task_bytes, times["raw"][1])
                    tw, tr = median_gbps(task_bytes, times["task"][0]), median_gbps(task_bytes, times["task"][1])
                    out[f"mooncake_task_{path}_write_gbps"], out[f"mooncake_task_{path}_read_gbps"] = tw, tr
                    out[f"mooncake_task_{path}_write_ratio"], out[f"mooncake_task_{path}_read_ratio"] = tw / w, tr / r
                    print(f"{path:6s} path: raw write {w:5.2f} GB/s, task {tw:5.2f} GB/s ({tw / w:.2f}x) | "
                          f"raw read {r:5.2f} GB/s, task {tr:5.2f} GB/s ({tr / r:.2f}x)", flush=True)
            finally:
                for s in stores:
                    s.close()
    finally:
        for b in buffers:
            platform.host_free(b)
    out["mooncake_raw_write_gbps"] = median_gbps(task_bytes, raw["write"])
    out["mooncake_raw_read_gbps"] = median_gbps(task_bytes, raw["read"])
    out["mooncake_raw_put_over_get"] = out["mooncake_raw_write_gbps"] / out["mooncake_raw_read_gbps"]
    # The headline is the path auto takes, against the raw rounds of its own run.
    out["mooncake_default_write_ratio"] = out["mooncake_task_auto_write_ratio"]
    out["mooncake_default_read_ratio"] = out["mooncake_task_auto_read_ratio"]
    print(f"mooncake default path ({out['default_path']}): write {out['mooncake_default_write_ratio']:.2f}x, "
          f"read {out['mooncake_default_read_ratio']:.2f}x raw (target >= 0.9); raw put/get "
          f"{out['mooncake_raw_put_over_get']:.2f}", flush=True)


def raw_file_round(root: str, shards: list[np.ndarray], backs: list[np.ndarray], tag: str) -> tuple[float, float]:
    """The file backend's raw floor for one task: each rank's bytes written as one new file plus one
    fsync, then read back into ``backs`` (faulted in already, as the device blocks a task reads into
    are), the ranks in parallel threads as the CTMs run."""
    paths = [os.path.join(root, f"raw-{tag}-rank{r}") for r in range(len(shards))]
    w = timed(lambda: parallel([functools.partial(write_new_file, p, a) for p, a in zip(paths, shards)]))
    r = timed(lambda: parallel([functools.partial(read_whole_file, p, b) for p, b in zip(paths, backs)]))
    if not all(np.array_equal(a, b) for a, b in zip(shards, backs)):
        raise RuntimeError("raw file round read back other bytes")
    for b in backs:
        b.fill(0)
    for path in paths:
        os.unlink(path)
    return w, r


def file_rounds(args: argparse.Namespace, spec: CacheSpec, out: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-file-") as root:
        out["file"] = []
        for object_bytes in FILE_OBJECT_BYTES:
            with tempfile.TemporaryDirectory(dir=root) as sub:
                r = file_ratios(sub, object_bytes, args.file_mib << 20, args.reps)
            out["file"].append(r)
            print(f"file {object_bytes >> 10:4d} KiB x {r['objects']:5d}: write {r['store_write_gbps']:5.2f} GB/s vs raw "
                  f"{r['raw_write_gbps']:5.2f} ({r['write_ratio']:.2f}x, target >= 0.7) | read "
                  f"{r['store_read_gbps']:5.2f} vs raw {r['raw_read_gbps']:5.2f} ({r['read_ratio']:.2f}x, "
                  f"target >= 0.8)", flush=True)
        big = out["file"][-1]
        out.update(file_write_gbps=big["store_write_gbps"], file_read_gbps=big["store_read_gbps"])
        if args.no_file_tasks:
            return
        task_bytes = TP * 2 * args.blocks * args.layers * spec.kv_heads * spec.block_size * spec.head_dim * 2
        with CacheTransferService(spec, tp=TP, storage_backend="file", storage_options={"root": root},
                                  model_id="bench/file", task_timeout=120,
                                  max_model_len=spec.block_size * args.blocks) as svc:
            fill_caches(svc)
            shards = [np.random.default_rng(r).integers(0, 256, task_bytes // TP, dtype=np.uint8) for r in range(TP)]
            backs = [np.ones_like(a) for a in shards]
            times = interleaved(args.file_task_reps, {
                "raw": lambda tag: raw_file_round(root, shards, backs, tag),
                "task": lambda tag: task_round(svc, args.blocks, f"file-{tag}"),
            })
        w, r = median_gbps(task_bytes, times["raw"][0]), median_gbps(task_bytes, times["raw"][1])
        tw, tr = median_gbps(task_bytes, times["task"][0]), median_gbps(task_bytes, times["task"][1])
        out.update(file_task_write_gbps=tw, file_task_read_gbps=tr, file_raw_write_gbps=w, file_raw_read_gbps=r,
                   file_default_write_ratio=tw / w, file_default_read_ratio=tr / r)
        print(f"file default path (staged, {args.blocks} blocks, TP={TP}, median of {args.file_task_reps}): "
              f"raw write {w:5.2f} GB/s, task {tw:5.2f} GB/s "
              f"({tw / w:.2f}x) | raw read {r:5.2f} GB/s, task {tr:5.2f} GB/s ({tr / r:.2f}x) (target >= 0.9)",
              flush=True)


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--mooncake-option {text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per task")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--file-mib", type=int, default=64, help="MiB per file store batch")
    parser.add_argument("--file-task-reps", type=int, default=15,
                        help="repetitions of the file backend's default-path rounds (each takes tens of ms, and "
                             "a 2-core machine's drift needs more of them for a steady median)")
    parser.add_argument("--direct", action="store_true", help="also measure the opt-in direct path (not the headline)")
    parser.add_argument("--only", choices=("mooncake", "file"), help="run one part only")
    parser.add_argument("--no-file-tasks", action="store_true", help="skip the file backend's CTM tasks")
    parser.add_argument("--mooncake-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Mooncake store option for every client, e.g. segment_prefault=off, io_thread_nice=0")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    try:
        args.mooncake_option = dict(_option(o) for o in args.mooncake_option)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.blocks, args.layers, args.reps, args.file_mib, args.file_task_reps) < 1:
        parser.error("--blocks, --layers, --reps, --file-mib and --file-task-reps must be positive")
    _common.setup_logging(args.verbose)
    spec = CacheSpec(num_layers=args.layers, num_blocks=2 * args.blocks, kv_heads=8, block_size=64, head_dim=128)
    object_bytes = args.layers * spec.kv_heads * spec.block_size * spec.head_dim * 2
    # What --storage_transfer auto chooses for Mooncake on this platform: the path measured below.
    out: dict = {"default_path": resolve_transfer("auto", MooncakeStore, CpuPlatform)}
    if args.mooncake_option:
        out["mooncake_options"] = args.mooncake_option
    print(f"TP={TP}, {args.layers} layers, {object_bytes // 1024} KiB per object, {args.blocks} blocks per task "
          f"({TP * 2 * args.blocks * object_bytes / 2**20:.0f} MiB per task), median of {args.reps}", flush=True)
    if args.only != "file":
        mooncake_rounds(args, spec, out)
    if args.only != "mooncake":
        file_rounds(args, spec, out)

    print(json.dumps(rounded(out)))


if __name__ == "__main__":
    main()
