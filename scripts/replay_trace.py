#!/usr/bin/env python3
"""The main job: replay a request trace through the running system and report what tiered
caching buys.

An engine in miniature drives TP CTM processes through ``engine_hooks``: for each request
it looks its prefix up in a tiered prefix cache (device, host swap space, storage), loads
what is cached, verifies every loaded block's bytes against content derived from (block
hash, layer, rank, K/V), "computes" the misses by writing that content, and writes the
blocks through to storage when the request ends.  Real processes, real bytes, real storage.

Input: Mooncake-format JSONL (``timestamp``, ``input_length``, ``output_length``,
``hash_ids`` of 512-token prefix blocks) with ``--trace``; without it, a seeded multi-turn
workload of the same format.  Each 512-token hash block becomes ``--kv-blocks-per-hash`` KV
blocks; the model is scaled down with ``--num-layers`` and ``--block-bytes``.

Output: a progress bar, a summary table, ``--json`` (one final JSON line) and ``--plot``.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import _common
from _common import quiet_paddle

quiet_paddle()

import numpy as np  # noqa: E402

from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402
from engine_hooks.prefix_cache import TIERS, CapacityError, TieredPrefixCache  # noqa: E402
from transfer_factory.keys import chain_hash_ids  # noqa: E402

HASH_BLOCK_TOKENS = 512
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
KINDS = ("key_caches", "value_caches")
log = logging.getLogger("replay")


# ---------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Request:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple


class BadTraceLine(ValueError):
    pass


def parse_line(text: str, line: int) -> Request:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadTraceLine(f"line {line}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise BadTraceLine(f"line {line}: expected a JSON object, got {type(row).__name__}")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in row:
            raise BadTraceLine(f"line {line}: missing field {name!r}")
    for name in ("input_length", "output_length"):
        value = row[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadTraceLine(f"line {line}: {name} {value!r} must be a non-negative integer")
    if not isinstance(row["timestamp"], (int, float)) or isinstance(row["timestamp"], bool):
        raise BadTraceLine(f"line {line}: timestamp {row['timestamp']!r} must be a number")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, (int, str)) and not isinstance(h, bool) for h in ids):
        raise BadTraceLine(f"line {line}: hash_ids must be a list of block ids")
    return Request(line, float(row["timestamp"]), row["input_length"], row["output_length"], tuple(ids))


def load_trace(path: str, on_bad: str = "skip", limit: int | None = None) -> tuple[list[Request], list[str]]:
    """Requests of a JSONL trace and the problems found.  ``on_bad="error"`` stops at the first."""
    requests, problems = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            try:
                requests.append(parse_line(text, n))
            except BadTraceLine as exc:
                if on_bad == "error":
                    raise
                problems.append(str(exc))
    return requests, problems


def generate_workload(n: int, seed: int = 0) -> list[Request]:
    """A seeded multi-turn workload: conversations grow turn by turn over shared system prompts."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    system_prompts = [fresh(rng.randint(2, 6)) for _ in range(4)]
    sessions: list[list[int]] = []
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / 250.0)
        if sessions and rng.random() < 0.6:  # a follow-up turn of a live conversation
            s = rng.randrange(len(sessions))
            sessions[s] = sessions[s] + fresh(rng.randint(1, 4))
            ids = sessions[s]
            if len(ids) > 120:
                sessions.pop(s)
        else:
            ids = rng.choice(system_prompts) + fresh(rng.randint(1, 12))
            sessions.append(ids)
            if len(sessions) > 32:
                sessions.pop(0)
        out.append(Request(i + 1, round(t), len(ids) * HASH_BLOCK_TOKENS - rng.randint(0, 400),
                           rng.randint(1, 500), tuple(ids)))
    return out


def request_hashes(req: Request, kv_blocks_per_hash: int) -> list[str]:
    """Chained hashes of the request's KV blocks (each trace block split into sub-blocks)."""
    ids = req.hash_ids if kv_blocks_per_hash == 1 else [f"{h}:{j}" for h in req.hash_ids
                                                         for j in range(kv_blocks_per_hash)]
    return chain_hash_ids(ids)


# ---------------------------------------------------------------------------- content
class Content:
    """Deterministic bytes of every block: words = index * golden + tag(hash, layer, rank, kind)."""

    def __init__(self, svc: CacheTransferService):
        self.views = {}
        for rank, caches in enumerate(svc.caches.tensors):
            for kind in KINDS:
                for layer, t in enumerate(caches[kind]):
                    self.views[(rank, kind, layer)] = svc.platform.raw_view(t).view(np.uint64)
        words = next(iter(self.views.values())).shape[1]
        self.base = np.arange(words, dtype=np.uint64) * GOLDEN

    def _expected(self, hashes: list[str], rank: int, kind: str, layer: int) -> np.ndarray:
        salt = (rank << 40) | (KINDS.index(kind) << 32) | (layer << 48)
        tags = np.array([int(h[:16], 16) ^ salt for h in hashes], dtype=np.uint64)
        return self.base[None, :] + tags[:, None]

    def write(self, hashes: list[str], blocks: list[int]) -> None:
        if not blocks:
            return
        for (rank, kind, layer), view in self.views.items():
            view[blocks] = self._expected(hashes, rank, kind, layer)

    def verify(self, hashes: list[str], blocks: list[int]) -> np.ndarray:
        """Per block: True when every rank, kind and layer holds exactly the expected words."""
        ok = np.ones(len(blocks), dtype=bool)
        if not blocks:
            return ok
        for (rank, kind, layer), view in self.views.items():
            ok &= (view[blocks] == self._expected(hashes, rank, kind, layer)).all(axis=1)
        return ok


# ---------------------------------------------------------------------------- replay
class Progress:
    """A bar redrawn in place on a terminal; a line every 10 % anywhere else (logs, CI)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.last, self.last_decile = total, enabled and total > 0, 0.0, -1
        self.tty = sys.stderr.isatty()

    def update(self, done: int, hit_ratio: float, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        width = 30
        filled = int(width * done / self.total)
        text = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, hit ratio {hit_ratio:6.1%}"
        if self.tty:
            if now - self.last < 0.25 and not force and done != self.total:
                return
            self.last = now
            sys.stderr.write("\r" + text + ("\n" if done == self.total else ""))
        else:
            decile = done * 10 // self.total
            if decile == self.last_decile:
                return
            self.last_decile = decile
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def replay(svc: CacheTransferService, requests: list[Request], request_block_hashes: list[list[str]],
           args: argparse.Namespace) -> dict:
    """Replays ``requests``, whose block hashes ``request_block_hashes`` holds, in order."""
    cache = TieredPrefixCache(svc, args.device_blocks, args.host_blocks, write_policy=args.write_policy,
                              use_storage=args.storage != "none", task_timeout=args.task_timeout)
    content = Content(svc)
    tokens_per_block = HASH_BLOCK_TOKENS // args.kv_blocks_per_hash
    block_bytes = svc.tp * len(KINDS) * args.num_layers * args.block_bytes
    seen: set[str] = set()
    counts = collections.Counter()
    timeline = []
    verified = corrupt = skipped = theoretical_hits = saved_tokens = 0
    all_blocks = sum(len(h) for h in request_block_hashes)  # skipped requests' too: the ceiling's denominator
    ratio = 0.0
    progress = Progress(len(requests), not args.no_progress)
    t0 = time.perf_counter()
    for done, (req, hashes) in enumerate(zip(requests, request_block_hashes), start=1):
        ceiling = sum(h in seen for h in hashes)
        theoretical_hits += ceiling
        seen.update(hashes)
        try:
            lease = cache.acquire(hashes)
        except CapacityError as exc:
            log.warning("request on line %d skipped: %s", req.line, exc)
            skipped += 1
            continue
        hit_pos = [i for i, s in enumerate(lease.sources) if s != "miss"]
        ok = content.verify([hashes[i] for i in hit_pos], [lease.gpu_blocks[i] for i in hit_pos])
        verified += int(ok.sum())
        for i, good in zip(hit_pos, ok):
            if not good:
                corrupt += 1
                log.error("line %d block %d from %s has wrong bytes: recomputing it", req.line, i, lease.sources[i])
                lease.sources[i] = "miss"
        miss_pos = lease.positions("miss")
        content.write([hashes[i] for i in miss_pos], [lease.gpu_blocks[i] for i in miss_pos])
        per_tier = collections.Counter(lease.sources)
        counts.update(per_tier)
        for i, s in enumerate(lease.sources):
            if s != "miss":
                saved_tokens += max(0, min(tokens_per_block, req.input_length - i * tokens_per_block))
        cache.commit(lease)
        cache.release(lease)
        timeline.append((len(hashes), ceiling, per_tier))
        total_blocks = sum(counts.values())
        ratio = (total_blocks - counts["miss"]) / total_blocks if total_blocks else 0.0
        progress.update(done, ratio)
    cache.drain()
    elapsed = time.perf_counter() - t0
    blocks = sum(counts.values())
    lat = np.array(svc.latencies_ms) if svc.latencies_ms else np.zeros(1)
    st = cache.stats
    moved = {"bytes_d2h": st.swap_out_blocks * block_bytes, "bytes_h2d": st.swap_in_blocks * block_bytes,
             "bytes_to_storage": st.storage_write_blocks * block_bytes,
             "bytes_from_storage": st.storage_read_blocks * block_bytes}
    busy = svc.busy_seconds()
    result = {
        "requests": len(requests) - skipped, "skipped_requests": skipped, "blocks": blocks,
        "hit_blocks": blocks - counts["miss"],
        "hit_ratio": (blocks - counts["miss"]) / blocks if blocks else 0.0,
        "device_hit_ratio": counts["device"] / blocks if blocks else 0.0,
        "host_hit_ratio": counts["host"] / blocks if blocks else 0.0,
        "storage_hit_ratio": counts["storage"] / blocks if blocks else 0.0,
        "miss_ratio": counts["miss"] / blocks if blocks else 0.0,
        "theoretical_hit_ratio": theoretical_hits / all_blocks if all_blocks else 0.0,
        "prefill_tokens_saved": saved_tokens,
        "prefill_tokens_total": sum(r.input_length for r in requests),
        **moved,
        # bytes moved over the wall time during which any transfer task was in flight
        "transfer_gbps": sum(moved.values()) / busy / 1e9 if busy else 0.0, "transfer_busy_s": busy,
        "task_p50_ms": float(np.percentile(lat, 50)), "task_p99_ms": float(np.percentile(lat, 99)),
        "tasks": len(svc.latencies_ms), "verified_blocks": verified, "corrupt_blocks": corrupt,
        "dropped_blocks": st.dropped_blocks, "failed_loads": st.failed_loads,
        "elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed if elapsed else 0.0,
    }
    result["_timeline"] = timeline
    return result


def print_summary(r: dict, args: argparse.Namespace) -> None:
    gib = 2**30
    rows = [
        ("requests replayed", f"{r['requests']} ({r['skipped_requests']} skipped) in {r['elapsed_s']:.1f} s "
                              f"({r['requests_per_s']:.0f} req/s)"),
        ("KV blocks", f"{r['blocks']}  (TP={args.tp}, {args.num_layers} layers, {args.block_bytes} B per layer-block)"),
        ("hit ratio, all tiers", f"{r['hit_ratio']:7.2%}   (trace's ceiling {r['theoretical_hit_ratio']:.2%})"),
        ("  device", f"{r['device_hit_ratio']:7.2%}"),
        ("  host", f"{r['host_hit_ratio']:7.2%}"),
        ("  storage", f"{r['storage_hit_ratio']:7.2%}"),
        ("  miss (computed)", f"{r['miss_ratio']:7.2%}"),
        ("prefill tokens saved", f"{r['prefill_tokens_saved']:,} of {r['prefill_tokens_total']:,} "
                                 f"({r['prefill_tokens_saved'] / max(1, r['prefill_tokens_total']):.1%})"),
        ("moved device->host", f"{r['bytes_d2h'] / gib:8.3f} GiB"),
        ("moved host->device", f"{r['bytes_h2d'] / gib:8.3f} GiB"),
        ("moved to storage", f"{r['bytes_to_storage'] / gib:8.3f} GiB"),
        ("moved from storage", f"{r['bytes_from_storage'] / gib:8.3f} GiB"),
        ("transfer rate", f"{r['transfer_gbps']:.2f} GB/s while transferring ({r['transfer_busy_s']:.1f} s busy, "
                          f"{r['tasks']} tasks)"),
        ("task latency", f"p50 {r['task_p50_ms']:.2f} ms, p99 {r['task_p99_ms']:.2f} ms"),
        ("verified blocks", f"{r['verified_blocks']} bit-exact, {r['corrupt_blocks']} corrupt"),
    ]
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 50))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 50))


def plot(r: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = r["_timeline"]
    x = np.arange(1, len(timeline) + 1)
    totals = np.array([n for n, _, _ in timeline], dtype=float)
    ceiling = np.array([c for _, c, _ in timeline], dtype=float)
    per = {t: np.array([c[t] for _, _, c in timeline], dtype=float) for t in TIERS}
    window = max(1, len(timeline) // 40)
    kernel = np.ones(window)

    def rolling(a: np.ndarray) -> np.ndarray:
        return np.convolve(a, kernel, mode="same") / np.maximum(np.convolve(totals, kernel, mode="same"), 1)

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax1.stackplot(x, [rolling(per[t]) for t in TIERS[:3]], labels=["device", "host", "storage"],
                  colors=["#2b8cbe", "#7bccc4", "#f0a04b"])
    ax1.set_ylabel(f"hit ratio (rolling, {window} requests)")
    ax1.set_ylim(0, 1)
    ax1.legend(loc="upper left")
    cum_hits = np.cumsum(totals - per["miss"]) / np.cumsum(totals)
    ax2.plot(x, cum_hits, label="cumulative hit ratio", color="#084081")
    ax2.plot(x, np.cumsum(ceiling) / np.cumsum(totals), linestyle="--", color="grey",
             label="trace's ceiling (blocks seen before)")
    ax2.set_ylabel("hit ratio")
    ax2.set_xlabel("request")
    ax2.set_ylim(0, 1)
    ax2.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="Mooncake-format JSONL trace (default: a generated multi-turn workload)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="requests to replay (default: the whole trace, or 1000 generated)")
    p.add_argument("--on-bad-line", choices=["skip", "error"], default="skip",
                   help="a malformed trace line is reported and skipped, or stops the replay")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--block-bytes", type=int, default=4096, help="bytes of one layer's K (or V) block on one rank")
    p.add_argument("--kv-blocks-per-hash", type=int, default=1, help="KV blocks per 512-token trace block")
    p.add_argument("--device-blocks", type=int, default=1024, help="device tier capacity, blocks per rank")
    p.add_argument("--host-blocks", type=int, default=4096, help="host tier capacity, blocks per rank")
    p.add_argument("--unbounded", action="store_true", help="device tier large enough for every block of the run")
    p.add_argument("--storage", choices=["file", "mooncake", "none"], default="file")
    p.add_argument("--storage-root", help="FileStore directory (default: a temporary one, removed afterwards)")
    p.add_argument("--storage-capacity", default="4G", help="FileStore capacity per rank")
    p.add_argument("--storage-fsync", choices=["auto", "on", "off"], default="auto",
                   help="fsync every stored object (auto: only for a --storage-root that outlives the run)")
    p.add_argument("--write-policy", choices=["write_through", "none"], default="write_through")
    p.add_argument("--task-timeout", type=float, default=30.0)
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.add_argument("--plot", help="write a PNG: hit ratio over time and the tier breakdown")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _common.setup_logging(args.verbose)
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    for name in ("max_requests", "tp", "num_layers", "kv_blocks_per_hash", "device_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.host_blocks < 0:
        parser.error(f"--host-blocks {args.host_blocks} must not be negative")
    if HASH_BLOCK_TOKENS % args.kv_blocks_per_hash:
        parser.error(f"--kv-blocks-per-hash {args.kv_blocks_per_hash} must divide {HASH_BLOCK_TOKENS}")
    block_size = HASH_BLOCK_TOKENS // args.kv_blocks_per_hash
    if args.block_bytes <= 0 or args.block_bytes % (2 * block_size * 4):
        parser.error(f"--block-bytes {args.block_bytes} must be a positive multiple of {2 * block_size * 4} "
                     f"(bf16, {block_size} tokens per block, whole 8-byte words)")
    if args.trace:
        try:
            requests, problems = load_trace(args.trace, args.on_bad_line, args.max_requests)
        except BadTraceLine as exc:
            print(f"{args.trace}: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"cannot read trace: {exc}", file=sys.stderr)
            return 2
        for p in problems[:20]:
            print(f"{args.trace}: {p} (skipped)", file=sys.stderr)
        if len(problems) > 20:
            print(f"{args.trace}: {len(problems) - 20} more bad lines skipped", file=sys.stderr)
        source = os.path.basename(args.trace)
    else:
        requests = generate_workload(args.max_requests or 1000, args.seed)
        source = f"generated workload (seed {args.seed})"
    if not requests:
        print("no requests to replay", file=sys.stderr)
        return 2
    block_hashes = [request_hashes(r, args.kv_blocks_per_hash) for r in requests]
    unique = len({h for hashes in block_hashes for h in hashes})
    longest = max(len(r.hash_ids) for r in requests) * args.kv_blocks_per_hash
    device_blocks = max(args.device_blocks, longest)
    if args.unbounded:
        device_blocks = max(device_blocks, unique)
    spec = CacheSpec(num_layers=args.num_layers, num_blocks=device_blocks, kv_heads=1, block_size=block_size,
                     head_dim=args.block_bytes // (2 * block_size))
    args.device_blocks = device_blocks
    print(f"replaying {len(requests)} requests of {source}: TP={args.tp}, {args.num_layers} layers, "
          f"{args.block_bytes} B per layer-block, device {device_blocks} / host {args.host_blocks} blocks per rank, "
          f"storage {args.storage}", flush=True)

    tmp_root = None
    master = None
    storage_options: dict = {}
    try:
        if args.storage == "file":
            if args.storage_root:
                root = args.storage_root
            else:
                tmp_root = root = tempfile.mkdtemp(prefix="ctm-replay-store-")
            fsync = args.storage_fsync == "on" or (args.storage_fsync == "auto" and bool(args.storage_root))
            storage_options = {"root": root, "capacity_bytes": args.storage_capacity, "fsync": fsync}
        elif args.storage == "mooncake" and not (os.environ.get("MOONCAKE_CONFIG_PATH")
                                                 or os.environ.get("MOONCAKE_MASTER")
                                                 or os.environ.get("MOONCAKE_MASTER_SERVER_ADDR")):
            from transfer_factory.mooncake_master import LocalMooncakeMaster

            master = LocalMooncakeMaster().start()
            storage_options = {**master.config(), "global_segment_size": 1 << 30}
            print(f"started a local mooncake_master at {master.master_server_addr}", flush=True)
        with CacheTransferService(spec, tp=args.tp, num_cpu_blocks=args.host_blocks,
                                  storage_backend="none" if args.storage == "none" else args.storage,
                                  storage_options=storage_options, model_id=f"replay/{source}",
                                  max_model_len=longest * block_size, task_timeout=args.task_timeout) as svc:
            result = replay(svc, requests, block_hashes, args)
    finally:
        if master is not None:
            master.stop()
            master.cleanup()
        if tmp_root:
            shutil.rmtree(tmp_root, ignore_errors=True)
    print_summary(result, args)
    if args.plot:
        plot(result, args.plot, f"{source}: {result['requests']} requests, TP={args.tp}, storage {args.storage}")
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.items()
                          if not k.startswith("_")}))
    return 0 if result["corrupt_blocks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
