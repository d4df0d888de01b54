#!/usr/bin/env python3
"""The cache layouts of the 2026 models (``cache_manager.cache_presets``) at their real block sizes,
through swap, file storage and P/D, against floors of the same bytes measured in the same run.

Per preset (--presets) and TP (--tp): ``preset(name, layers=--layers, dim_scale=1, tp=TP)``, i.e.
the real bytes of one block of every group on one rank (deepseek-v3: 128 KiB latent + 16 KiB rope
per layer; glm-5: + a 32 KiB indexer; deepseek-v4: down to 1 KiB for the 128:1 group), only the
first --layers layers of the pattern.  N blocks per transfer: enough for --mib MiB per rank, at
most --max-blocks, halved while the run would not fit the memory available (see below).  Two real
engine instances, each a ``CacheTransferService`` with TP CTM processes: D (2N device blocks, N
host blocks, the file store in a temporary directory, fsync off) and P (the prefill side, 2N
blocks).  Per repetition, on fresh random block ids, timed from the engine:

  memcpy          floor: one contiguous copy of the same bytes (every rank's), ``copy_contiguous``
                  with the CTMs' copy threads (CTM_COPY_THREADS or the cores, times TP), as
                  bench_swap and bench_pd take it
  swap_out/in     D.swap_to_cpu / swap_to_gpu of N blocks (every block group, every layer)
  kernel          diagnostic: the block copies a swap-out runs, from this process, without a task:
                  per rank (ranks in parallel threads) one ``copy_blocks`` per group, the same ids
                  into a host buffer: the same number of copies of the same sizes
  raw_file        floor of storage: each rank's bytes as one new file written (no fsync: the store
                  runs with fsync off) and read back, the ranks in parallel threads (bench_storage's
                  floor of the file backend's default path)
  storage         D.write_storage of N blocks under fresh keys, then D.read_storage into others;
                  a sliding-window group keeps objects only for the blocks inside its window at
                  the end of the write, so its bytes (and the floor's) are those
  ipc_pull        D.pull_blocks from P over the same-host path (``ipc``), against memcpy of the
                  bytes it moves (a sliding-window group moves only its window: its last blocks)
  te_pull         the same over the Mooncake Transfer Engine (TCP on loopback), against the raw
                  floor of bench_pd: this process's own engine making ``batch_transfer_sync_read``
                  of exactly the runs a CTM builds (per group, every layer, adjacent blocks
                  coalesced), ranks in parallel, at most --te-chunk 64 KiB slices per batch
  *_tiny          diagnostic: a task of 1 block (the fixed cost per task)
  group kernels   diagnostic, rank 0: one group's ``copy_blocks`` against ``copy_contiguous`` of
                  that group's bytes, so a small group's cost per block shows on its own

A layout with a state group (qwen3-next's conv + SSM state per request) swaps and stores its block
groups (block tasks never touch a state slot; the bench gives it 1 slot, not num_blocks / 4, to
save memory); the P/D link is tried, and where it is refused (by design, for a state group) its P/D
figures are null with the refusal as the reason; where it is accepted, the pull moves the blocks
only.  Any figure that fails is null with its error under "reasons"; the run goes on.

Memory: every CTM process holds about --ctm-mib MiB besides the caches (paddle and Python; ~480 MiB
measured), so TP 8 with P/D is 16 processes, ~8 GiB, before any cache.  N is halved until the
caches (D: 2N device + N host blocks, P: 2N), the store's staging and the bench's own buffers
(about 9 x N x bytes per block x TP in all) plus the processes fit in MemAvailable less
--reserve-gib, or the case is skipped with a reason.  The defaults (16 MiB per rank, 4 layers) put
TP 8 at ~9 GiB for the largest block (1 MiB per rank): it fits a 2-core 24 GiB machine.

Ratios are floor time / figure time (the figure's GB/s over the floor's), medians of --repeats
interleaved repetitions (the order rotated each time) after one warm-up.  Prints a table per
preset and TP, then one JSON line: {"bench": "layouts", "results": [{"preset", "tp", "blocks",
"bytes_per_block", "swap_out_ratio", "swap_in_ratio", "storage_write_ratio", "storage_read_ratio",
"pd_ipc_ratio", "pd_mooncake_ratio" (over the raw Transfer Engine floor), "pd_mooncake_over_memcpy",
the diagnostics, GB/s and ms behind them, "groups", "reasons"}, ...], "floor_gbps": the median of
the cases' memcpy floors}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Callable

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import per_rank, quiet_paddle, rounded

quiet_paddle()

import numpy as np  # noqa: E402

from bench_pd_raw import TE_SLICE, RawTe, batches, te_params  # noqa: E402
from bench_storage import read_whole_file  # noqa: E402
from cache_manager.cache_layout import CacheLayout  # noqa: E402
from cache_manager.cache_presets import PRESETS, preset  # noqa: E402
from engine_hooks import CacheTransferService  # noqa: E402
from engine_hooks.pd import PrefillDecode, offer_for  # noqa: E402
from ops import _block_copy  # noqa: E402
from ops.cpu import default_copy_threads  # noqa: E402
from transfer_factory.keys import chain_hash_ids  # noqa: E402
from transfer_factory.peer.te import block_addresses, coalesce  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TIMEOUT = 120.0
RATIOS = ("swap_out_ratio", "swap_in_ratio", "storage_write_ratio", "storage_read_ratio", "pd_ipc_ratio",
          "pd_mooncake_ratio")


# ---------------------------------------------------------------------- sizes
def layout_for(name: str, blocks: int, layers: int, tp: int) -> CacheLayout:
    """The preset at real block sizes; a state group gets one slot (block tasks never touch it)."""
    layout = preset(name, num_blocks=blocks, layers=layers, dim_scale=1, tp=tp)
    if layout.state_slots:
        layout = dataclasses.replace(layout, state_slots=1)
    return layout


def state_bytes(layout: CacheLayout) -> int:
    return sum(g.block_bytes * len(g.layers) * layout.state_slots for g in layout.groups if g.per_request)


def window_first(layout: CacheLayout, n: int) -> dict[str, int]:
    """Per block group, the index of the first of a request's ``n`` blocks P/D moves (its window)."""
    out = {}
    for g in layout.block_groups():
        w = g.window_blocks(layout.block_size)
        out[g.name] = 0 if w is None else max(0, n - w)
    return out


def pd_bytes(layout: CacheLayout, n: int) -> int:
    """Bytes one rank moves in a P/D pull of ``n`` blocks."""
    first = window_first(layout, n)
    return sum(g.block_bytes * len(g.layers) * (n - first[g.name]) for g in layout.block_groups())


def storage_blocks(layout: CacheLayout, n: int) -> dict[str, int]:
    """Per block group, how many of a write's ``n`` blocks it stores an object for: a sliding-window
    group only those inside its window at the end of the write (a stored prefix ends at a block
    boundary: ``window_blocks(aligned=True)``)."""
    out = {}
    for g in layout.block_groups():
        w = g.window_blocks(layout.block_size, aligned=True)
        out[g.name] = n if w is None else min(n, w)
    return out


def storage_bytes(layout: CacheLayout, n: int) -> int:
    """Bytes one rank writes (and reads back) in a storage task of ``n`` blocks."""
    stored = storage_blocks(layout, n)
    return sum(g.block_bytes * len(g.layers) * stored[g.name] for g in layout.block_groups())


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return 0


def memory_needed(bpb: int, state: int, n: int, tp: int, services: int, ctm_bytes: int) -> int:
    caches = tp * (3 * n * bpb + state) + (services - 1) * tp * (2 * n * bpb + state)  # D: 2N + N host; P: 2N
    bench = 2 * n * bpb * tp + n * bpb  # memcpy src/dst (also the raw file floor's buffers), page cache of files
    return caches + bench + 2 * n * bpb * tp + services * tp * ctm_bytes  # + the store's staging


# ---------------------------------------------------------------------- helpers
def views(svc: CacheTransferService) -> list[dict[str, list[np.ndarray]]]:
    """Per rank, group -> per-layer writable [rows, block_bytes] views of the engine's caches."""
    return [{kind: [svc.platform.raw_view(t) for t in layers] for kind, layers in caches.items()}
            for caches in svc.caches.tensors]


def fill(svc: CacheTransferService, seed: int) -> None:
    """Random bytes everywhere: no zero pages, no first-touch faults in a timed copy."""
    rng = np.random.default_rng(seed)
    for rank_views in views(svc):
        for layers in rank_views.values():
            for v in layers:
                v[:] = np.frombuffer(rng.bytes(v.size), dtype=np.uint8).reshape(v.shape)


def write_new_file(path: str, data: np.ndarray) -> None:
    """The raw floor of a write with fsync off: ``data`` as one new file, written sequentially."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)


def expect(got, want, what: str) -> None:
    if list(got) != list(want):
        raise RuntimeError(f"{what} moved {len(got)} of {len(want)} blocks")


def fmt(value: float | None, width: int = 6, digits: int = 2) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


# ---------------------------------------------------------------------- one preset at one TP
class Case:
    def __init__(self, name: str, tp: int, n: int, args: argparse.Namespace, root: str, log: logging.Logger):
        self.name, self.tp, self.n, self.args, self.log = name, tp, n, args, log
        self.layout = layout_for(name, 2 * n, args.layers, tp)
        self.groups = self.layout.block_groups()
        self.bpb = self.layout.bytes_per_block()
        self.bytes = n * self.bpb * tp  # a swap or storage task, every rank
        self.pd_bytes = pd_bytes(self.layout, n) * tp
        self.storage_bytes = storage_bytes(self.layout, n) * tp
        self.first = window_first(self.layout, n)
        self.parts = [part for part in args.parts if part != "pd" or name not in args.skip_pd]
        self.threads = default_copy_threads() * tp
        self.rng = np.random.default_rng(args.seed)
        self.root = root
        self.services: list[CacheTransferService] = []
        self.sides: list[PrefillDecode] = []
        self.raw: RawTe | None = None
        self.src = np.ones(self.bytes, dtype=np.uint8)  # written: no zero pages for the floors
        self.dst = np.ones(self.bytes, dtype=np.uint8)
        self.tag = 0

    def start(self) -> None:
        common = dict(tp=self.tp, task_timeout=TIMEOUT, max_model_len=self.layout.block_size * self.n,
                      model_id=f"bench/{self.name}")
        self.d_svc = CacheTransferService(self.layout, num_cpu_blocks=self.n, storage_backend="file",
                                          storage_options={"root": self.root, "fsync": False}, **common)
        self.services.append(self.d_svc)
        self.d_svc.start()
        fill(self.d_svc, 1)
        self.d_views = views(self.d_svc)
        if "pd" in self.parts:
            self.p_svc = CacheTransferService(self.layout, num_cpu_blocks=1, **common)
            self.services.append(self.p_svc)
            self.p_svc.start()
            fill(self.p_svc, 2)
            self.p_views = views(self.p_svc)
            self.d = PrefillDecode(self.d_svc, "decode")
            self.sides.append(self.d)
            self.p = PrefillDecode(self.p_svc, "prefill")
            self.sides.append(self.p)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        for side in reversed(self.sides):
            side.close()
        for svc in reversed(self.services):
            svc.shutdown()

    # ------------------------------------------------------------------ ids
    def ids(self) -> tuple[list[int], list[int], list[int]]:
        """N distinct device ids, another N, and a permutation of the N host ids."""
        a = self.rng.choice(2 * self.n, self.n, replace=False).tolist()
        b = self.rng.choice(2 * self.n, self.n, replace=False).tolist()
        return a, b, self.rng.permutation(self.n).tolist()

    # ------------------------------------------------------------------ floors
    def memcpy(self, nbytes: int) -> None:
        _block_copy.copy_contiguous(int(self.dst.ctypes.data), int(self.src.ctypes.data), nbytes, self.threads)

    def raw_file(self) -> dict[str, float]:
        share = self.storage_bytes // self.tp
        self.tag += 1
        paths = [os.path.join(self.root, f"raw-{self.tag}-rank{r}") for r in range(self.tp)]
        t0 = time.perf_counter()
        per_rank(lambda r: write_new_file(paths[r], self.src[r * share:(r + 1) * share]), self.tp)
        t1 = time.perf_counter()
        per_rank(lambda r: read_whole_file(paths[r], self.dst[r * share:(r + 1) * share]), self.tp)
        t2 = time.perf_counter()
        for p in paths:
            os.unlink(p)
        return {"raw_file_write": t1 - t0, "raw_file_read": t2 - t1}

    def _group_copy(self, r: int, g, dev: list[int], host: list[int], offset: int) -> int:
        """One ``copy_blocks`` of group ``g`` of rank ``r``: device blocks ``dev`` into a layer-major
        host area of ``self.dst`` at ``offset`` (what a swap-out of that group runs)."""
        layers = self.d_views[r][g.name]
        nl, bb = len(layers), g.block_bytes
        src_bases = np.asarray([int(v.ctypes.data) for v in layers], dtype=np.int64)
        dst_bases = int(self.dst.ctypes.data) + offset + np.arange(nl, dtype=np.int64) * (self.n * bb)
        return _block_copy.copy_blocks(src_bases, np.full(nl, 2 * self.n, dtype=np.int64), bb, dev, "device",
                                       dst_bases, np.full(nl, self.n, dtype=np.int64), bb, host, "host",
                                       bb, default_copy_threads())

    def kernel(self, dev: list[int], host: list[int]) -> None:
        def rank(r: int) -> None:
            offset = r * self.n * self.bpb
            for g in self.groups:
                self._group_copy(r, g, dev, host, offset)
                offset += self.n * g.block_bytes * len(g.layers)
        per_rank(rank, self.tp)

    def group_kernels(self, dev: list[int], host: list[int]) -> dict[str, float]:
        out = {}
        for g in self.groups:
            nbytes = self.n * g.block_bytes * len(g.layers)
            t0 = time.perf_counter()
            self._group_copy(0, g, dev, host, 0)
            t1 = time.perf_counter()
            _block_copy.copy_contiguous(int(self.dst.ctypes.data), int(self.src.ctypes.data), nbytes,
                                        default_copy_threads())
            t2 = time.perf_counter()
            out[f"group_kernel:{g.name}"], out[f"group_memcpy:{g.name}"] = t1 - t0, t2 - t1
        return out

    # ------------------------------------------------------------------ tasks
    def swap(self) -> dict[str, float]:
        dev, dev2, host = self.ids()
        t0 = time.perf_counter()
        got = self.d_svc.swap_to_cpu(dev, host, timeout=TIMEOUT).result(timeout=TIMEOUT)
        t1 = time.perf_counter()
        expect(got[3], dev, "swap out")
        got = self.d_svc.swap_to_gpu(dev2, host, timeout=TIMEOUT).result(timeout=TIMEOUT)
        t2 = time.perf_counter()
        expect(got[3], dev2, "swap in")
        return {"swap_out": t1 - t0, "swap_in": t2 - t1}

    def swap_tiny(self) -> None:
        self.d_svc.swap_to_cpu([0], [0], timeout=TIMEOUT).result(timeout=TIMEOUT)

    def storage(self) -> dict[str, float]:
        src, dst, _ = self.ids()
        self.tag += 1
        keys = chain_hash_ids([f"{self.name}-{self.tp}-{self.tag}-{i}" for i in range(self.n)])
        t0 = time.perf_counter()
        expect(self.d_svc.write_storage(keys, src, timeout=TIMEOUT).result(TIMEOUT + 60), src, "storage write")
        t1 = time.perf_counter()
        expect(self.d_svc.read_storage(keys, dst, timeout=TIMEOUT).result(TIMEOUT + 60), dst, "storage read")
        t2 = time.perf_counter()
        return {"storage_write": t1 - t0, "storage_read": t2 - t1}

    def pull(self, src: list[int], dst: list[int]) -> None:
        self.tag += 1
        handle = self.p.expose(f"req-{self.tag}")
        try:
            got = self.d.pull_blocks("prefill", handle, src, dst, timeout=TIMEOUT).result(timeout=TIMEOUT)
        finally:
            self.p.retract(handle)
        expect(got, dst, "pull")

    def link(self, transport: str) -> None:
        for side, peer in ((self.p, self.d), (self.d, self.p)):
            if side.link(peer.descriptor(offer_for(transport)), transport=transport) != transport:
                raise RuntimeError(f"the link did not take {transport}")

    def unlink(self) -> None:
        self.p.unlink("decode")
        self.d.unlink("prefill")

    def te_runs(self, src: list[int], dst: list[int]) -> list[tuple[list[int], list[int], list[int]]]:
        """Per rank, what the CTM's ``TransferEngineChannel.move`` builds for a pull of ``src`` of P
        into ``dst`` of D: per group, every layer, its window's blocks, adjacent blocks coalesced."""
        out = []
        for r in range(self.tp):
            remote: dict[str, dict[int, int]] = {}
            for kind, layer, ptr, _ in self.p_te[r]["regions"]:
                remote.setdefault(kind, {})[layer] = int(ptr)
            runs: tuple[list[int], list[int], list[int]] = ([], [], [])
            for g in self.groups:
                local = self.d_views[r][g.name]
                rows = range(len(local))
                lb = np.asarray([int(v.ctypes.data) for v in local], dtype=np.int64)
                rb = np.asarray([remote[g.name][i] for i in rows], dtype=np.int64)
                first = self.first[g.name]
                part = coalesce(block_addresses(lb, g.block_bytes, dst[first:], rows),
                                block_addresses(rb, g.block_bytes, src[first:], rows), g.block_bytes)
                for acc, p in zip(runs, part):
                    acc += p
            out.append(runs)
        return out

    def raw_te_read(self, src: list[int], dst: list[int]) -> float:
        chunks = [batches(runs, self.args.te_chunk) for runs in self.te_runs(src, dst)]  # built before the clock
        t0 = time.perf_counter()
        per_rank(lambda r: self.raw.read(self.p_te[r]["address"], chunks[r]), self.tp)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ the run
    def measure(self, rounds: dict[str, Callable[[], object]], reasons: dict[str, str]) -> dict[str, float]:
        """Each round once to warm up, then --repeats times interleaved, its place in the order
        rotated each time.  A round returns None (it is timed here), seconds, or {figure: seconds}.
        A failing round is left out of that repetition and its error kept; a figure with fewer
        than half its repetitions is dropped (null)."""
        times: dict[str, list[float]] = {}
        names = list(rounds)
        reps = self.args.repeats
        for rep in range(reps + 1):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                try:
                    t0 = time.perf_counter()
                    value = rounds[name]()
                    elapsed = time.perf_counter() - t0
                except Exception as exc:  # noqa: BLE001  (reported, the other figures go on)
                    reasons.setdefault(name, f"{type(exc).__name__}: {exc}"[:300])
                    continue
                got = value if isinstance(value, dict) else {name: elapsed if value is None else value}
                if rep:
                    for fig, seconds in got.items():
                        times.setdefault(fig, []).append(seconds)
        return {fig: statistics.median(ts) for fig, ts in times.items() if 2 * len(ts) >= reps}

    def run(self) -> dict:
        reasons: dict[str, str] = {}
        med: dict[str, float] = {}
        parts = self.parts
        rounds: dict[str, Callable[[], object]] = {"memcpy": lambda: self.memcpy(self.bytes)}
        if "swap" in parts:
            def kernel() -> dict[str, float]:
                dev, _, host = self.ids()
                t0 = time.perf_counter()
                self.kernel(dev, host)
                return {"kernel": time.perf_counter() - t0, **self.group_kernels(dev, host)}
            rounds.update(swap=self.swap, swap_tiny=self.swap_tiny, kernel=kernel)
        if "storage" in parts:
            rounds.update(raw_file=self.raw_file, storage=self.storage)
        pd = "pd" in parts
        if pd:
            try:
                self.link("ipc")
            except Exception as exc:  # noqa: BLE001  (refused by design for a state group; the other parts go on)
                reasons["ipc_pull"] = reasons["te_pull"] = f"link refused: {type(exc).__name__}: {exc}"[:300]
                pd = False
            else:
                rounds.update(memcpy_pd=lambda: self.memcpy(self.pd_bytes),
                              ipc_pull=lambda: self.pull(*self.ids()[:2]), ipc_tiny=lambda: self.pull([0], [1]))
        med.update(self.measure(rounds, reasons))
        if pd:
            try:
                self.unlink()
                self.link("mooncake")
                self.p_te = te_params(self.p)
                self.raw = RawTe(self.d_views, self.p_views, self.log)
            except Exception as exc:  # noqa: BLE001
                reasons["te_pull"] = f"the Transfer Engine link failed: {type(exc).__name__}: {exc}"[:300]
            else:
                ids: list[tuple[list[int], list[int]]] = []

                def te_round() -> dict[str, float]:
                    src, dst, _ = self.ids()
                    ids.append((src, dst))
                    out = {}
                    try:
                        out["raw_te_read"] = self.raw_te_read(src, dst)
                    except Exception as exc:  # noqa: BLE001  (the pull is still measured)
                        reasons.setdefault("raw_te_read", f"{type(exc).__name__}: {exc}"[:300])
                    t0 = time.perf_counter()
                    self.pull(src, dst)
                    return {**out, "te_pull": time.perf_counter() - t0}
                med.update(self.measure({"memcpy_te": lambda: self.memcpy(self.pd_bytes), "te": te_round,
                                         "te_tiny": lambda: self.pull([0], [1])}, reasons))
                runs = self.te_runs(*ids[0])[0] if ids else ([], [], [])
                self.te_stats = {"te_runs_per_rank": len(runs[2]),
                                 "te_slices_per_rank": sum(-(-n // TE_SLICE) for n in runs[2])}
        return self.result(med, reasons)

    def result(self, med: dict[str, float], reasons: dict[str, str]) -> dict:
        def ratio(floor: str, figure: str) -> float | None:
            return med[floor] / med[figure] if floor in med and figure in med else None

        r: dict = {"preset": self.name, "tp": self.tp, "layers": self.layout.total_layers, "blocks": self.n,
                   "bytes_per_block": self.bpb, "bytes_per_task": self.bytes, "pd_bytes_per_task": self.pd_bytes,
                   "storage_bytes_per_task": self.storage_bytes,
                   "swap_out_ratio": ratio("memcpy", "swap_out"), "swap_in_ratio": ratio("memcpy", "swap_in"),
                   "storage_write_ratio": ratio("raw_file_write", "storage_write"),
                   "storage_read_ratio": ratio("raw_file_read", "storage_read"),
                   "pd_ipc_ratio": ratio("memcpy_pd", "ipc_pull"),
                   "pd_mooncake_ratio": ratio("raw_te_read", "te_pull"),
                   "pd_mooncake_over_memcpy": ratio("memcpy_te", "te_pull"),
                   "kernel_ratio": ratio("memcpy", "kernel")}
        for name, nbytes in (("memcpy", self.bytes), ("swap_out", self.bytes), ("swap_in", self.bytes),
                             ("kernel", self.bytes), ("raw_file_write", self.storage_bytes),
                             ("raw_file_read", self.storage_bytes), ("storage_write", self.storage_bytes),
                             ("storage_read", self.storage_bytes),
                             ("ipc_pull", self.pd_bytes), ("raw_te_read", self.pd_bytes), ("te_pull", self.pd_bytes)):
            r[f"{name}_gbps"] = nbytes / med[name] / 1e9 if name in med else None
        for name in ("swap_tiny", "ipc_tiny", "te_tiny", "swap_out", "ipc_pull", "te_pull"):
            r[f"{name}_ms"] = med[name] * 1e3 if name in med else None
        r["groups"] = [{"name": g.name, "block_bytes": g.block_bytes, "layers": len(g.layers),
                        "pd_blocks": self.n - self.first[g.name],
                        "kernel_ratio": ratio(f"group_memcpy:{g.name}", f"group_kernel:{g.name}")}
                       for g in self.groups]
        r.update(getattr(self, "te_stats", {}))
        # Why a figure is null: the part was not asked for, P/D refuses the layout, or it failed.
        why = {"swap_out_ratio": ("swap", ("swap", "memcpy")), "swap_in_ratio": ("swap", ("swap", "memcpy")),
               "storage_write_ratio": ("storage", ("storage", "raw_file")),
               "storage_read_ratio": ("storage", ("storage", "raw_file")),
               "pd_ipc_ratio": ("pd", ("ipc_pull", "memcpy_pd")),
               "pd_mooncake_ratio": ("pd", ("te_pull", "te", "raw_te_read"))}
        out_reasons = {}
        for key, (part, rounds) in why.items():
            if r[key] is not None:
                continue
            if part not in self.parts:
                out_reasons[key] = ("not measured (--skip-pd)" if part == "pd" and "pd" in self.args.parts
                                    else f"not measured (--parts {','.join(self.args.parts)})")
            else:
                out_reasons[key] = "; ".join(f"{n}: {reasons[n]}" for n in rounds if n in reasons) \
                    or "fewer than half the repetitions succeeded"
        r["reasons"] = out_reasons
        r["errors"] = reasons
        return r


def skipped(name: str, tp: int, reason: str, layout: CacheLayout | None = None) -> dict:
    r: dict = {"preset": name, "tp": tp, "bytes_per_block": layout.bytes_per_block() if layout else None}
    r.update({k: None for k in RATIOS})
    r["reasons"] = {k: reason for k in RATIOS}
    return r


def run_case(name: str, tp: int, args: argparse.Namespace, log: logging.Logger) -> dict:
    probe = layout_for(name, 2, args.layers, tp)
    bpb, state = probe.bytes_per_block(), state_bytes(probe)
    if not bpb:
        return skipped(name, tp, f"no block group in the first {args.layers} layers", probe)
    services = 2 if "pd" in args.parts and name not in args.skip_pd else 1
    n = max(1, min(args.max_blocks, -(-args.mib * MiB // bpb)))
    budget = mem_available() - args.reserve_gib * GiB
    while n > 1 and memory_needed(bpb, state, n, tp, services, args.ctm_mib * MiB) > budget:
        n //= 2
    need = memory_needed(bpb, state, n, tp, services, args.ctm_mib * MiB)
    if need > budget:
        return skipped(name, tp, f"needs ~{need / GiB:.1f} GiB, {max(budget, 0) / GiB:.1f} GiB available "
                       f"(MemAvailable less --reserve-gib)", probe)
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as root:
        case = Case(name, tp, n, args, root, log)
        try:
            case.start()
            return case.run()
        except Exception as exc:  # noqa: BLE001  (one case failing leaves the others)
            log.exception("%s at TP %d", name, tp)
            return skipped(name, tp, f"{type(exc).__name__}: {exc}"[:300], case.layout)
        finally:
            case.close()


def print_result(r: dict) -> None:
    if "blocks" not in r:
        print(f"{r['preset']:>12} TP {r['tp']}: skipped: {next(iter(r['reasons'].values()))}", flush=True)
        return
    print(f"{r['preset']:>12} TP {r['tp']}: {r['blocks']} blocks of {r['bytes_per_block'] / KiB:.0f} KiB per rank "
          f"({r['bytes_per_task'] / MiB:.1f} MiB per task; storage {r['storage_bytes_per_task'] / MiB:.1f}, P/D "
          f"{r['pd_bytes_per_task'] / MiB:.1f} MiB), memcpy "
          f"{fmt(r['memcpy_gbps'])} GB/s", flush=True)
    print(f"{'':>12} swap out/in {fmt(r['swap_out_ratio'])} / {fmt(r['swap_in_ratio'])} (kernel alone "
          f"{fmt(r['kernel_ratio'])}, 1-block task {fmt(r['swap_tiny_ms'])} ms) | storage write/read "
          f"{fmt(r['storage_write_ratio'])} / {fmt(r['storage_read_ratio'])} | P/D ipc {fmt(r['pd_ipc_ratio'])} "
          f"mooncake {fmt(r['pd_mooncake_ratio'])} of raw TE ({fmt(r['pd_mooncake_over_memcpy'], 5, 3)} of memcpy)",
          flush=True)
    groups = ", ".join(f"{g['name']} {g['block_bytes'] / KiB:g} KiB x {g['layers']}: {fmt(g['kernel_ratio'], 4)}"
                       for g in r["groups"])
    print(f"{'':>12} group kernels (rank 0, over memcpy of the group's bytes): {groups}", flush=True)
    if "te_runs_per_rank" in r:
        print(f"{'':>12} Transfer Engine: {r['te_runs_per_rank']} runs, {r['te_slices_per_rank']} slices per rank; "
              f"1-block pull ipc {fmt(r['ipc_tiny_ms'])} ms, TE {fmt(r['te_tiny_ms'])} ms", flush=True)
    for key, reason in r["reasons"].items():
        print(f"{'':>12} {key}: null ({reason})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    p.add_argument("--tp", default="1,2,8", help="comma-separated TP sizes")
    p.add_argument("--layers", type=int, default=4, help="the first layers of each preset's pattern")
    p.add_argument("--mib", type=int, default=16, help="MiB per rank per task (blocks: this over bytes per block)")
    p.add_argument("--max-blocks", type=int, default=64, help="at most this many blocks per task")
    p.add_argument("--repeats", "--reps", type=int, default=5, help="repetitions (medians)")
    p.add_argument("--parts", default="swap,storage,pd", help="comma-separated of swap, storage, pd")
    p.add_argument("--skip-pd", default="", help="comma-separated presets whose P/D is not measured")
    p.add_argument("--te-chunk", type=int, default=1024, help="most 64 KiB slices per raw Transfer Engine batch")
    p.add_argument("--ctm-mib", type=int, default=500, help="memory of one CTM process besides caches, MiB")
    p.add_argument("--reserve-gib", type=float, default=3.0, help="memory left to others, GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    names = [v for v in args.presets.split(",") if v]
    unknown = [v for v in names if v not in PRESETS]
    if unknown:
        p.error(f"unknown preset {unknown[0]!r}; presets: {', '.join(PRESETS)}")
    try:
        tps = [int(v) for v in args.tp.split(",") if v]
    except ValueError:
        p.error(f"--tp {args.tp!r} is not a list of integers")
    args.parts = [v for v in args.parts.split(",") if v]
    args.skip_pd = [v for v in args.skip_pd.split(",") if v]
    if any(v not in PRESETS for v in args.skip_pd):
        p.error(f"--skip-pd {args.skip_pd}: presets are {', '.join(PRESETS)}")
    if not set(args.parts) <= {"swap", "storage", "pd"} or not args.parts:
        p.error("--parts takes swap, storage and pd")
    if not names or not tps or min(tps) < 1 or min(args.layers, args.mib, args.max_blocks, args.repeats,
                                                    args.te_chunk) < 1:
        p.error("--presets, --tp, --layers, --mib, --max-blocks, --repeats and --te-chunk must be positive")
    _common.setup_logging(args.verbose)
    log = logging.getLogger("bench_layouts")
    print(f"presets {', '.join(names)}; TP {', '.join(map(str, tps))}; {args.layers} layers; {args.mib} MiB per rank "
          f"per task (at most {args.max_blocks} blocks); {default_copy_threads()} copy threads per rank; median of "
          f"{args.repeats}; ratios are floor time / task time", flush=True)
    results = []
    for tp in tps:
        for name in names:
            r = run_case(name, tp, args, log)
            results.append(r)
            print_result(r)
    floors = [r["memcpy_gbps"] for r in results if r.get("memcpy_gbps")]

    print(json.dumps({"bench": "layouts", "layers": args.layers, "mib": args.mib, "repeats": args.repeats,
                      "copy_threads": default_copy_threads(), "results": rounded(results),
                      "floor_gbps": round(statistics.median(floors), 4) if floors else None}))


if __name__ == "__main__":
    main()
