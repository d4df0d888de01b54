#!/usr/bin/env python3
"""One engine instance of a cache layout preset at full scale on one host (issue 35 item 6).

Default: DeepSeek-V3 (61 layers + 1 MTP layer, MLA latent 512 + rope 64, 128-token pages) at TP 8
with --blocks 8 device blocks and as many host slots per rank, real CTM processes (CPU platform).
Per repetition, on a fresh instance each time, in one run:
  start        engine side: the constructor and ``start()`` until every rank is ready
  CTM memory   Rss and Pss of each rank process (/proc/<pid>/smaps_rollup) after start and after
               the swaps; Pss counts a page shared by N processes as 1/N (the device caches are
               shared memory, mapped by the engine and by its rank)
  descriptors  the engine process's open descriptors (/proc/self/fd), and how many the instance added
  swap         one whole-cache swap: every block of every layer and group of every rank out to the
               host (``swap_to_cpu``) and back (``swap_to_gpu``), after one untimed warm-up
  memcpy       the floor: a numpy copy of a buffer of the same bytes, out and back (two copies)
  swap_over_memcpy = swap / memcpy (1: as fast as one thread copying the same bytes, in this process)
Swap and memcpy alternate --swaps times per instance (their medians); every figure is then the
median over --repeats instances.  Prints a readable summary, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _common import quiet_paddle, setup_logging  # first: puts the repo on sys.path

quiet_paddle()

import numpy as np  # noqa: E402

from cache_manager.cache_presets import PRESETS, preset  # noqa: E402
from engine_hooks import CacheTransferService  # noqa: E402

MiB = 1 << 20
TIMEOUT = 300.0


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def memory_kib(pid: int | str) -> dict[str, int]:
    """Rss, Pss and Pss's anonymous, file and shared-memory parts of a process, in KiB (smaps_rollup)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
                out[name] = int(rest.split()[0])
    return out


def ctm_memory(svc: CacheTransferService) -> list[dict[str, int]]:
    return [memory_kib(pid) for _, pid in sorted(svc.pids().items())]


def fill(svc: CacheTransferService, seed: int) -> int:
    """Random bytes in every device cache (no zero pages, no first-touch faults in the swaps); returns their bytes."""
    rng = np.random.default_rng(seed)
    total = 0
    for caches in svc.caches.tensors:
        for layers in caches.values():
            for tensor in layers:
                view = svc.platform.raw_view(tensor)
                view[:] = np.frombuffer(rng.bytes(view.size), np.uint8).reshape(view.shape)
                total += view.size
    return total


def whole_swap(svc: CacheTransferService, blocks: list[int], slots: list[int]) -> float:
    t0 = time.perf_counter()
    svc.swap_to_cpu(blocks, slots).result(timeout=TIMEOUT)
    svc.swap_to_gpu(blocks, slots).result(timeout=TIMEOUT)
    return time.perf_counter() - t0


def memcpy_floor(src: np.ndarray, dst: np.ndarray) -> float:
    """A numpy copy of the cache's bytes out and back, as the swap moves them."""
    t0 = time.perf_counter()
    np.copyto(dst, src)
    np.copyto(src, dst)
    return time.perf_counter() - t0


def one_run(args: argparse.Namespace, seed: int) -> dict:
    fds_before = open_descriptors()
    t0 = time.perf_counter()
    layout = preset(args.preset, num_blocks=args.blocks, tp=args.tp)
    svc = CacheTransferService(layout, tp=args.tp, num_cpu_blocks=args.blocks, task_timeout=TIMEOUT,
                               ready_timeout=TIMEOUT)
    try:
        svc.start()
        start_s = time.perf_counter() - t0
        fds = open_descriptors()
        mem_start = ctm_memory(svc)
        cache_bytes = fill(svc, seed)
        blocks = list(range(args.blocks))
        src, dst = np.full(cache_bytes, 1, np.uint8), np.full(cache_bytes, 2, np.uint8)  # pages written
        whole_swap(svc, blocks, blocks)  # warm-up: the host slots' first touch
        swaps, copies = [], []
        for _ in range(args.swaps):  # alternating: the shared machine's drift hits both alike
            swaps.append(whole_swap(svc, blocks, blocks))
            copies.append(memcpy_floor(src, dst))
        del src, dst
        swap_s, memcpy_s = statistics.median(swaps), statistics.median(copies)
        mem_swap = ctm_memory(svc)
        engine = memory_kib("self")
        return {"layers": layout.total_layers, "groups": [g.name for g in layout.groups],
                "cache_mib_all_ranks": cache_bytes / MiB, "start_s": start_s, "engine_fds": fds,
                "engine_fds_added": fds - fds_before, "engine_rss_mib": engine["Rss"] / 1024,
                "ctm_rss_mib_start": statistics.median(m["Rss"] for m in mem_start) / 1024,
                "ctm_pss_mib_start": statistics.median(m["Pss"] for m in mem_start) / 1024,
                "ctm_rss_mib": statistics.median(m["Rss"] for m in mem_swap) / 1024,
                "ctm_pss_mib": statistics.median(m["Pss"] for m in mem_swap) / 1024,
                "ctm_pss_anon_mib": statistics.median(m.get("Pss_Anon", 0) for m in mem_swap) / 1024,
                "ctm_pss_file_mib": statistics.median(m.get("Pss_File", 0) for m in mem_swap) / 1024,
                "ctm_pss_shmem_mib": statistics.median(m.get("Pss_Shmem", 0) for m in mem_swap) / 1024,
                "ctm_rss_mib_max": max(m["Rss"] for m in mem_swap) / 1024,
                "swap_s": swap_s, "memcpy_s": memcpy_s, "swap_over_memcpy": swap_s / memcpy_s,
                "swap_gbps": 2 * cache_bytes / swap_s / 1e9}
    finally:
        svc.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--blocks", type=int, default=8, help="device blocks per rank (and host slots)")
    p.add_argument("--repeats", type=int, default=3, help="fresh instances; figures are their medians")
    p.add_argument("--swaps", type=int, default=5, help="timed swaps (and memcpy floors) per instance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    if min(args.tp, args.blocks, args.repeats, args.swaps) < 1:
        p.error("--tp, --blocks, --repeats and --swaps must be positive")
    setup_logging(args.verbose)

    print(f"{args.preset} at TP {args.tp}, full layer count, {args.blocks} blocks and {args.blocks} host slots "
          f"per rank, {os.cpu_count()} cores; medians of {args.repeats} fresh instances, {args.swaps} swaps each",
          flush=True)
    print(f"{'run':>3} {'start':>7} {'fds':>5} {'CTM RSS':>9} {'CTM PSS':>9} {'swap':>9} {'memcpy':>9} {'ratio':>6}")
    runs = []
    for i in range(args.repeats):
        r = one_run(args, args.seed + i)
        runs.append(r)
        print(f"{i:>3} {r['start_s']:>6.1f}s {r['engine_fds']:>5} {r['ctm_rss_mib']:>5.0f} MiB {r['ctm_pss_mib']:>5.0f} MiB "
              f"{r['swap_s'] * 1e3:>7.0f}ms {r['memcpy_s'] * 1e3:>7.0f}ms {r['swap_over_memcpy']:>6.2f}", flush=True)

    med = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, (int, float))}
    first = runs[0]
    print(f"\n{first['layers']} layers x {len(first['groups'])} groups ({', '.join(first['groups'])}), "
          f"{med['cache_mib_all_ranks']:.0f} MiB of device cache over {args.tp} ranks")
    print(f"start (constructor + start until ready): {med['start_s']:.1f} s")
    print(f"per CTM after start: RSS {med['ctm_rss_mib_start']:.0f} MiB, PSS {med['ctm_pss_mib_start']:.0f} MiB")
    print(f"per CTM after the swaps: RSS {med['ctm_rss_mib']:.0f} MiB (max {med['ctm_rss_mib_max']:.0f}), "
          f"PSS {med['ctm_pss_mib']:.0f} MiB (anonymous {med['ctm_pss_anon_mib']:.0f}, "
          f"files {med['ctm_pss_file_mib']:.0f}, shared memory {med['ctm_pss_shmem_mib']:.0f})")
    print(f"engine: {med['engine_fds']:.0f} open descriptors ({med['engine_fds_added']:.0f} added by the instance), "
          f"RSS {med['engine_rss_mib']:.0f} MiB")
    print(f"whole-cache swap out and in: {med['swap_s'] * 1e3:.0f} ms ({med['swap_gbps']:.2f} GB/s); memcpy floor "
          f"{med['memcpy_s'] * 1e3:.0f} ms; swap/memcpy {med['swap_over_memcpy']:.2f}")
    print(json.dumps({"preset": args.preset, "tp": args.tp, "blocks": args.blocks, "repeats": args.repeats,
                      "swaps": args.swaps,
                      "layers": first["layers"], "groups": first["groups"],
                      **{k: round(v, 4) for k, v in med.items()}}))


if __name__ == "__main__":
    main()
