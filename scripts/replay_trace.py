#!/usr/bin/env python3
"""The main job: replay a request trace through the running system and report what tiered
caching buys.

An engine in miniature drives TP CTM processes through ``engine_hooks``: for each request
it looks its prefix up in a tiered prefix cache (device, host swap space, storage), loads
what is cached, verifies every loaded block's bytes against content derived from (block
hash, layer, rank, K/V), "computes" the misses by writing that content, and writes blocks to
storage as ``--write-policy`` says (through at each request's end by default; ``write_back``:
when they leave the host tier; ``write_through_selective``: once hit ``--write-threshold``
times).  Real processes, real bytes, real storage.

Input: Mooncake-format JSONL (``timestamp``, ``input_length``, ``output_length``,
``hash_ids`` of 512-token prefix blocks) with ``--trace``; without it, a seeded multi-turn
workload of the same format.  Each 512-token hash block becomes ``--kv-blocks-per-hash`` KV
blocks; the model is scaled down with ``--num-layers`` and ``--block-bytes`` (K and V on every
layer).

A 2026 model's cache layout (``--model PRESET``, ``cache_manager.cache_presets``): its groups (MLA
latent + rope, DSA indexers, sliding windows, compressed caches, linear-attention state), scaled
with ``--model-layers`` (its first layers) and ``--model-dim-scale`` (every hidden dimension
divided), replace ``--num-layers`` and ``--block-bytes``.  Every block group's tensor of every layer
on every rank is written and verified (a sliding-window group inside the request's window, its last
blocks, the only ones attention reads and storage keeps; a state group, one slot per request, is
left alone by the prefix cache's tiers, which move blocks, and moves with the request over ``--pd``,
which refuses such a layout between TP sizes, naming the group).  The JSON line adds
``model``, ``bytes_per_block`` and ``naive_bytes_per_block`` (every model layer holding the widest
layer's block groups uncompressed and whole: "all layers full"), and per tier (device->host,
host->device, to storage, from storage, P/D) ``bytes_per_request`` and ``naive_bytes_per_request``
(median, mean and total over the requests).

Output: a progress bar, a summary table, ``--json`` (one final JSON line) and ``--plot``.
Bytes moved and the transfer rate come from what every rank reports having moved
(``RankResult.bytes_moved``), not from what was asked.  ``verified_blocks`` counts blocks
transferred into device blocks (from host or storage) and found bit-exact; ``device_hits``
counts hits already on device, which moved no bytes.

Several instances (``--instances N --storage mooncake``, ``replay_instances.py``): N engine
processes, each with its own CTMs and Mooncake segments, share one master and one namespace;
``--route`` spreads the requests, ``--kill-instance-at K`` SIGKILLs one engine.  The JSON line adds
``instances``, ``cross_instance_hits`` (storage hits on blocks another instance computed),
``cross_instance_hit_ratio`` (over all blocks), ``lost_blocks`` and ``killed_instance``, with the
recovery after a kill.  Mooncake's own keys (segment, local buffer, replicas, lease and client TTL)
are ``--mooncake-*`` flags.

Prefill/decode (``--pd P:D``, ``replay_pd.py``): prefill instances serve the requests as above, then
hand each one's blocks to a decode instance (``--pd-mode pull|push``, ``--pd-transport``), which
verifies every block bit-exact; the JSON line adds the ``pd_*`` keys.

Leftovers: the default store root (a temporary directory) is removed when the replay ends,
fails, is interrupted, or is killed (a reaper process watches the replay, ``ops.procs``).
CTM logs, and a local Mooncake master's log, go to ``--log-dir`` (default ``$CTM_LOG_DIR``,
else ``./log``), never to the system's temp directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time

import _common
from _common import quiet_paddle

quiet_paddle()

from cache_manager.cache_presets import PRESETS, preset  # noqa: E402
from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402
from engine_hooks.prefix_cache import WRITE_POLICIES, CapacityError, TieredPrefixCache  # noqa: E402
from engine_hooks.service import default_log_dir  # noqa: E402
from engine_hooks.prefix_cache.write_policy import default_bounce_blocks  # noqa: E402
from ops.procs import PathReaper  # noqa: E402
import replay_events  # noqa: E402
import replay_instances  # noqa: E402
import replay_pd  # noqa: E402
import replay_records  # noqa: E402
import replay_tenants  # noqa: E402
from replay_report import report  # noqa: E402
from replay_workload import (HASH_BLOCK_TOKENS, BadTraceLine, ByteLedger, Content, Request, Tally,  # noqa: E402
                             generate_workload, load_trace, model_result, naive_block_bytes, request_hashes,
                             serve_request, summarize)

log = logging.getLogger("replay")


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
    events = replay_events.ReplayEvents(args.kv_events)  # --kv-events: a publisher and a router-like index
    cache = TieredPrefixCache(svc, args.device_blocks, args.host_blocks, write_policy=args.write_policy,
                              write_threshold=args.write_threshold, use_storage=args.storage != "none",
                              task_timeout=args.task_timeout, kv_events=events.publisher)
    content = Content(svc)
    steps = replay_tenants.plan(requests, request_block_hashes, args.tenants)
    tally = Tally([r for r, _, _ in steps], [h for _, h, _ in steps], args.kv_blocks_per_hash)
    tenants = replay_tenants.TenantTally()
    ledger = ByteLedger(svc.tp * naive_block_bytes(svc.layout)) if args.model else None
    progress = Progress(len(steps), not args.no_progress)
    t0 = time.perf_counter()
    for done, (req, hashes, tenant) in enumerate(steps, start=1):
        ceiling = tally.ceiling(tenant.content_keys(hashes) if tenant else hashes)
        try:
            served = serve_request(cache, content, req.line, hashes, log, tenant)
        except CapacityError as exc:
            log.warning("request on line %d skipped: %s", req.line, exc)
            tally.skipped += 1
            served = None
        if ledger is not None:
            ledger.add(dataclasses.asdict(cache.stats))
        if served is None:
            continue
        tally.add(req, served, ceiling)
        tenants.add(tenant, served.sources, ceiling, served.cross_tenant)
        progress.update(done, tally.hit_ratio())
        events.poll()
    if not cache.drain():
        log.warning("storage writes or late tasks still outstanding at the end of the replay")
    elapsed = time.perf_counter() - t0
    stats = dataclasses.asdict(cache.stats)
    block_bytes = svc.tp * svc.layout.bytes_per_block()  # every group and layer, every rank
    result = summarize(tally, stats, svc.latencies_ms, svc.busy_seconds(), block_bytes,
                       elapsed, args, bounce_blocks=cache.block_counts()["bounce"], metrics_port=svc.metrics_port)
    if ledger is not None:
        ledger.close(stats)
        result.update(model_result(args.model, svc.layout, svc.tp, args, ledger))
    result.update(tenants.result(args.tenants))
    result["slowest_requests"] = replay_records.slowest([("engine", svc)])  # per-request transfer timelines
    result.update(events.finish(cache))
    result["_timeline"] = tally.timeline
    return result


# ---------------------------------------------------------------------------- run
def run_with_storage(args: argparse.Namespace, spec, requests: list[Request],
                     block_hashes: list[list[str]], source: str, max_model_len: int) -> dict:
    """Start the storage the replay needs, the CTMs, replay, and leave nothing temporary behind."""
    log_dir = os.path.abspath(args.log_dir) if args.log_dir else default_log_dir()
    reaper = None
    master = None
    storage_options: dict = {}
    result: dict | None = None
    try:
        if args.storage == "file":
            if args.storage_root:
                root = args.storage_root
            else:
                root = tempfile.mkdtemp(prefix="ctm-replay-store-")
                # removes the root however the replay ends, SIGKILL included
                reaper = PathReaper([root])
            fsync = args.storage_fsync == "on" or (args.storage_fsync == "auto" and bool(args.storage_root))
            storage_options = {"root": root, "capacity_bytes": args.storage_capacity, "fsync": fsync}
        elif args.storage == "mooncake":
            if not (os.environ.get("MOONCAKE_CONFIG_PATH") or os.environ.get("MOONCAKE_MASTER")
                    or os.environ.get("MOONCAKE_MASTER_SERVER_ADDR")):
                os.makedirs(log_dir, exist_ok=True)
                master = replay_instances.start_local_master(args, log_dir)
                print(f"started a local mooncake_master at {master.master_server_addr}", flush=True)
            storage_options = replay_instances.mooncake_options(args, master)
        if args.pd:
            return replay_pd.run(args, spec, requests, block_hashes, source, max_model_len, storage_options, log_dir,
                                 Progress(len(requests), not args.no_progress), reaper)
        if args.instances > 1:
            return replay_instances.run(args, spec, requests, block_hashes, source, max_model_len, storage_options,
                                        master, log_dir, Progress(len(requests), not args.no_progress))
        with CacheTransferService(spec, tp=args.tp, num_cpu_blocks=args.host_blocks,
                                  storage_backend="none" if args.storage == "none" else args.storage,
                                  storage_options=storage_options, model_id=f"replay/{source}",
                                  max_model_len=max_model_len, task_timeout=args.task_timeout,
                                  log_dir=log_dir, metrics_port=args.metrics_port, record_latencies=True) as svc:
            if reaper is not None:
                for pid in svc.pids().values():  # a CTM that outlives a killed replay may still write there
                    reaper.watch(pid)
            if svc.metrics_port is not None:
                print(f"metrics at http://127.0.0.1:{svc.metrics_port}/metrics", flush=True)
            result = replay(svc, requests, block_hashes, args)
            if svc.metrics_port is not None and args.metrics_linger > 0:
                report(result, args, source)  # the summary first, then the endpoint stays up to be scraped
                result["_reported"] = True
                print(f"metrics stay at http://127.0.0.1:{svc.metrics_port}/metrics for {args.metrics_linger:g}s",
                      flush=True)
                time.sleep(args.metrics_linger)
            return result
    finally:
        if master is not None:
            master.stop()
            master.cleanup()
        if reaper is not None:
            t0 = time.perf_counter()
            reaper.close()
            if result is not None:  # what removing the run's store took (a segment store: a few files)
                result["store_cleanup_s"] = time.perf_counter() - t0


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
    p.add_argument("--num-layers", type=int, default=4, help="layers of the K/V model (not with --model)")
    p.add_argument("--block-bytes", type=int, default=4096,
                   help="bytes of one layer's K (or V) block on one rank (not with --model)")
    p.add_argument("--model", choices=list(PRESETS), default=None,
                   help="replay a 2026 model's cache layout (cache_manager.cache_presets) instead of K/V on every "
                        "layer: every block group of every layer written and verified; the JSON line adds the "
                        "bytes each tier moved per request against a naive all-layers-full layout")
    p.add_argument("--model-layers", type=int, default=4,
                   help="--model: keep the first N layers of the model's pattern (default 4: deepseek-v4 has both "
                        "compressions, qwen3-next one full-attention layer)")
    p.add_argument("--model-dim-scale", type=int, default=32,
                   help="--model: divide every hidden dimension by S (default 32: every preset's dimensions divide "
                        "exactly, so its ratios hold, and a 128-token block is 4-23 KiB per rank)")
    p.add_argument("--kv-blocks-per-hash", type=int, default=None,
                   help="KV blocks per 512-token trace block (default 1; with --model, 512 / the layout's block "
                        "tokens, i.e. 4 pages of 128 tokens: a block holds the tokens the model's page holds, so "
                        "windows and compression cover the trace's tokens; 1 makes each page stand for 512 tokens)")
    p.add_argument("--device-blocks", type=int, default=1024, help="device tier capacity, blocks per rank")
    p.add_argument("--host-blocks", type=int, default=4096, help="host tier capacity, blocks per rank")
    p.add_argument("--unbounded", action="store_true", help="device tier large enough for every block of the run")
    p.add_argument("--storage", choices=["file", "mooncake", "none"], default="file")
    p.add_argument("--storage-root", help="FileStore directory (default: a temporary one, removed afterwards)")
    p.add_argument("--storage-capacity", default=None,
                   help="FileStore capacity per rank (default 4G; with --model, more where the run's distinct "
                        "blocks need it, so the store evicts nothing)")
    p.add_argument("--storage-fsync", choices=["auto", "on", "off"], default="auto",
                   help="fsync every stored object (auto: only for a --storage-root that outlives the run)")
    p.add_argument("--write-policy", choices=list(WRITE_POLICIES), default="write_through",
                   help="when blocks go to storage: at each request's end (write_through), when they leave "
                        "the host tier (write_back), once hit --write-threshold times (write_through_selective)")
    p.add_argument("--write-threshold", type=int, default=2,
                   help="hits after which write_through_selective writes a block (default 2)")
    p.add_argument("--task-timeout", type=float, default=30.0)
    p.add_argument("--log-dir", help="CTM and local master logs (default: $CTM_LOG_DIR, else ./log)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this loopback port during the replay (0 picks one)")
    p.add_argument("--metrics-linger", type=float, default=0.0,
                   help="keep the metrics endpoint up this many seconds after the summary")
    replay_instances.add_arguments(p)
    replay_pd.add_arguments(p)
    replay_events.add_arguments(p)
    replay_tenants.add_arguments(p)
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
    if args.kv_blocks_per_hash is None:
        args.kv_blocks_per_hash = HASH_BLOCK_TOKENS // preset(args.model).block_size if args.model else 1
    for name in ("max_requests", "tp", "num_layers", "kv_blocks_per_hash", "device_blocks", "model_layers",
                 "model_dim_scale"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.host_blocks < 0:
        parser.error(f"--host-blocks {args.host_blocks} must not be negative")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port {args.metrics_port} must be a port number (0 picks a free one)")
    if args.metrics_linger < 0:
        parser.error(f"--metrics-linger {args.metrics_linger} must not be negative")
    if args.write_threshold < 1:
        parser.error(f"--write-threshold {args.write_threshold} must be positive")
    replay_instances.check_arguments(parser, args)
    if args.model and args.kill_instance_at is not None:
        parser.error("--kill-instance-at counts the blocks the pool lost by K/V keys: not with --model")
    replay_pd.check_arguments(parser, args)
    replay_events.check_arguments(parser, args)
    replay_tenants.check_arguments(parser, args)
    if HASH_BLOCK_TOKENS % args.kv_blocks_per_hash:
        parser.error(f"--kv-blocks-per-hash {args.kv_blocks_per_hash} must divide {HASH_BLOCK_TOKENS}")
    block_size = HASH_BLOCK_TOKENS // args.kv_blocks_per_hash
    if args.model is None and (args.block_bytes <= 0 or args.block_bytes % (2 * block_size * 4)):
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
    if args.kill_instance_at is not None and args.kill_instance_at > len(requests):
        parser.error(f"--kill-instance-at {args.kill_instance_at}: the replay has {len(requests)} requests")
    block_hashes = [request_hashes(r, args.kv_blocks_per_hash) for r in requests]
    unique = len({h for hashes in block_hashes for h in hashes}) * args.tenants  # each tenant's blocks are its own
    longest = max(len(r.hash_ids) for r in requests) * args.kv_blocks_per_hash
    device_blocks = max(args.device_blocks, longest)
    if args.unbounded:
        device_blocks = max(device_blocks, unique)
    # write_back keeps a few device blocks apart to write host blocks back through: the longest
    # request must still fit in the rest
    bounce = default_bounce_blocks(args.write_policy, device_blocks, args.host_blocks, args.storage != "none")
    device_blocks = max(device_blocks, longest + bounce)
    if args.model:
        spec = preset(args.model, num_blocks=device_blocks, layers=args.model_layers, dim_scale=args.model_dim_scale,
                      tp=args.tp)
        block_size = spec.block_size
        what = (f"{args.model} ({spec.total_layers} layers, dimensions / {args.model_dim_scale}, "
                f"{spec.bytes_per_block():,} B per block per rank, {args.kv_blocks_per_hash} per trace block)")
    else:
        spec = CacheSpec(num_layers=args.num_layers, num_blocks=device_blocks, kv_heads=1, block_size=block_size,
                         head_dim=args.block_bytes // (2 * block_size))
        what = f"{args.num_layers} layers, {args.block_bytes} B per layer-block"
    if args.storage_capacity is None:
        args.storage_capacity = storage_capacity(spec if args.model else None, unique)
    args.device_blocks = device_blocks
    print(f"replaying {len(requests)} requests of {source}: TP={args.tp}, {what}, device {device_blocks} / host "
          f"{args.host_blocks} blocks per rank, storage {args.storage}"
          + (f", {args.instances} instances" if args.instances > 1 else ""), flush=True)

    try:
        result = run_with_storage(args, spec, requests, block_hashes, source, longest * block_size)
    except KeyboardInterrupt:
        print("interrupted: CTMs stopped, temporary store removed", file=sys.stderr)
        return 130
    if not result.get("_reported"):
        report(result, args, source)
    return 0 if result["corrupt_blocks"] == 0 and not result.get("pd_corrupt_blocks") \
        and not result.get("pd_corrupt_state_slots") else 1


def storage_capacity(layout, distinct_blocks: int) -> str | int:
    """The FileStore's capacity per rank: 4G, or with a model's layout, a quarter more than every
    distinct block of the run takes (so a full trace of a wide preset still reaches its ceiling)."""
    if layout is None:
        return "4G"
    return max(4 << 30, distinct_blocks * layout.bytes_per_block() * 5 // 4)



if __name__ == "__main__":
    sys.exit(main())
