#!/usr/bin/env python3
"""Prefill/decode between two hosts of the test bed against the raw Transfer Engine, in one run (DESIGN §3.11, §5).

Two simulated hosts (tests/two_hosts.py: network namespaces joined by a veth pair, each with its
own /dev/shm and boot id; needs root) each run one engine instance, a ``CacheTransferService`` with
TP --tp CTMs and its ``PrefillDecode`` side, started on its host with the host's address as
``pod_ip`` (tests/pd_hosts.py): the prefill instance P on host a, the decode instance D on host b,
linked with the project's default choice (``transport="auto"``, offering ``offer_for("mooncake")``:
across hosts that is the Mooncake Transfer Engine over TCP).  Each transfer moves --mib MiB in all
(every rank, K and V, every layer) of N blocks drawn at random from caches of 2N (fresh ids each
repetition, the same ids for every figure of one repetition).  "Block size" is the bytes of ONE
layer's K block on ONE rank (head_dim 128, bf16).  Per repetition, back to back:

  raw_read   floor: D's engine process opens its own Transfer Engine at host b's address, with D's
             caches registered, and does ``batch_transfer_sync_read`` of the very runs a D rank
             builds (same ``coalesce`` of the same ids, same addresses on both sides) from P's rank
             engines, ranks in parallel, at most --te-chunk 64 KiB slices per batch
  te_pull    D.pull_blocks from P, from the call to the future's resolution (D's clock)
  te_push    whole push (``layerwise=False``): from P's ``push_blocks`` call to D's target having
             every layer (P's and D's CLOCK_MONOTONIC: the bed gives both hosts the machine's)

``batch_transfer_sync_read`` waits in a busy loop; on a host with few cores it takes a core from
the transport's own threads, so the floor can be slower than the CTMs (a ratio above 1 then says
that, not that the CTMs beat the engine).  Before the timed repetitions one pass of each figure over
complementary halves of the blocks touches every page, and the first pull and push are checked
bit-exact (SHA-256 per rank, kind and layer).

Ratios (medians of --reps):
  pd_hosts_te_over_raw        = raw_read / te_pull   (DESIGN §5's pd_te_over_raw, across hosts)
  pd_hosts_push_over_raw_read = raw_read / te_push   (the push against the same read floor)
Prints a table of GB/s, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import quiet_paddle

quiet_paddle()

import numpy as np  # noqa: E402

from tests import two_hosts as bed_lib  # noqa: E402
from tests.pd_hosts import HostInstance  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
HEAD_DIM = 128
TIMEOUT = 60.0
FIGURES = ("raw_read", "te_pull", "te_push")


def spec_for(block_bytes: int, layers: int, num_blocks: int) -> dict:
    """A spec whose K block of one layer on one rank is ``block_bytes`` (bf16, head_dim 128)."""
    heads_x_tokens = block_bytes // (HEAD_DIM * 2)
    if heads_x_tokens * HEAD_DIM * 2 != block_bytes:
        raise ValueError(f"block size {block_bytes} is not a whole number of {HEAD_DIM * 2}-byte head rows")
    block_size = min(128, heads_x_tokens)
    if heads_x_tokens % block_size:
        raise ValueError(f"block size {block_bytes}: kv_heads x block_size = {heads_x_tokens} does not split")
    return dict(num_layers=layers, num_blocks=num_blocks, kv_heads=heads_x_tokens // block_size,
                block_size=block_size, head_dim=HEAD_DIM)


class Bench:
    def __init__(self, bed: bed_lib.Bed, args: argparse.Namespace, log_dir: str):
        self.args = args
        block_bytes = int(args.block_kib * KiB)
        self.n = max(1, -(-args.mib * MiB // (2 * args.layers * block_bytes * args.tp)))  # blocks per transfer
        self.num_blocks = 2 * self.n
        self.bytes = self.n * 2 * args.layers * block_bytes * args.tp
        self.block_bytes = block_bytes
        spec = spec_for(block_bytes, args.layers, self.num_blocks)
        self.rng = np.random.default_rng(args.seed)
        kw = dict(tp=args.tp, log_dir=log_dir, task_timeout=TIMEOUT, num_cpu_blocks=1)
        self.p = HostInstance(bed.a, "prefill-0", spec, seed=args.seed + 1, **kw)
        self.d = HostInstance(bed.b, "decode-0", spec, seed=args.seed + 2, **kw)
        self.p.wait_ready(120)
        self.d.wait_ready(120)
        offer = ["ipc", "mooncake"]  # offer_for("mooncake"); "auto" picks what the hosts allow
        self.transport = self.d.call("link", peer=self.p.call("descriptor", offer=offer), transport="auto",
                                     offer=offer)
        assert self.p.call("link", peer=self.d.call("descriptor", offer=offer), transport="auto",
                           offer=offer) == self.transport
        self.p_te = [r["transports"]["mooncake"] for r in self.p.call("descriptor", offer=offer)["ranks"]]
        self.d.call("raw_open")
        self.seq = 0

    def close(self) -> None:
        for inst in (self.d, self.p):
            inst.close(60)

    def ids(self) -> tuple[list[int], list[int]]:
        src = self.rng.choice(self.num_blocks, self.n, replace=False).tolist()
        dst = self.rng.choice(self.num_blocks, self.n, replace=False).tolist()
        return src, dst

    # ------------------------------------------------------------------ one figure each
    def raw_read(self, src: list[int], dst: list[int]) -> float:
        out = self.d.call("raw_read", ranks=self.p_te, src=src, dst=dst, max_slices=self.args.te_chunk,
                          answer_within=TIMEOUT)
        if out["bytes"] != self.bytes:
            raise RuntimeError(f"the raw runs cover {out['bytes']} bytes, not {self.bytes}")
        return out["seconds"]

    def te_pull(self, src: list[int], dst: list[int], check: bool = False) -> float:
        self.seq += 1
        handle = self.p.call("expose", req_id=f"bench-{self.seq}", ttl=TIMEOUT)
        try:
            self.d.call("pull", name=f"p{self.seq}", peer="prefill-0", handle=handle, src=src, dst=dst,
                        timeout=TIMEOUT)
            out = self.d.call("outcome", name=f"p{self.seq}", wait=TIMEOUT, answer_within=TIMEOUT + 30)
        finally:
            self.p.call("retract", handle=handle)
        if out.get("value") != dst:
            raise RuntimeError(f"the pull answered {str(out)[:300]}")
        if check and self.d.call("digest", ids=dst) != self.p.call("digest", ids=src):
            raise RuntimeError("the pulled blocks differ from the prefill instance's")
        return out["seconds"]

    def te_push(self, src: list[int], dst: list[int], check: bool = False) -> float:
        ticket = self.d.call("receive_push", peer="prefill-0", dst=dst, timeout=TIMEOUT)
        try:
            sent = self.p.call("push", peer="decode-0", ticket=ticket, src=src, layerwise=False, timeout=TIMEOUT)
            landed = self.d.call("target_result", peer="prefill-0", timeout=TIMEOUT, answer_within=TIMEOUT + 30)
            done = self.p.call("push_outcome", peer="decode-0", wait=TIMEOUT, answer_within=TIMEOUT + 30)
        finally:
            self.p.call("push_released", peer="decode-0", wait=TIMEOUT, answer_within=TIMEOUT + 30)
            self.d.call("target_close", peer="prefill-0")
        if landed.get("value") != dst or done.get("value") != dst:
            raise RuntimeError(f"the push answered {str(done)[:200]}; its target {str(landed)[:200]}")
        if check and self.d.call("digest", ids=dst) != self.p.call("digest", ids=src):
            raise RuntimeError("the pushed blocks differ from the prefill instance's")
        return landed["at"] - sent["submitted"]

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        errors: dict[str, str] = {}
        halves = self.rng.permutation(self.num_blocks)
        first, second = sorted(halves[:self.n].tolist()), sorted(halves[self.n:].tolist())
        for i, (src, dst) in enumerate(((first, second), (second, first))):  # every page touched, checked once
            self.raw_read(src, dst)
            self.te_pull(src, dst, check=i == 0)
            self.te_push(src, dst, check=i == 0)
        samples: dict[str, list[float]] = {name: [] for name in FIGURES}
        for _ in range(self.args.reps):
            src, dst = self.ids()
            for name in FIGURES:
                try:
                    samples[name].append(getattr(self, name)(src, dst))
                except Exception as exc:  # noqa: BLE001  (reported, the other figures go on)
                    errors.setdefault(name, f"{type(exc).__name__}: {exc}"[:300])
        med = {name: statistics.median(v) if len(v) * 2 > self.args.reps else None for name, v in samples.items()}

        def ratio(a: str, b: str) -> float | None:
            return None if med[a] is None or med[b] is None else round(med[a] / med[b], 4)

        out = {"transport": self.transport, "bytes": self.bytes, "blocks": self.n, "block_bytes": self.block_bytes,
               "pd_hosts_te_over_raw": ratio("raw_read", "te_pull"),
               "pd_hosts_push_over_raw_read": ratio("raw_read", "te_push")}
        for name in FIGURES:
            out[f"{name}_ms"] = None if med[name] is None else round(med[name] * 1e3, 3)
            out[f"{name}_gbps"] = None if med[name] is None else round(self.bytes / med[name] / 1e9, 3)
        out["errors"] = errors
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="MiB per transfer, all ranks, K and V, all layers")
    p.add_argument("--block-kib", type=float, default=32, help="the K block of one layer on one rank, KiB")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--te-chunk", type=int, default=1024, help="most 64 KiB slices per raw Transfer Engine batch")
    p.add_argument("--shm", default="1g", help="each host's /dev/shm size (holds its instance's caches)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if min(args.mib, args.layers, args.tp, args.reps, args.te_chunk) < 1 or args.block_kib <= 0:
        p.error("--mib, --block-kib, --layers, --tp, --reps and --te-chunk must be positive")
    try:
        bed = bed_lib.make_bed(2, shm_size=args.shm)
    except bed_lib.BedUnavailable as exc:
        print(json.dumps({"skipped": f"no two-host bed here: {exc}"}))
        return
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_pd_hosts.") as log_dir:
            bench = Bench(bed, args, log_dir)
            try:
                r = bench.run()
            finally:
                bench.close()
    finally:
        bed.close()
    print(f"P/D between two bed hosts ({bed.a.address} -> {bed.b.address}, veth) over {r['transport']}: tp "
          f"{args.tp}, {args.layers} layers, {r['blocks']} blocks of {r['block_bytes'] // KiB} KiB, "
          f"{r['bytes'] / MiB:.1f} MiB per transfer, median of {args.reps} ({time.monotonic() - t0:.0f} s in all)")
    print(f"{'':>10} {'ms':>9} {'GB/s':>7}")
    for name in FIGURES:
        ms, gbps = r[f"{name}_ms"], r[f"{name}_gbps"]
        print(f"{name:>10} {'-' if ms is None else f'{ms:9.2f}':>9} {'-' if gbps is None else f'{gbps:7.3f}':>7}")
    print(f"raw_read / te_pull {r['pd_hosts_te_over_raw']}, raw_read / te_push {r['pd_hosts_push_over_raw_read']}"
          " (time of the floor over the figure's: 1 = as fast as the raw engine)")
    for name, error in r["errors"].items():
        print(f"{name} FAILED: {error}")
    print(json.dumps({**r, "tp": args.tp, "layers": args.layers, "reps": args.reps, "mib": args.mib}))


if __name__ == "__main__":
    main()
