#!/usr/bin/env python3
"""What digests on P/D bytes cost (DESIGN §3.11 "Digests", issue 36 item 3): pulls with digests off
and on, over the same-host path and the Transfer Engine, in one run.

Three real engine instances on this host (TP = --tp): a decode instance D and two prefill instances
with digests on, P-ipc linked to D over the same-host path and P-te over the Mooncake Transfer
Engine (TCP).  "Block size" is the bytes of ONE layer's K block on ONE rank (as ``bench_pd.py``);
each transfer moves N blocks of every layer, K and V, at least --mib MiB per rank.  Per repetition,
on fresh random ids, for each transport, back to back and in alternating order:

  publish     P.expose(req, blocks=src): every prefill rank digests the exposed blocks into its
              digest table (a control round trip plus XXH3 of every block and tensor); not part of a pull
  off         D.pull_blocks(..., digests=False), from the call to ``.result()``: the floor
  on          D.pull_blocks(..., digests=True): every decode rank reads the source's digests over
              the transport after the bytes and digests what it received before it counts a block

Ratios (medians of --reps): ``pd_digest_<t>_on_over_off`` = off / on (throughput with digests on
over off), target >= 0.9 (on costs at most 10% of the transfer's throughput); the JSON's top level
holds the worst over the block sizes.  Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import add_pd_size_arguments, quiet_paddle, rounded, setup_logging

quiet_paddle()

import numpy as np  # noqa: E402

from bench_pd import fill_random, spec_for  # noqa: E402
from engine_hooks import CacheTransferService  # noqa: E402
from engine_hooks.pd import PrefillDecode  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 120.0
TARGET = 0.9
TRANSPORTS = {"ipc": "prefill-ipc", "te": "prefill-te"}


class DigestBench:
    def __init__(self, block_bytes: int, args: argparse.Namespace):
        self.args, self.block_bytes = args, block_bytes
        self.n = max(1, -(-args.mib * MiB // (2 * args.layers * block_bytes)))
        self.num_blocks = 2 * self.n
        self.bytes = self.n * 2 * args.layers * block_bytes * args.tp
        self.rng = np.random.default_rng(args.seed)
        self.services: list[CacheTransferService] = []
        self.sides: list[PrefillDecode] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        spec = spec_for(self.block_bytes, self.args.layers, self.num_blocks)

        def instance(name: str, digests: bool) -> PrefillDecode:
            svc = CacheTransferService(spec, tp=self.args.tp, num_cpu_blocks=1, task_timeout=TIMEOUT).start()
            self.services.append(svc)
            self.sides.append(PrefillDecode(svc, name, digests=digests))
            return self.sides[-1]

        self.d = instance("decode", False)  # checks per pull (digests=True/False)
        self.p = {"ipc": instance("prefill-ipc", True), "te": instance("prefill-te", True)}
        for t, offer, transport in (("ipc", ["ipc"], "ipc"), ("te", ["ipc", "mooncake"], "mooncake")):
            assert self.d.link(self.p[t].descriptor(offer), transport=transport) == transport
            assert self.p[t].link(self.d.descriptor(offer), transport=transport) == transport
        fill_random(self.services)

    def ids(self) -> tuple[list[int], list[int]]:
        return (self.rng.choice(self.num_blocks, self.n, replace=False).tolist(),
                self.rng.choice(self.num_blocks, self.n, replace=False).tolist())

    def figures(self, rep: int, ids: tuple[list[int], list[int]] | None = None) -> dict[str, float]:
        src, dst = ids or self.ids()
        out = {}
        for t, peer in TRANSPORTS.items():
            t0 = time.perf_counter()
            handle = self.p[t].expose(f"req-{time.monotonic_ns()}", blocks=src)
            out[f"{t}_publish"] = time.perf_counter() - t0
            try:
                for on in ((False, True) if rep % 2 else (True, False)):
                    t0 = time.perf_counter()
                    got = self.d.pull_blocks(peer, handle, src, dst, digests=on, timeout=TIMEOUT).result(TIMEOUT)
                    out[f"{t}_{'on' if on else 'off'}"] = time.perf_counter() - t0
                    if got != dst:
                        raise RuntimeError(f"pull from {peer} loaded {len(got)} of {len(dst)} blocks")
            finally:
                self.p[t].retract(handle)
        return out

    def run(self) -> dict:
        halves = self.rng.permutation(self.num_blocks)
        for half in (halves[:self.n].tolist(), halves[self.n:].tolist()):  # warm-up: touch every page
            self.figures(0, (half, half[::-1]))
        times: dict[str, list[float]] = {}
        for rep in range(self.args.reps):
            for name, seconds in self.figures(rep).items():
                times.setdefault(name, []).append(seconds)
        med = {name: statistics.median(v) for name, v in times.items()}
        r: dict = {"block_bytes": self.block_bytes, "blocks": self.n, "bytes_per_transfer": self.bytes}
        for name, seconds in sorted(med.items()):
            r[f"{name}_ms"] = seconds * 1e3
        for t in TRANSPORTS:
            r[f"{t}_off_gbps"] = self.bytes / med[f"{t}_off"] / 1e9
            r[f"{t}_on_gbps"] = self.bytes / med[f"{t}_on"] / 1e9
            r[f"pd_digest_{t}_on_over_off"] = med[f"{t}_off"] / med[f"{t}_on"]
        return r

    def close(self) -> None:
        for side in reversed(self.sides):
            side.close()
        for svc in reversed(self.services):
            svc.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pd_size_arguments(p, mib=32, reps=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    if min(args.layers, args.tp, args.mib, args.reps) < 1:
        p.error("--layers, --tp, --mib and --reps must be positive")
    setup_logging(args.verbose)
    logging.getLogger("bench_pd_digest").info("starting")
    sizes = [int(float(v) * KiB) for v in args.block_kib.split(",")]
    results = []
    for block_bytes in sizes:
        bench = DigestBench(block_bytes, args)
        try:
            results.append(bench.run())
        finally:
            bench.close()
    print(f"tp {args.tp}, {args.layers} layers, >= {args.mib} MiB per rank per transfer, median of {args.reps}")
    print(f"{'block':>7} {'blocks':>6} | {'ipc off':>8} {'ipc on':>8} {'on/off':>6} {'publish':>8} | "
          f"{'te off':>8} {'te on':>8} {'on/off':>6} {'publish':>8}")
    print(f"{'':>7} {'':>6} | {'GB/s':>8} {'GB/s':>8} {'>=0.9':>6} {'ms':>8} | {'GB/s':>8} {'GB/s':>8} {'>=0.9':>6} "
          f"{'ms':>8}")
    for r in results:
        cells = [f"{r[f'{t}_off_gbps']:8.2f} {r[f'{t}_on_gbps']:8.2f} {r[f'pd_digest_{t}_on_over_off']:6.3f} "
                 f"{r[f'{t}_publish_ms']:8.2f}" for t in TRANSPORTS]
        print(f"{r['block_bytes'] // KiB:>4} KiB {r['blocks']:>6} | " + " | ".join(cells))
    summary = {f"pd_digest_{t}_on_over_off": min(r[f"pd_digest_{t}_on_over_off"] for r in results) for t in TRANSPORTS}
    print(json.dumps(rounded({**summary, "target": TARGET, "block_bytes": sizes, "tp": args.tp, "layers": args.layers,
                              "mib": args.mib, "reps": args.reps, "results": results})))


if __name__ == "__main__":
    main()
