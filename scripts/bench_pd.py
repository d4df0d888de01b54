#!/usr/bin/env python3
"""Prefill/decode transfers (DESIGN §3.11) against the floors of the same bytes, in one run (DESIGN §5).

"Block size" here is the bytes of ONE layer's K block on ONE rank (kv_heads x block_size x
head_dim x 2 bytes, bf16; head_dim 128).  V is the same size, so one block of one layer on one rank
is twice that, and one block of the whole model on one rank is 2 x L times that.  Default: 16 KiB
and 512 KiB, L = 8 layers, and as many blocks N as make a transfer move at least --mib MiB per rank
(16 KiB: 256 blocks, 512 KiB: 8 blocks), drawn at random (fresh ids each repetition, the same ids
for every figure of one repetition) from caches of 2N blocks on both sides.

Three real engine instances run on this host, each a ``CacheTransferService`` with its own CTMs
(TP = --tp): a decode instance D and two prefill instances, P-ipc linked to D over the same-host
path and P-te linked to D over the Mooncake Transfer Engine (TCP), so every figure of a repetition
is taken back to back (interleaved) without re-linking.  Per repetition, each timed from the engine:

  memcpy         floor: one contiguous copy of the same bytes (all ranks), ``_block_copy.copy_contiguous``
                 with the copy-thread count of the CTMs (CTM_COPY_THREADS or the cores, times TP)
  ipc_pull       D.pull_blocks from P-ipc, all layers and kinds, from the call to ``.result()``
  raw_read       floor: this process's own Transfer Engine does ``batch_transfer_sync_read`` from
                 P-te's rank engine into D's cache memory: the very runs the CTM builds (same
                 ``coalesce`` of the same ids: same number of runs, same bytes per run, same
                 addresses on both sides), ranks in parallel (batches: see --te-chunk below)
  te_pull        D.pull_blocks from P-te over the Transfer Engine, from the call to ``.result()``
  raw_write      floor: ``batch_transfer_sync_write`` of the same runs from P-te's memory into D's
                 rank engine, all layers
  ipc_push, te_push   whole push (``layerwise=False``): from ``push_blocks`` to the decode side's
                 ``target.wait_for_layer(L-1)`` returning
  ipc_push_lw, te_push_lw   layer-wise push: the engine "computes" layer i (a sleep of C ms) and then
                 calls ``future.layer_computed(i + 1)``, for i = 0..L-1; visible = time from the last
                 ``layer_computed(L)`` to ``target.wait_for_layer(L-1)`` returning, i.e. the part of
                 the transfer still visible after compute has ended
  kernel         diagnostic: the block copy a CTM runs for ipc_pull (``platform.run_plan`` of the same
                 plan, ids and copy threads), called here, without a task around it
  tiny_*         diagnostic: a pull of 1 block of 1 layer (fixed per-task cost), and one 8-byte
                 ``batch_transfer_sync_read`` (what one exposure-board check costs over the TE)

``batch_transfer_sync_*`` waits for its batch in a busy loop (GIL released); on a host with few
cores that loop takes a core from the transport's own threads, so this floor can be slower than
the CTM's sleeping poll (a ratio above 1 then says so, not that the CTM beats the engine).
Before the timed repetitions, two passes over complementary halves of the blocks touch every page
of every mapping (a CTM maps its peer's segments; a first touch faults), and one more pass on
random ids sizes C.

The raw floors submit at most --te-chunk 64 KiB slices per batch (several batches one after the
other when the runs need more): Mooncake 0.3.13's TCP transport queues at most 1024 + 1024 slices
per peer (``max_queued_transfers_per_peer``, ``max_pending_admissions_per_peer``) and FAILS the
rest of a larger batch ("TCP lane queue-full rejection").  A figure whose transfer fails in half
the repetitions or more is reported as null; every failure is counted under "errors".

C, the per-layer compute, is max(--compute-ms, --compute-factor x whole push / L) per transport,
measured in a warm-up, so compute covers the per-layer transfer as the target presumes.

Ratios (medians of --reps interleaved repetitions; targets from DESIGN §5):
  pd_ipc_over_memcpy       = memcpy / ipc_pull           >= 0.9
  pd_te_over_raw           = raw_read / te_pull          >= 0.9
  pd_push_ipc_over_memcpy  = memcpy / ipc_push           (push variant of the first)
  pd_push_te_over_raw      = raw_write / te_push         (push variant of the second)
  pd_push_visible_fraction = visible(layer-wise) / whole push   <= 1/L + 0.1
  pd_hetero_over_same_tp   = same-TP pull / P:D pull of the same bytes, same host   >= 0.8
                             (``bench_pd_tp.py``; ``pd_hetero_te_over_same_tp``: the Transfer Engine)
The top-level figures of the JSON line are the worst over the block sizes (and, for the visible
fraction, over both transports); per block size figures are under "results".  Prints a table of
GB/s, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import add_pd_size_arguments, per_rank, quiet_paddle, setup_logging

quiet_paddle()

import numpy as np  # noqa: E402

import bench_pd_tp  # noqa: E402
from engine_hooks import CacheSpec, CacheTransferService  # noqa: E402
from engine_hooks.pd import PrefillDecode  # noqa: E402
from ops import _block_copy  # noqa: E402
from ops.cpu import default_copy_threads  # noqa: E402
from ops.layout import CopyPlan, Side  # noqa: E402
from ops.modes import HOST_TO_DEVICE  # noqa: E402
from bench_pd_raw import TE_SLICE, RawTe, batches, local_bases, remote_bases, runs_for, te_params  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
HEAD_DIM, ITEM = 128, 2  # bf16
TIMEOUT = 120.0


def spec_for(block_bytes: int, layers: int, num_blocks: int) -> CacheSpec:
    """A model whose K block of one layer on one rank holds ``block_bytes``."""
    heads_x_tokens = block_bytes // (HEAD_DIM * ITEM)
    if heads_x_tokens * HEAD_DIM * ITEM != block_bytes:
        raise ValueError(f"block size {block_bytes} is not a multiple of {HEAD_DIM * ITEM} bytes")
    block_size = min(128, heads_x_tokens)
    if heads_x_tokens % block_size:
        raise ValueError(f"block size {block_bytes}: kv_heads x block_size = {heads_x_tokens} does not split")
    return CacheSpec(num_layers=layers, num_blocks=num_blocks, kv_heads=heads_x_tokens // block_size,
                     block_size=block_size, head_dim=HEAD_DIM)


def views(svc: CacheTransferService) -> list[dict[str, list[np.ndarray]]]:
    """Per rank, kind -> per-layer writable [num_blocks, block_bytes] views of the engine's caches."""
    return [{kind: [svc.platform.raw_view(t) for t in layers] for kind, layers in caches.items()}
            for caches in svc.caches.tensors]


def fill_random(services: list[CacheTransferService]) -> None:
    """Random bytes in every block of every service's caches: no zero pages, no first-touch faults."""
    for i, svc in enumerate(services):
        rng = np.random.default_rng(1000 + i)
        for rank_views in views(svc):
            for layers in rank_views.values():
                for v in layers:
                    v[:] = rng.integers(0, 256, v.shape, dtype=np.uint8)


def compute(seconds: float) -> None:
    """One layer's compute: a sleep (a GPU computing leaves the host's cores to the copy)."""
    time.sleep(seconds)


GBPS = ("memcpy", "kernel", "ipc_pull", "ipc_push", "raw_read", "te_pull", "raw_write", "te_push")


class Bench:
    def __init__(self, block_bytes: int, args: argparse.Namespace, log: logging.Logger):
        self.args = args
        self.tp, self.layers = args.tp, args.layers
        self.block_bytes = block_bytes
        self.n = max(1, -(-args.mib * MiB // (2 * args.layers * block_bytes)))  # blocks per transfer
        self.num_blocks = 2 * self.n
        self.spec = spec_for(block_bytes, args.layers, self.num_blocks)
        self.bytes = self.n * 2 * args.layers * block_bytes * args.tp  # all ranks, kinds, layers
        self.rng = np.random.default_rng(args.seed)
        self.services: list[CacheTransferService] = []
        self.sides: list[PrefillDecode] = []
        try:
            self._start(log)
        except BaseException:
            self.close()
            raise

    def _start(self, log: logging.Logger) -> None:
        def service() -> CacheTransferService:
            svc = CacheTransferService(self.spec, tp=self.tp, num_cpu_blocks=1, task_timeout=TIMEOUT).start()
            self.services.append(svc)
            return svc

        self.d_svc, self.pi_svc, self.pt_svc = service(), service(), service()
        self.d = PrefillDecode(self.d_svc, "decode")
        self.pi = PrefillDecode(self.pi_svc, "prefill-ipc")
        self.pt = PrefillDecode(self.pt_svc, "prefill-te")
        self.sides += [self.d, self.pi, self.pt]
        both = ["ipc", "mooncake"]
        assert self.d.link(self.pi.descriptor(["ipc"]), transport="ipc") == "ipc"
        assert self.pi.link(self.d.descriptor(["ipc"]), transport="ipc") == "ipc"
        assert self.d.link(self.pt.descriptor(both), transport="mooncake") == "mooncake"
        assert self.pt.link(self.d.descriptor(both), transport="mooncake") == "mooncake"
        fill_random(self.services)
        self.d_views, self.pt_views = views(self.d_svc), views(self.pt_svc)
        self.raw = RawTe(self.d_views, self.pt_views, log)
        self.pt_te, self.d_te = te_params(self.pt), te_params(self.d)
        self.threads = default_copy_threads() * self.tp
        self.kernel_plans = []  # per rank and kind: what PeerTransfers._copy_ipc runs
        for r in range(self.tp):
            pi_views, d_views = views(self.pi_svc)[r], self.d_views[r]
            for kind in d_views:
                def side(name: str, layers: list[np.ndarray]) -> Side:
                    return Side(name, np.asarray([int(v.ctypes.data) for v in layers], dtype=np.int64),
                                np.full(len(layers), self.num_blocks, dtype=np.int64), self.block_bytes)
                self.kernel_plans.append(CopyPlan(side(f"d {kind}", d_views[kind]), side(f"p {kind}", pi_views[kind]),
                                                  self.block_bytes, None))
        self.src_buf = np.ones(self.bytes, dtype=np.uint8)
        self.dst_buf = np.ones(self.bytes, dtype=np.uint8)

    # ------------------------------------------------------------------ one figure each
    def ids(self) -> tuple[list[int], list[int]]:
        src = self.rng.choice(self.num_blocks, self.n, replace=False).tolist()
        dst = self.rng.choice(self.num_blocks, self.n, replace=False).tolist()
        return src, dst

    def memcpy(self) -> None:
        _block_copy.copy_contiguous(int(self.dst_buf.ctypes.data), int(self.src_buf.ctypes.data), self.bytes,
                                    self.threads)

    def kernel(self, src: list[int], dst: list[int]) -> None:
        platform = self.d_svc.platform
        per_rank(lambda r: [platform.run_plan(plan, dst, src, HOST_TO_DEVICE)
                            for plan in self.kernel_plans[r * len(self.d_views[0]):(r + 1) * len(self.d_views[0])]],
                 self.tp)

    def pull(self, side: PrefillDecode, peer: str, src: list[int], dst: list[int], layers=None) -> None:
        handle = side.expose(f"req-{time.monotonic_ns()}")
        try:
            got = self.d.pull_blocks(peer, handle, src, dst, layers=layers, timeout=TIMEOUT).result(timeout=TIMEOUT)
        finally:
            side.retract(handle)
        if got != dst:
            raise RuntimeError(f"pull from {peer} loaded {len(got)} of {len(dst)} blocks")

    def read_runs(self, src: list[int], dst: list[int]) -> list[tuple]:
        """Per rank, the runs of a pull of ``src`` from P-te into ``dst`` of D (local = D)."""
        return [runs_for(local_bases(self.d_views[r]), remote_bases(self.pt_te[r], self.layers), self.block_bytes,
                         dst, src, range(self.layers)) for r in range(self.tp)]

    def write_runs(self, src: list[int], dst: list[int]) -> list[tuple]:
        """Per rank, the runs of a push of ``src`` of P-te into ``dst`` of D (local = P-te)."""
        return [runs_for(local_bases(self.pt_views[r]), remote_bases(self.d_te[r], self.layers), self.block_bytes,
                         src, dst, range(self.layers)) for r in range(self.tp)]

    def push(self, side: PrefillDecode, peer: str, src: list[int], dst: list[int], compute_s: float | None) -> float:
        """Whole push (``compute_s`` None): seconds from ``push_blocks`` to the last layer landed.
        Layer-wise: seconds from the last ``layer_computed`` to the last layer landed."""
        target = self.d.receive_push(peer, dst, timeout=TIMEOUT)
        try:
            if compute_s is None:
                t0 = time.perf_counter()
                future = side.push_blocks("decode", target.ticket, src, layerwise=False, timeout=TIMEOUT)
                target.wait_for_layer(self.layers - 1)
            else:
                future = side.push_blocks("decode", target.ticket, src, layerwise=True, timeout=TIMEOUT)
                for layer in range(self.layers):
                    compute(compute_s)
                    future.layer_computed(layer + 1)
                t0 = time.perf_counter()
                target.wait_for_layer(self.layers - 1)
            elapsed = time.perf_counter() - t0
            if future.result(timeout=TIMEOUT) != dst:
                raise RuntimeError(f"push from {peer} reported other blocks")
        finally:
            target.wait_released(TIMEOUT)
            target.close()
        return elapsed

    # ------------------------------------------------------------------ the run
    def figures(self, compute_s: dict[str, float] | None, errors: dict[str, str],
                ids: tuple[list[int], list[int]] | None = None) -> dict[str, float]:
        """One repetition of every figure, back to back, on the same fresh random ids.  A figure
        whose transfer fails is left out of this repetition and its error kept in ``errors``."""
        src, dst = ids or self.ids()
        chunk = self.args.te_chunk
        reads = [batches(runs, chunk) for runs in self.read_runs(src, dst)]
        writes = [batches(runs, chunk) for runs in self.write_runs(src, dst)]
        one_src, one_dst = src[:1], dst[:1]
        out: dict[str, float] = {}

        def timed(name: str, fn) -> None:
            try:
                t0 = time.perf_counter()
                value = fn()
                out[name] = time.perf_counter() - t0 if value is None else value
            except Exception as exc:  # noqa: BLE001  (reported, the other figures go on)
                errors.setdefault(name, f"{type(exc).__name__}: {exc}"[:300])

        timed("memcpy", self.memcpy)
        timed("kernel", lambda: self.kernel(src, dst))
        timed("ipc_pull", lambda: self.pull(self.pi, "prefill-ipc", src, dst))
        timed("raw_read", lambda: per_rank(lambda r: self.raw.read(self.pt_te[r]["address"], reads[r]), self.tp))
        timed("te_pull", lambda: self.pull(self.pt, "prefill-te", src, dst))
        timed("raw_write", lambda: per_rank(lambda r: self.raw.write(self.d_te[r]["address"], writes[r]), self.tp))
        timed("ipc_push", lambda: self.push(self.pi, "prefill-ipc", src, dst, None))
        timed("te_push", lambda: self.push(self.pt, "prefill-te", src, dst, None))
        if compute_s is not None:
            timed("ipc_push_lw", lambda: self.push(self.pi, "prefill-ipc", src, dst, compute_s["ipc"]))
            timed("te_push_lw", lambda: self.push(self.pt, "prefill-te", src, dst, compute_s["te"]))
        timed("tiny_ipc_pull", lambda: self.pull(self.pi, "prefill-ipc", one_src, one_dst, layers=(0, 1)))
        timed("tiny_te_pull", lambda: self.pull(self.pt, "prefill-te", one_src, one_dst, layers=(0, 1)))
        timed("tiny_raw_word", lambda: self.raw.word(self.pt_te[0]["address"], int(self.pt_te[0]["board"])))
        return out

    def run(self) -> dict:
        args = self.args
        errors: dict[str, str] = {}
        # Warm-up: two passes over complementary halves of the blocks touch every page of every
        # mapping (a CTM maps its peer's segments: the first touch of a page faults), then one
        # pass on random ids sizes the compute.
        halves = self.rng.permutation(self.num_blocks)
        for half in (halves[:self.n].tolist(), halves[self.n:2 * self.n].tolist()):
            self.figures(None, errors, (half, half[::-1]))
        warm = [self.figures(None, errors)]
        compute_s = {}
        for t in ("ipc", "te"):
            whole = [w[f"{t}_push"] for w in warm if f"{t}_push" in w]
            compute_s[t] = max(args.compute_ms / 1e3, args.compute_factor * min(whole, default=0.0) / self.layers)
        times: dict[str, list[float]] = {}
        warm_errors, errors = errors, {}
        for _ in range(args.reps):
            for name, seconds in self.figures(compute_s, errors).items():
                times.setdefault(name, []).append(seconds)
        med = {name: statistics.median(ts) for name, ts in times.items() if len(ts) * 2 > args.reps}
        errors = {name: f"{args.reps - len(times.get(name, []))} of {args.reps} failed, first: {e}"
                  for name, e in errors.items()}
        errors.update({name: f"in the warm-up: {e}" for name, e in warm_errors.items() if name not in errors})
        runs = self.read_runs(*self.ids())[0]
        r: dict = {"block_bytes": self.block_bytes, "blocks": self.n, "layers": self.layers,
                   "bytes_per_transfer": self.bytes, "runs_per_rank": len(runs[2]),
                   "te_slices_per_rank": sum(-(-n // TE_SLICE) for n in runs[2]),
                   "kv_heads": self.spec.kv_heads, "block_size": self.spec.block_size, "head_dim": HEAD_DIM,
                   "compute_ms": {t: round(c * 1e3, 3) for t, c in compute_s.items()}}
        for name in GBPS:
            r[f"{name}_gbps"] = self.bytes / med[name] / 1e9 if name in med else None
        for name in sorted(med):
            r[f"{name}_ms"] = med[name] * 1e3

        def ratio(a: str, b: str) -> float | None:
            return med[a] / med[b] if a in med and b in med else None

        r["pd_ipc_over_memcpy"] = ratio("memcpy", "ipc_pull")
        r["pd_te_over_raw"] = ratio("raw_read", "te_pull")
        r["pd_push_ipc_over_memcpy"] = ratio("memcpy", "ipc_push")
        r["pd_push_te_over_raw"] = ratio("raw_write", "te_push")
        r["pd_push_ipc_visible_fraction"] = ratio("ipc_push_lw", "ipc_push")
        r["pd_push_te_visible_fraction"] = ratio("te_push_lw", "te_push")
        r["kernel_over_memcpy"] = ratio("memcpy", "kernel")
        r["visible_bound"] = 1 / self.layers + 0.1
        r["errors"] = errors
        return r

    def close(self) -> None:
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()
        for side in reversed(self.sides):
            side.close()
        for svc in reversed(self.services):
            svc.shutdown()


def fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'fail':>{width}}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pd_size_arguments(p, mib=64, reps=15)
    p.add_argument("--compute-ms", type=float, default=5.0, help="least per-layer compute of the layer-wise push")
    p.add_argument("--compute-factor", type=float, default=1.2, help="per-layer compute over per-layer whole push")
    p.add_argument("--te-chunk", type=int, default=1024, help="most 64 KiB slices per raw Transfer Engine batch")
    p.add_argument("--tp-pairs", default="1:2,2:1,2:4,4:2",
                   help="prefill:decode TP pairs for pd_hetero_over_same_tp (bench_pd_tp.py; empty: skip)")
    p.add_argument("--tp-block-kib", type=float, default=64, help="the TP pairs' K block of one layer, all heads, KiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    try:
        pairs = bench_pd_tp.parse_pairs(args.tp_pairs)
    except ValueError as exc:
        p.error(str(exc))
    if min(args.layers, args.tp, args.mib, args.reps, args.te_chunk) < 1:
        p.error("--layers, --tp, --mib, --reps and --te-chunk must be positive")
    sizes = [int(float(v) * KiB) for v in args.block_kib.split(",")]
    for b in sizes:
        n = max(1, -(-args.mib * MiB // (2 * args.layers * b)))
        memory = 3 * args.tp * 2 * n * 2 * args.layers * b + 2 * n * 2 * args.layers * b * args.tp
        if memory > 4 << 30:
            p.error(f"{memory / (1 << 30):.1f} GiB of caches and buffers at {b // KiB} KiB: lower --mib or --tp")
    setup_logging(args.verbose)
    log = logging.getLogger("bench_pd")
    print(f"tp {args.tp}, {args.layers} layers, >= {args.mib} MiB per rank per transfer, copy threads "
          f"{default_copy_threads()} per rank, median of {args.reps}", flush=True)
    results = []
    for block_bytes in sizes:
        bench = Bench(block_bytes, args, log)
        try:
            results.append(bench.run())
        finally:
            bench.close()
    print()
    print(f"{'block':>7} {'blocks':>6} {'runs':>5} " + " ".join(f"{c:>9}" for c in GBPS)
          + f" {'ipc/mcpy':>8} {'te/raw':>7} {'push ipc':>8} {'push te':>7} {'vis ipc':>7} {'vis te':>7} {'bound':>6}")
    print(f"{'':>7} {'':>6} {'':>5} " + " ".join(f"{'GB/s':>9}" for _ in GBPS)
          + f" {'>=0.9':>8} {'>=0.9':>7} {'':>8} {'':>7} {'<=bound':>7} {'<=bound':>7}")
    for r in results:
        b = r["block_bytes"]
        label = f"{b // KiB} KiB" if b % KiB == 0 else f"{b} B"
        print(f"{label:>7} {r['blocks']:>6} {r['runs_per_rank']:>5} " + " ".join(fmt(r[c + '_gbps'], 9, 2) for c in GBPS)
              + f" {fmt(r['pd_ipc_over_memcpy'], 8, 3)} {fmt(r['pd_te_over_raw'], 7, 3)}"
              f" {fmt(r['pd_push_ipc_over_memcpy'], 8, 3)} {fmt(r['pd_push_te_over_raw'], 7, 3)}"
              f" {fmt(r['pd_push_ipc_visible_fraction'], 7, 3)} {fmt(r['pd_push_te_visible_fraction'], 7, 3)}"
              f" {r['visible_bound']:>6.3f}")
        ms = {k[:-3]: v for k, v in r.items() if k.endswith("_ms") and isinstance(v, float)}
        print(f"{'':>7} compute/layer {r['compute_ms']} ms; " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()) + " ms")
        for name, error in r["errors"].items():
            print(f"{'':>7} {name} FAILED: {error}")

    def worst(key: str, pick) -> float | None:
        values = [r[key] for r in results]
        return None if any(v is None for v in values) else round(pick(values), 4)

    hetero, pair_results = bench_pd_tp.measure(pairs, args, log)
    for r in pair_results:
        print(f"TP {r['pair']:>4} over {r['transport']:<8}: {r['hetero_gbps']:7.2f} GB/s, same TP {r['same_tp_gbps']:7.2f}"
              f" GB/s, ratio {r['pd_hetero_over_same_tp']:.3f} (>= 0.8)")
    visible = [r[k] for r in results for k in ("pd_push_ipc_visible_fraction", "pd_push_te_visible_fraction")]
    summary = {
        "pd_ipc_over_memcpy": worst("pd_ipc_over_memcpy", min),
        "pd_te_over_raw": worst("pd_te_over_raw", min),
        "pd_push_ipc_over_memcpy": worst("pd_push_ipc_over_memcpy", min),
        "pd_push_te_over_raw": worst("pd_push_te_over_raw", min),
        "pd_push_visible_fraction": None if None in visible else round(max(visible), 4),
        "pd_push_ipc_visible_fraction": worst("pd_push_ipc_visible_fraction", max),
        **hetero,
    }
    rounded = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in results]
    print(json.dumps({**summary, "visible_bound": round(1 / args.layers + 0.1, 4), "block_bytes": sizes,
                      "tp": args.tp, "layers": args.layers, "reps": args.reps, "mib": args.mib,
                      "copy_threads": default_copy_threads(), "results": rounded, "tp_pairs": pair_results}))


if __name__ == "__main__":
    main()
