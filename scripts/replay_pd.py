"""The replay's prefill/decode mode (``replay_trace.py --pd P:D``, DESIGN §3.11): P prefill and D
decode instances, each a ``CacheTransferService`` with its own CTMs in this process, linked pairwise
with ``engine_hooks.pd.PrefillDecode`` over ``--pd-transport``.

One request:

1. ``--route`` picks a prefill instance (round-robin, or ``session``: a conversation pinned to one),
   and the decode instances take requests in turn.
2. The prefill instance serves it exactly as the single-engine replay does
   (``replay_workload.serve_request``: the tiered prefix cache serves the hits, every loaded block
   is verified, the misses are "computed", commit, release), through ``PrefillInstance``, which
   stands in for both the cache and the content there and adds the hand-off while the request's
   blocks are still pinned:
   - ``pull``: once computed, P exposes a handle, D takes destination blocks from its free list and
     pulls every block, P retracts;
   - ``push``: before computing, D reserves destination blocks (``receive_push``) and P submits a
     layer-wise push of all the request's blocks, then computes the misses layer by layer, calling
     ``layer_computed(i + 1)`` after each (hits are there already: with no miss, every layer at once);
     D waits for each layer.  ``pd_layer_visible_ms``: from the last ``layer_computed`` to the last
     layer visible on D (the median over requests).
3. D checks every block on every rank, group and layer against the content derived from (block hash,
   layer, head, group) (``replay_workload.Content``; a sliding-window group of a ``--model`` layout:
   the request's last blocks, those its decode attention reads; the one more block a transfer moves
   for a window that starts inside a block holds the prefill side's bytes, checked where both sides
   have one TP size), "decodes" (``--pd-decode-ms``), frees its blocks.

With ``--model``, each instance has the preset's layout at its own TP size.  A layout with state
groups (qwen3-next's conv and SSM state: one slot per request, not per block): P computes each
request's state into a slot, the transfer moves it (``state_slots``) into a slot D takes for the
request, and D checks it; between TP sizes such a layout is refused before anything starts, naming
the group, as a link would refuse it.

With ``--pd-digests`` the prefill ranks digest the blocks they expose and the decode ranks check each
pulled block against them: a block that differs fails its transfer and counts in
``pd_digest_mismatches`` (0 in a healthy replay; the key is there with digests off too, at 0).

A transfer that fails counts in ``pd_failed_transfers``, a wrong block in ``pd_corrupt_blocks`` and a
wrong state slot in ``pd_corrupt_state_slots`` (a layout with state groups: ``pd_state_slots`` arrived);
either way the request is dropped on D, never decoded from wrong bytes.  Destination blocks a failed
transfer may still write stay out of D's free list until the transfer is released.  Bytes are what
the ranks report having moved (``RankResult.bytes_moved``); a transfer's time runs from its
submission to its last layer on D (for a push it includes P computing the missing layers).
The decode instance's block allocator and those figures live in ``replay_pd_decode.py``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import os
import time

import numpy as np

from cache_manager.cache_presets import preset
from cache_manager.rank.peer.tp_rules import refuse_layout, tp_heads
from engine_hooks import CacheTransferService
from engine_hooks.core.late_tasks import bytes_moved, released_of
from engine_hooks.pd import TRANSPORT_CHOICES, PrefillDecode, offer_for
from engine_hooks.prefix_cache import CapacityError, TieredPrefixCache, TierStats
import replay_tenants
import replay_records
from replay_instances import Router
from replay_pd_decode import DecodeInstance, PDStats
from replay_workload import ByteLedger, Content, Tally, model_result, naive_block_bytes, serve_request, summarize

log = logging.getLogger("replay.pd")

MAX_INSTANCES = 8


# ---------------------------------------------------------------------------- configuration
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (every instance in this process, linked pairwise)")
    g.add_argument("--pd", metavar="P:D", help="P prefill and D decode instances (e.g. 1:1, 2:1); prefill "
                   "instances are picked by --route, decode instances in turn")
    g.add_argument("--pd-mode", choices=["pull", "push"], default="pull",
                   help="decode pulls the request's blocks, or prefill pushes them layer by layer (default pull)")
    g.add_argument("--pd-transport", choices=list(TRANSPORT_CHOICES), default="auto",
                   help="ipc (same host, no port), mooncake (Transfer Engine over TCP), or auto (default)")
    g.add_argument("--prefill-tp", type=int, default=None,
                   help="TP size of the prefill instances (default --tp); the model then has max(prefill, "
                   "decode TP) kv heads of --block-bytes each, split over each instance's ranks")
    g.add_argument("--decode-tp", type=int, default=None, help="TP size of the decode instances (default --tp)")
    g.add_argument("--pd-decode-ms", type=float, default=0.0,
                   help="simulated decode time per request, during which D holds its blocks (default 0)")
    g.add_argument("--pd-digests", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill ranks digest the exposed blocks, decode ranks check every pulled block against "
                   "them (pull only; default off); a mismatch counts in pd_digest_mismatches")


def parse_pd(text: str) -> tuple[int, int]:
    """``"P:D"`` -> (P, D), both in 1..MAX_INSTANCES; ``ValueError`` otherwise."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--pd {text!r} must be P:D, e.g. 1:1 or 2:1") from None
    if not (1 <= p <= MAX_INSTANCES and 1 <= d <= MAX_INSTANCES):
        raise ValueError(f"--pd {text!r}: each side needs 1 to {MAX_INSTANCES} instances")
    return p, d


def tp_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prefill TP, decode TP, the model's kv heads): one head per rank of the larger instance."""
    p_tp = args.tp if args.prefill_tp is None else args.prefill_tp
    d_tp = args.tp if args.decode_tp is None else args.decode_tp
    return p_tp, d_tp, max(p_tp, d_tp)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pd is None:
        if (args.pd_mode != "pull" or args.pd_transport != "auto" or args.pd_decode_ms or args.pd_digests
                or args.prefill_tp is not None or args.decode_tp is not None):
            parser.error("--pd-mode, --pd-transport, --pd-decode-ms, --pd-digests, --prefill-tp and --decode-tp "
                         "need --pd P:D")
        return
    if args.pd_digests and args.pd_mode != "pull":
        parser.error("--pd-digests checks pulls (--pd-mode pull): a push carries no digests yet")
    if args.pd_digests and tp_sizes(args)[0] != tp_sizes(args)[1]:
        parser.error("--pd-digests checks instances of one TP size (a head range of a block has no digest)")
    for flag, value in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if value is not None and not 1 <= value <= 16:
            parser.error(f"{flag} {value} must be in 1..16")
    p_tp, d_tp, heads = tp_sizes(args)
    if heads % p_tp or heads % d_tp:
        parser.error(f"--prefill-tp {p_tp} and --decode-tp {d_tp}: the smaller must divide the larger "
                     "(each rank holds a whole number of kv heads)")
    try:
        parse_pd(args.pd)
    except ValueError as exc:
        parser.error(str(exc))
    for flag, value in (("--instances", args.instances > 1), ("--kill-instance-at", args.kill_instance_at),
                        ("--metrics-port", args.metrics_port)):
        if value:
            parser.error(f"--pd does not combine with {flag}")
    if args.pd_decode_ms < 0:
        parser.error(f"--pd-decode-ms {args.pd_decode_ms} must not be negative")
    if args.model:
        prefill, decode = (instance_layout(args, 16, tp) for tp in (p_tp, d_tp))
        try:
            refuse_layout(prefill, tp_heads(prefill), p_tp, d_tp)
            refuse_layout(decode, tp_heads(decode), d_tp, p_tp)
        except ValueError as exc:
            parser.error(f"--pd with --model {args.model}: {exc}")


def instance_layout(args: argparse.Namespace, num_blocks: int, tp: int):
    """``--model``'s layout on an instance of TP size ``tp`` (its split groups: the model's heads over ``tp``)."""
    return preset(args.model, num_blocks=num_blocks, layers=args.model_layers, dim_scale=args.model_dim_scale, tp=tp)


# ---------------------------------------------------------------------------- prefill side
class Handoff:
    """One request's way from a prefill instance to a decode instance.  Never raises: a failure is
    counted and the request dropped on D."""

    def __init__(self, p: "PrefillInstance", d: DecodeInstance, line: int, hashes: list[str], args, stats: PDStats,
                 tenant: "replay_tenants.Tenant | None" = None):
        self.p, self.d, self.line, self.args, self.stats = p, d, line, args, stats
        self.tenant, self.salt = tenant, tenant.salt if tenant is not None else None
        self.trace_hashes = hashes  # the trace's: another tenant's contents derive from them
        self.hashes = tenant.content_keys(hashes) if tenant is not None else hashes  # this request's contents'
        self.cross_tenant = 0  # blocks D received holding another tenant's bytes
        self.lease = None
        self.dst: list[int] = []
        self.target = self.future = None
        self.t0 = self.t_computed = 0.0
        self.error: str | None = None
        self.entry = (float("nan"), 0)
        self.landed = 0  # blocks that reached D
        # a layout with state groups: the request's state slot on P (one request at a time per
        # instance, so any slot; the tiers never touch it) and the one D takes for it
        slots = p.svc.layout.request_slots
        self.p_slot = line % slots if slots else None
        self.d_slot: int | None = None

    @property
    def state_slots(self) -> tuple[int, int] | None:
        return None if self.p_slot is None else (self.p_slot, self.d_slot)

    def _fail(self, what: str, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"{what}: {type(exc).__name__}: {exc}"

    # ---- P computes the request's missing blocks (serve_request's content.write) and its state
    def compute(self, hashes: list[str], blocks: list[int]) -> None:
        if self.p_slot is not None:  # a linear-attention state: prefill computes it over the whole prompt
            self.p.content.write_state(self.hashes[-1], self.p_slot)
        if self.args.pd_mode == "pull" or not self.lease.gpu_blocks:
            self.p.content.write(hashes, blocks)
            return
        timeout = self.args.task_timeout
        try:
            self.dst = self.d.allocate(len(self.lease.gpu_blocks))
            self.d_slot = self.d.allocate_slot()
            self.target = self.d.side.receive_push(self.p.id, self.dst, timeout=timeout, cache_salt=self.salt)
            self.t0 = time.perf_counter()
            self.future = self.p.side.push_blocks(self.d.id, self.target.ticket, self.lease.gpu_blocks,
                                                  layerwise=True, timeout=timeout, state_slots=self.state_slots,
                                                  cache_salt=self.salt,
                                                  request_id=replay_records.request_id(self.line, self.tenant))
        except Exception as exc:
            self._fail("starting the push", exc)
        layers = self.target.layers if self.target is not None else self.p.svc.layout.total_layers
        for layer in range(layers if blocks else 0):
            self.p.content.write(hashes, blocks, layer=layer)  # the replay's content, one layer at a time
            self._computed(layer + 1)
        if not blocks:
            self._computed(layers)  # every block a hit: all its layers are there already
        self.t_computed = time.perf_counter()

    def _computed(self, count: int) -> None:
        if self.future is not None and self.error is None:
            try:
                self.future.layer_computed(count)
            except Exception as exc:
                self._fail(f"layer_computed({count})", exc)

    # ---- the blocks go to D while the lease still pins them (serve_request's cache.release)
    def finish(self) -> None:
        if not self.lease.gpu_blocks:
            self.stats.timeline.append((0.0, 0))
            return
        try:
            if self.args.pd_mode == "pull":
                self._pull()
            else:
                self._land_push()
        except Exception as exc:
            self.stats.digest_mismatches += getattr(exc, "digest_mismatches", 0)  # failed blocks, never data
            self._fail("transfer", exc)
        if self.error is None:
            self._decode()
        else:
            self.stats.failed += 1
            log.error("line %d: %s -> %s %s failed, request dropped: %s", self.line, self.p.id, self.d.id,
                      self.args.pd_mode, self.error)
            self._give_back_failed()
        self.stats.timeline.append(self.entry)

    def _pull(self) -> None:
        timeout = self.args.task_timeout
        self.dst = self.d.allocate(len(self.lease.gpu_blocks))
        self.d_slot = self.d.allocate_slot()
        handle = self.p.side.expose(f"line-{self.line}", cache_salt=self.salt, blocks=self.lease.gpu_blocks)
        try:
            self.t0 = time.perf_counter()
            self.future = self.d.side.pull_blocks(self.p.id, handle, self.lease.gpu_blocks, self.dst,
                                                  timeout=timeout, state_slots=self.state_slots, cache_salt=self.salt,
                                                  request_id=replay_records.request_id(self.line, self.tenant))
            got = self.future.result(timeout=timeout + 10)
            self._landed(time.perf_counter(), got)
        finally:
            self.p.side.retract(handle)

    def _land_push(self) -> None:
        if self.error is not None:
            return
        timeout = self.args.task_timeout
        for layer in range(self.target.layers):
            self.target.wait_for_layer(layer, timeout=timeout)
        visible = time.perf_counter()
        self.stats.visible_ms.append((visible - self.t_computed) * 1e3)
        self.future.result(timeout=timeout)
        self._landed(visible, self.target.result(timeout=timeout))

    def _landed(self, t_end: float, got: list[int]) -> None:
        if list(got) != self.dst:
            raise RuntimeError(f"{len(got)} of {len(self.dst)} blocks landed on every rank")
        ms, moved = (t_end - self.t0) * 1e3, bytes_moved(self.future)
        self.stats.transfer_ms.append(ms)
        self.stats.bytes += moved
        self.entry = (ms, moved)
        self.landed = len(got)

    def _decode(self) -> None:
        n = len(self.dst)
        ok = self.d.content.verify(self.hashes, self.dst, tail=list(range(n - 1, -1, -1)))
        if self.p.svc.tp == self.d.svc.tp:  # the window's extra block: what the prefill side holds, rank for rank
            ok &= self.d.content.same_as(self.p.content, self.dst, self.lease.gpu_blocks)
        self.stats.blocks += len(self.dst)
        bad = int((~ok).sum())
        if bad and self.tenant is not None:
            wrong = [b for b, good in zip(self.dst, ok) if not good]
            tails = [n - 1 - i for i, good in enumerate(ok) if not good]
            self.stats.cross_tenant += sum(replay_tenants.cross_tenant(
                self.d.content, self.tenant, [h for h, good in zip(self.trace_hashes, ok) if not good], wrong, tails))
        state_ok = True
        if self.d_slot is not None:
            state_ok = self.d.content.verify_state(self.hashes[-1], self.d_slot)
            self.stats.states += 1
            self.stats.corrupt_states += not state_ok
        if bad or not state_ok:
            self.stats.corrupt += bad
            log.error("line %d: %d of %d blocks%s on %s have wrong bytes: request dropped", self.line, bad,
                      len(self.dst), "" if state_ok else " and its state slot", self.d.id)
        else:
            self.stats.requests += 1
            if self.args.pd_decode_ms:
                time.sleep(self.args.pd_decode_ms / 1e3)
        if self.target is not None:  # False, board slot kept, while a rank may still write
            self.d.give_back(self.dst, self.target.close, self.d_slot)
        else:
            self.d.give_back(self.dst, released_of(self.future).done, self.d_slot)

    def _give_back_failed(self) -> None:
        if not self.dst:
            return
        if self.future is None:  # never submitted: nothing writes them (a reserved board slot stays held)
            self.d.give_back(self.dst, slot=self.d_slot)
        elif self.target is not None:
            self.target.wait_released(self.args.task_timeout)
            self.d.give_back(self.dst, self.target.close, self.d_slot)
        else:
            self.d.give_back(self.dst, released_of(self.future).done, self.d_slot)


class PrefillInstance:
    """A prefill instance.  ``serve_request`` sees it as both its prefix cache (``acquire``,
    ``commit``, ``release``: the real ``TieredPrefixCache``'s) and its content (``verify``,
    ``write``); the request's ``Handoff`` adds the transfer to ``write`` and ``release``."""

    def __init__(self, index: int, svc: CacheTransferService, args):
        self.id = f"prefill-{index}"
        self.svc = svc
        self.side = PrefillDecode(svc, self.id, digests=args.pd_digests)
        self.cache = TieredPrefixCache(svc, args.device_blocks, args.host_blocks, write_policy=args.write_policy,
                                       write_threshold=args.write_threshold, use_storage=args.storage != "none",
                                       task_timeout=args.task_timeout)
        self.content = Content(svc)
        self.handoff: Handoff | None = None

    def acquire(self, hashes, cache_salt=None, request_id=None):
        self.handoff.lease = self.cache.acquire(hashes, cache_salt=cache_salt, request_id=request_id)
        return self.handoff.lease

    def commit(self, lease) -> None:
        self.cache.commit(lease)

    def verify(self, hashes, blocks, tail=None):
        return self.content.verify(hashes, blocks, tail=tail)

    def write(self, hashes, blocks) -> None:
        self.handoff.compute(hashes, blocks)

    def release(self, lease) -> None:
        try:
            self.handoff.finish()
        finally:
            self.cache.release(lease)


# ---------------------------------------------------------------------------- run
def link_all(prefills: list[PrefillInstance], decodes: list[DecodeInstance], transport: str) -> str:
    """Link every P/D pair both ways (D pulls from P, P pushes into D); the transport chosen."""
    offer = offer_for(transport)
    chosen = set()
    for p in prefills:
        for d in decodes:
            chosen.add(d.side.link(p.side.descriptor(offer), transport=transport))
            chosen.add(p.side.link(d.side.descriptor(offer), transport=transport))
    return "/".join(sorted(chosen))


def run(args: argparse.Namespace, spec, requests, block_hashes, source: str, max_model_len: int,
        storage_options: dict, log_dir: str, progress, reaper=None) -> dict:
    """Start the instances, link them, replay, stop them (their CTMs, links and boards go with them)."""
    n_p, n_d = parse_pd(args.pd)
    p_tp, d_tp, heads = tp_sizes(args)
    common = dict(model_id=f"replay/{source}", max_model_len=max_model_len, task_timeout=args.task_timeout,
                  record_latencies=True)
    with contextlib.ExitStack() as stack:
        prefills, decodes = [], []
        for role, n in (("prefill", n_p), ("decode", n_d)):
            for i in range(n):
                tp = p_tp if role == "prefill" else d_tp
                svc = CacheTransferService(
                    instance_layout(args, spec.num_blocks, tp) if args.model else
                    dataclasses.replace(spec, kv_heads=heads // tp), tp=tp,
                    num_cpu_blocks=args.host_blocks if role == "prefill" else 0,
                    storage_backend="none" if role == "decode" or args.storage == "none" else args.storage,
                    storage_options=storage_options if role == "prefill" else {},
                    log_dir=os.path.join(log_dir, f"{role}{i}"), extra_flags={"splitwise_role": role}, **common)
                stack.enter_context(svc)
                if reaper is not None:
                    for pid in svc.pids().values():
                        reaper.watch(pid)
                inst = PrefillInstance(i, svc, args) if role == "prefill" else \
                    DecodeInstance(i, svc, digests=args.pd_digests)
                stack.callback(inst.side.close)  # before its service stops
                (prefills if role == "prefill" else decodes).append(inst)
        transport = link_all(prefills, decodes, args.pd_transport)
        print(f"P/D {n_p}:{n_d} up (TP {p_tp}:{d_tp}), {args.pd_mode} over {transport}", flush=True)
        result = _replay(args, prefills, decodes, requests, block_hashes, progress)
        result.update(pd=f"{n_p}:{n_d}", pd_mode=args.pd_mode, pd_transport=transport, prefill_tp=p_tp,
                      decode_tp=d_tp, pd_digests=args.pd_digests)
        return result


def _cache_stats(prefills: list[PrefillInstance]) -> dict:
    """The ``TierStats`` fields summed over the prefill instances."""
    totals = collections.Counter()
    for p in prefills:
        totals.update(dataclasses.asdict(p.cache.stats))
    return {**dataclasses.asdict(TierStats()), **totals}


def _replay(args, prefills: list[PrefillInstance], decodes: list[DecodeInstance], requests, block_hashes,
            progress) -> dict:
    steps = replay_tenants.plan(requests, block_hashes, args.tenants)
    tally = Tally([r for r, _, _ in steps], [h for _, h, _ in steps], args.kv_blocks_per_hash)
    tenants = replay_tenants.TenantTally()
    p_svc, d_svc = prefills[0].svc, decodes[0].svc
    stats = PDStats(stateful=bool(p_svc.layout.request_slots))
    ledger = ByteLedger(p_svc.tp * naive_block_bytes(p_svc.layout),
                        d_svc.tp * naive_block_bytes(d_svc.layout)) if args.model else None
    route_p, route_d = Router(len(prefills), args.route), Router(len(decodes), "round-robin")
    t0 = time.perf_counter()
    for done, (req, hashes, tenant) in enumerate(steps, start=1):
        ceiling = tally.ceiling(tenant.content_keys(hashes) if tenant else hashes)
        p, d = prefills[route_p.pick(req)], decodes[route_d.pick(req)]
        handoff = p.handoff = Handoff(p, d, req.line, hashes, args, stats, tenant)
        try:
            served = serve_request(p, p, req.line, hashes, log, tenant)
        except CapacityError as exc:
            log.warning("request on line %d skipped: %s", req.line, exc)
            tally.skipped += 1
            served = None
        finally:
            p.handoff = None
        if ledger is not None:
            ledger.add(_cache_stats(prefills), (handoff.entry[1], handoff.landed))
        if served is None:
            continue
        tally.add(req, served, ceiling)
        tenants.add(tenant, served.sources, ceiling, served.cross_tenant)
        progress.update(done, tally.hit_ratio())
    for p in prefills:
        if not p.cache.drain():
            log.warning("%s: storage writes or late tasks still outstanding at the end", p.id)
    elapsed = time.perf_counter() - t0
    cache_stats = _cache_stats(prefills)
    latencies = [x for p in prefills for x in p.svc.latencies_ms]
    # every group, layer and rank of a prefill instance (of a K/V model: every head of the model)
    block_bytes = p_svc.tp * p_svc.layout.bytes_per_block()
    result = summarize(tally, cache_stats, latencies, sum(p.svc.busy_seconds() for p in prefills), block_bytes,
                       elapsed, args, bounce_blocks=sum(p.cache.block_counts()["bounce"] for p in prefills),
                       metrics_port=None)
    result.update(stats.result())
    tenants.cross["pd"] += stats.cross_tenant
    result.update(tenants.result(args.tenants))
    if ledger is not None:
        ledger.close(cache_stats)
        result.update(model_result(args.model, p_svc.layout, p_svc.tp, args, ledger))
    result["slowest_requests"] = replay_records.slowest([(i.id, i.svc) for i in prefills + decodes])
    result["_timeline"], result["_pd_timeline"] = tally.timeline, stats.timeline
    return result


# ---------------------------------------------------------------------------- report
def summary_rows(r: dict) -> list[tuple[str, str]]:
    gib = 2**30
    return [("P/D", f"{r['pd']} (TP {r['prefill_tp']}:{r['decode_tp']}, {r['pd_mode']} over {r['pd_transport']}): "
                    f"{r['pd_requests']} requests decoded, "
                    f"{r['pd_blocks']} blocks, {r['pd_bytes'] / gib:.3f} GiB at {r['pd_gbps']:.2f} GB/s"),
            ("P/D transfer", f"p50 {r['pd_transfer_p50_ms']:.2f} ms, p99 {r['pd_transfer_p99_ms']:.2f} ms"
                             + (f"; last layer visible {r['pd_layer_visible_ms']:.2f} ms after computed (p50)"
                                if r["pd_layer_visible_ms"] is not None else "")),
            ("P/D checks", f"{r['pd_blocks'] - r['pd_corrupt_blocks']} blocks bit-exact on decode, "
                           f"{r['pd_corrupt_blocks']} corrupt, {r['pd_failed_transfers']} failed transfers, "
                           f"{r['pd_digest_mismatches']} digest mismatches (digests {'on' if r['pd_digests'] else 'off'})"
                           + (f"; {r['pd_state_slots'] - r['pd_corrupt_state_slots']} request states bit-exact, "
                              f"{r['pd_corrupt_state_slots']} corrupt" if "pd_state_slots" in r else ""))]


def plot_panel(ax, timeline: list) -> None:
    """Per served request: the P/D transfer's time (dots, left, log scale) over its bytes (shaded, right)."""
    x = np.arange(1, len(timeline) + 1)
    ms = np.array([m for m, _ in timeline], dtype=float)
    right = ax.twinx()
    right.fill_between(x, np.array([b for _, b in timeline], dtype=float) / 2**20, step="mid", color="#b2df8a",
                       alpha=0.6, label="bytes")
    right.set_ylabel("P/D bytes (MiB)")
    ax.set_zorder(right.get_zorder() + 1)  # the dots over the shading
    ax.patch.set_visible(False)
    ax.plot(x, ms, ".", color="#6a3d9a", markersize=2, label="transfer time")
    if np.nanmax(ms, initial=0) > 0:
        ax.set_yscale("log")
    ax.set_ylabel("P/D transfer (ms)")
    ax.set_xlabel("request")
    handles = ax.get_lines() + right.collections[:1]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left")
