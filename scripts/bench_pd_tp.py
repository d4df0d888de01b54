"""Prefill/decode between instances of different TP sizes (DESIGN §3.11), against the same bytes
between instances of one TP size, in one run: the ``pd_hetero_over_same_tp`` figure of
``bench_pd.py`` (``--tp-pairs``).

For a pair P:D the model has H = max(P, D) kv heads (head_dim 128, bf16) and its K block of one
layer, all heads together, holds --tp-block-kib KiB.  Three engine instances run on this host: a
decode instance of TP D, a prefill instance of TP P, and a baseline prefill instance of TP D, both
linked to the decode instance over the transport measured.  Per repetition, on fresh random ids
(the same for both), the decode instance pulls N blocks (all layers and kinds, at least --mib MiB
of the model) from the TP-P instance (each decode rank reads its heads from the prefill ranks that
hold them: head ranges of blocks) and from the baseline (each rank reads whole blocks from one
rank), in alternating order; timed from ``pull_blocks`` to ``.result()``.

  pd_hetero_over_same_tp    = median(same TP pull) / median(P:D pull)   target >= 0.8

The figure is the worst over the pairs on the default path of one host (``ipc``, the same-host
copy); ``pd_hetero_te_over_same_tp`` is the same over the Transfer Engine (TCP on loopback here).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from engine_hooks import CacheSpec, CacheTransferService
from engine_hooks.pd import PrefillDecode, offer_for

KiB, MiB = 1 << 10, 1 << 20
HEAD_DIM, ITEM = 128, 2  # bf16
TIMEOUT = 120.0
TRANSPORTS = ("ipc", "mooncake")


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in filter(None, text.split(",")):
        try:
            p, d = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--tp-pairs item {item!r} must be P:D, e.g. 1:2") from None
        if not (1 <= p <= 8 and 1 <= d <= 8) or max(p, d) % min(p, d):
            raise ValueError(f"--tp-pairs item {item!r}: sizes in 1..8, the smaller dividing the larger")
        pairs.append((p, d))
    return pairs


def _fill(svc: CacheTransferService, seed: int) -> None:
    rng = np.random.default_rng(seed)  # every page written: no zero pages, no first-touch faults
    for caches in svc.caches.tensors:
        for layers in caches.values():
            for t in layers:
                v = svc.platform.raw_view(t)
                v[:] = rng.integers(0, 256, v.shape, dtype=np.uint8)


class PairBench:
    def __init__(self, p_tp: int, d_tp: int, args: argparse.Namespace):
        self.p_tp, self.d_tp, self.args = p_tp, d_tp, args
        heads = max(p_tp, d_tp)
        model_block = int(args.tp_block_kib * KiB)
        block_size = model_block // heads // (HEAD_DIM * ITEM)
        if block_size < 1 or block_size * heads * HEAD_DIM * ITEM != model_block:
            raise ValueError(f"--tp-block-kib {args.tp_block_kib}: not {heads} heads of whole tokens")
        self.n = max(1, -(-args.mib * MiB // (2 * args.layers * model_block)))
        self.bytes = self.n * 2 * args.layers * model_block
        self.num_blocks = 2 * self.n
        self.rng = np.random.default_rng(args.seed)
        self.services: list[CacheTransferService] = []
        self.sides: list[PrefillDecode] = []

        def instance(tp: int, name: str) -> PrefillDecode:
            spec = CacheSpec(num_layers=args.layers, num_blocks=self.num_blocks, kv_heads=heads // tp,
                             block_size=block_size, head_dim=HEAD_DIM)
            svc = CacheTransferService(spec, tp=tp, num_cpu_blocks=1, task_timeout=TIMEOUT).start()
            self.services.append(svc)
            _fill(svc, len(self.services))
            self.sides.append(PrefillDecode(svc, name))
            return self.sides[-1]

        try:
            self.d = instance(d_tp, "decode")
            self.hetero = instance(p_tp, "prefill-hetero")
            self.same = instance(d_tp, "prefill-same")
        except BaseException:
            self.close()
            raise

    def link(self, transport: str) -> None:
        offer = offer_for(transport)
        for peer in (self.hetero, self.same):
            if peer.instance_id in self.d.linked():
                self.d.unlink(peer.instance_id)
                peer.unlink(self.d.instance_id)
            assert self.d.link(peer.descriptor(offer), transport=transport) == transport
            assert peer.link(self.d.descriptor(offer), transport=transport) == transport

    def pull(self, peer: PrefillDecode, src: list[int], dst: list[int]) -> float:
        handle = peer.expose(f"req-{time.monotonic_ns()}")
        try:
            t0 = time.perf_counter()
            got = self.d.pull_blocks(peer.instance_id, handle, src, dst, timeout=TIMEOUT).result(timeout=TIMEOUT)
            elapsed = time.perf_counter() - t0
        finally:
            peer.retract(handle)
        if got != dst:
            raise RuntimeError(f"pull from {peer.instance_id}: {len(got)} of {len(dst)} blocks")
        return elapsed

    def run(self, transport: str) -> dict:
        self.link(transport)
        times: dict[str, list[float]] = {"hetero": [], "same": []}
        for rep in range(self.args.reps + 1):  # the first is a warm-up (mappings, connections)
            src = self.rng.choice(self.num_blocks, self.n, replace=False).tolist()
            dst = self.rng.choice(self.num_blocks, self.n, replace=False).tolist()
            order = [("hetero", self.hetero), ("same", self.same)]
            for name, peer in (order if rep % 2 else order[::-1]):
                elapsed = self.pull(peer, src, dst)
                if rep:
                    times[name].append(elapsed)
        hetero, same = statistics.median(times["hetero"]), statistics.median(times["same"])
        return {"pair": f"{self.p_tp}:{self.d_tp}", "transport": transport, "blocks": self.n,
                "hetero_ms": round(hetero * 1e3, 3), "same_tp_ms": round(same * 1e3, 3),
                "hetero_gbps": round(self.bytes / hetero / 1e9, 3), "same_tp_gbps": round(self.bytes / same / 1e9, 3),
                "pd_hetero_over_same_tp": round(same / hetero, 4)}

    def close(self) -> None:
        for side in self.sides:
            side.close()
        for svc in self.services:
            svc.shutdown()


def measure(pairs: list[tuple[int, int]], args: argparse.Namespace, log: logging.Logger) -> tuple[dict, list]:
    """Per pair and transport, the figure; and the worst of them per transport."""
    results = []
    for p_tp, d_tp in pairs:
        bench = PairBench(p_tp, d_tp, args)
        try:
            for transport in TRANSPORTS:
                results.append(bench.run(transport))
                log.info("%s", results[-1])
        finally:
            bench.close()
    def worst(transport: str) -> float | None:
        return min((r["pd_hetero_over_same_tp"] for r in results if r["transport"] == transport), default=None)

    return {"pd_hetero_over_same_tp": worst("ipc"), "pd_hetero_te_over_same_tp": worst("mooncake")}, results
