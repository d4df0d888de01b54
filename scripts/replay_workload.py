"""The replay's workload: Mooncake-format JSONL traces (``timestamp``, ``input_length``,
``output_length``, ``hash_ids`` of 512-token prefix blocks), a seeded multi-turn workload of the
same format, and the chained block hashes of a request's KV blocks; and what one engine does with
a request (``serve_request``: look the prefix up, verify what was loaded, compute the misses as
deterministic ``Content``) and the tally of what the requests got (``Tally``), shared by the
single-engine replay and the engine instances of ``replay_instances``.  (Importers put the repo on
``sys.path``: ``scripts/_common.py`` does it for the scripts.)"""
from __future__ import annotations

import collections
import json
import logging
import random
from dataclasses import dataclass, field

import numpy as np

import replay_records
from replay_tenants import Tenant, cross_tenant
from transfer_factory.keys import chain_hash_ids

HASH_BLOCK_TOKENS = 512
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
KINDS = ("key_caches", "value_caches")


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


# ---------------------------------------------------------------------------- one engine's step
class Content:
    """Deterministic bytes of every block of every block group: per kv head, words = index * golden +
    tag(hash, model layer, head, group), where head is the model's (rank * heads per rank + h) for a
    group split by heads, and 0 on every rank for a replicated one (every rank holds the same copy).
    So instances of different TP sizes agree on a block's bytes head by head, and with one head per
    rank (the single-engine replay of a ``CacheSpec``) the head is the rank.  A state group (one slot
    per request, not per block: qwen3-next's conv and SSM state) holds a request's state in its slot
    (``write_state``, ``verify_state``: words of (the request's last block hash, layer, rank, group));
    the prefix cache's tiers move blocks only, a prefill/decode transfer moves the slot too.

    A sliding-window group matters only inside its window, the last blocks of a request: checked
    with ``tail`` (how many blocks of its request follow each block), it is checked on the blocks
    attention reads (``reads``: the window's blocks of a request that ends at a block boundary, as
    every cached prefix, and every request of the replay, does; storage keeps only those).  A
    prefill/decode transfer moves one block more (``moved``, ``TensorGroup.window_blocks``: a window
    may start inside a block), whose bytes ``same_as`` compares with the prefill side's.  Every
    other group is checked on every block.

    ``parts`` (``states``: of the state groups, a row per slot) holds, per (rank, group, model
    layer), the tensor's writable view and what its words are; a view is of uint64 words where a
    head's bytes are whole words, else of bytes."""

    def __init__(self, svc):
        layout = svc.layout
        self.parts: dict[tuple[int, str, int], _Part] = {}
        self.states: dict[tuple[int, str, int], _Part] = {}
        for rank, caches in enumerate(svc.caches.tensors):
            for index, group in enumerate(layout.groups):
                if group.per_request:  # a whole slot per rank: ranks of one TP size exchange it rank for rank
                    for i, layer in enumerate(group.layers):
                        raw = svc.platform.raw_view(caches[group.name][i])
                        words = raw.shape[1] % 8 == 0
                        self.states[(rank, group.name, layer)] = _Part(
                            raw.view(np.uint64) if words else raw, index, layer, rank, 1, raw.shape[1], words,
                            None, None)
                    continue
                split = group.tp == "split"
                heads = group.block_shape[0] if split else 1
                moved = group.window_blocks(layout.block_size)
                reads = None if moved is None else -(-group.window // layout.block_size)
                for i, layer in enumerate(group.layers):
                    raw = svc.platform.raw_view(caches[group.name][i])
                    head_bytes = raw.shape[1] // heads
                    words = head_bytes % 8 == 0
                    self.parts[(rank, group.name, layer)] = _Part(
                        raw.view(np.uint64) if words else raw, index, layer, rank * heads if split else 0, heads,
                        head_bytes, words, reads, moved)

    @staticmethod
    def _expected(part: "_Part", tags: np.ndarray, cache: dict, which) -> np.ndarray:
        """The bytes of ``part``'s blocks whose hash tags are ``tags``.  ``cache``: within one call,
        where ``which`` names the rows ``tags`` are, a replicated group's copy on another rank."""
        key = (part.group, part.layer, part.first_head, which)
        if key in cache:
            return cache[key]
        heads = np.arange(part.first_head, part.first_head + part.heads, dtype=np.uint64)
        salt = (heads << np.uint64(40)) | np.uint64((part.group << 32) | (part.layer << 48))
        base = np.arange(-(-part.head_bytes // 8), dtype=np.uint64) * GOLDEN
        out = base[None, None, :] + (tags[:, None] ^ salt[None, :])[:, :, None]
        if part.words:
            out = out.reshape(len(tags), -1)
        else:  # a head of a few bytes: the leading bytes of its words
            out = out.view(np.uint8)[:, :, :part.head_bytes].reshape(len(tags), -1)
        cache[key] = out
        return out

    @staticmethod
    def _tags(hashes: list[str]) -> np.ndarray:
        return np.array([int(h[:16], 16) for h in hashes], dtype=np.uint64)

    def write(self, hashes: list[str], blocks: list[int], layer: int | None = None) -> None:
        """The blocks' bytes in every group's tensors (``layer``: only those of that model layer, as
        a layer-wise push computes them layer by layer)."""
        if not blocks:
            return
        tags, cache = self._tags(hashes), {}
        for part in self.parts.values():
            if layer is None or part.layer == layer:
                part.view[blocks] = self._expected(part, tags, cache, None)

    def verify(self, hashes: list[str], blocks: list[int], tail: list[int] | None = None) -> np.ndarray:
        """Per block: True when every rank, group and layer holds exactly the expected bytes (with
        ``tail``, a sliding-window group only where attention reads it: see the class)."""
        ok = np.ones(len(blocks), dtype=bool)
        if not blocks:
            return ok
        tags, cache = self._tags(hashes), {}
        ids = np.asarray(blocks)
        after = None if tail is None else np.asarray(tail)
        for part in self.parts.values():
            if after is None or part.reads is None:
                ok &= (part.view[ids] == self._expected(part, tags, cache, None)).all(axis=1)
                continue
            rows = np.flatnonzero(after < part.reads)
            if len(rows):
                ok[rows] &= (part.view[ids[rows]] == self._expected(part, tags[rows], cache, part.reads)).all(axis=1)
        return ok

    def write_state(self, key: str, slot: int) -> None:
        """A request's state (``key``: its last block's hash) into slot ``slot`` of every state group."""
        tags, cache = self._tags([key]), {}
        for part in self.states.values():
            part.view[slot] = self._expected(part, tags, cache, None)[0]

    def verify_state(self, key: str, slot: int) -> bool:
        """Whether slot ``slot`` of every state group, layer and rank holds the request's state."""
        tags, cache = self._tags([key]), {}
        return all(bool((part.view[slot] == self._expected(part, tags, cache, None)[0]).all())
                   for part in self.states.values())

    def same_as(self, source: "Content", blocks: list[int], source_blocks: list[int]) -> np.ndarray:
        """Per block of a request (in order) that a prefill/decode transfer moved from ``source``'s
        ``source_blocks`` into ``blocks`` here: True when the window blocks it moves past those
        attention reads (``moved`` past ``reads``) hold exactly the source's bytes.  Both sides of
        one TP size (rank for rank)."""
        ok = np.ones(len(blocks), dtype=bool)
        after = np.arange(len(blocks) - 1, -1, -1)
        ids, src = np.asarray(blocks), np.asarray(source_blocks)
        for key, part in self.parts.items():
            if part.moved is None:
                continue
            rows = np.flatnonzero((after >= part.reads) & (after < part.moved))
            if len(rows):
                ok[rows] &= (part.view[ids[rows]] == source.parts[key].view[src[rows]]).all(axis=1)
        return ok


@dataclass(frozen=True)
class _Part:
    """One tensor of ``Content``: its view, the group's index in the layout, the model layer, the
    model's first head on this rank and the heads it holds (one for a replicated group), the bytes of
    one head's block, whether the view is of words, and a sliding-window group's window in blocks
    (those attention reads of a block-aligned request, those a prefill/decode transfer moves)."""

    view: np.ndarray
    group: int
    layer: int
    first_head: int
    heads: int
    head_bytes: int
    words: bool
    reads: int | None
    moved: int | None


@dataclass
class Served:
    """What one request got: per block, the tier that served it ("miss" once computed), and the
    verification counts of the blocks found."""

    sources: list[str]
    verified: int  # transferred into device blocks (from host or storage) and bit-exact
    device_hits: int  # already on device: checked, no bytes moved
    corrupt: int  # found with wrong bytes: recomputed
    cross_tenant: collections.Counter = field(default_factory=collections.Counter)  # per tier


def serve_request(cache, content: Content, line: int, hashes: list[str], log: logging.Logger,
                  tenant: "Tenant | None" = None) -> Served:
    """One request through an engine's ``TieredPrefixCache``: acquire its prefix, verify every block
    found against its expected bytes (a sliding-window group's inside the request's window:
    ``Content``; a wrong one is logged and recomputed), compute the misses, commit and release (the
    write policy's writes go out).  ``tenant`` (``replay_tenants``): the request's cache_salt, and the
    keys its contents derive from.  Raises ``CapacityError``."""
    salt = tenant.salt if tenant is not None else None
    lease = cache.acquire(hashes, cache_salt=salt, request_id=replay_records.request_id(line, tenant))
    keys = tenant.content_keys(hashes) if tenant is not None else hashes
    hit_pos = [i for i, s in enumerate(lease.sources) if s != "miss"]
    ok = content.verify([keys[i] for i in hit_pos], [lease.gpu_blocks[i] for i in hit_pos],
                        tail=[len(hashes) - 1 - i for i in hit_pos])
    bad = [i for i, good in zip(hit_pos, ok) if not good]
    foreign = cross_tenant(content, tenant, [hashes[i] for i in bad], [lease.gpu_blocks[i] for i in bad],
                           tail=[len(hashes) - 1 - i for i in bad])
    cross = collections.Counter(lease.sources[i] for i, f in zip(bad, foreign) if f)
    verified = device_hits = corrupt = 0
    for i, good in zip(hit_pos, ok):
        if good:
            # a device hit is checked too, but only a transferred block proves a transfer right
            if lease.sources[i] == "device":
                device_hits += 1
            else:
                verified += 1
        else:
            corrupt += 1
            log.error("line %d block %d from %s has wrong bytes: recomputing it", line, i, lease.sources[i])
            lease.sources[i] = "miss"
    cache.svc.metrics.record_sources(lease.sources)  # what each tier served, after verification
    miss_pos = lease.positions("miss")
    content.write([keys[i] for i in miss_pos], [lease.gpu_blocks[i] for i in miss_pos])
    cache.commit(lease)
    cache.release(lease)
    return Served(list(lease.sources), verified, device_hits, corrupt, cross)


class Tally:
    """What the requests got, against the trace's ceiling (blocks whose prefix was seen before)."""

    def __init__(self, requests: list[Request], request_block_hashes: list[list[str]], kv_blocks_per_hash: int):
        self.requests = requests
        self.all_blocks = sum(len(h) for h in request_block_hashes)  # skipped requests' too: the ceiling's denominator
        self.tokens_per_block = HASH_BLOCK_TOKENS // kv_blocks_per_hash
        self.seen: set[str] = set()
        self.counts: collections.Counter = collections.Counter()
        self.timeline: list[tuple[int, int, collections.Counter]] = []  # (blocks, ceiling, per tier) per request
        self.verified = self.device_hits = self.corrupt = self.skipped = 0
        self.theoretical_hits = self.saved_tokens = 0

    def ceiling(self, hashes: list[str]) -> int:
        """The request's blocks seen before (call once per request, in order, served or not)."""
        c = sum(h in self.seen for h in hashes)
        self.theoretical_hits += c
        self.seen.update(hashes)
        return c

    def add(self, req: Request, served: Served, ceiling: int) -> collections.Counter:
        self.verified += served.verified
        self.device_hits += served.device_hits
        self.corrupt += served.corrupt
        per_tier = collections.Counter(served.sources)
        self.counts.update(per_tier)
        tpb = self.tokens_per_block
        for i, s in enumerate(served.sources):
            if s != "miss":
                self.saved_tokens += max(0, min(tpb, req.input_length - i * tpb))
        self.timeline.append((len(served.sources), ceiling, per_tier))
        return per_tier

    @property
    def blocks(self) -> int:
        return sum(self.counts.values())

    def hit_ratio(self) -> float:
        blocks = self.blocks
        return (blocks - self.counts["miss"]) / blocks if blocks else 0.0

    def ratios(self) -> dict:
        """The summary's leading keys, in their order."""
        blocks, c = self.blocks, self.counts
        return {
            "requests": len(self.requests) - self.skipped, "skipped_requests": self.skipped, "blocks": blocks,
            "hit_blocks": blocks - c["miss"], "hit_ratio": self.hit_ratio(),
            "device_hit_ratio": c["device"] / blocks if blocks else 0.0,
            "host_hit_ratio": c["host"] / blocks if blocks else 0.0,
            "storage_hit_ratio": c["storage"] / blocks if blocks else 0.0,
            "miss_ratio": c["miss"] / blocks if blocks else 0.0,
            "theoretical_hit_ratio": self.theoretical_hits / self.all_blocks if self.all_blocks else 0.0,
            "prefill_tokens_saved": self.saved_tokens,
            "prefill_tokens_total": sum(r.input_length for r in self.requests),
        }


# ---------------------------------------------------------------------------- bytes per request
# each tier of the prefix cache: the TierStats fields of (its bytes, its blocks)
TIER_FIELDS = {"device_to_host": ("bytes_d2h", "swap_out_blocks"), "host_to_device": ("bytes_h2d", "swap_in_blocks"),
               "to_storage": ("bytes_to_storage", "storage_write_blocks"),
               "from_storage": ("bytes_from_storage", "storage_read_blocks")}


def naive_block_bytes(layout) -> int:
    """One block of the naive all-layers-full layout on one rank: every layer of the model (its
    speculative layers too) holds, uncompressed (compress 1) and whole (no window), the block groups
    of the layout's widest layer.  So K/V on every layer is its own naive layout; a linear-attention
    layer (state groups only) counts as a full-attention one; a compressed group counts
    ``compress`` times its entries.  State groups (per request, not per block) are left out."""
    groups = layout.block_groups()
    widest = max(sum(g.block_bytes * g.compress for g in groups if layer in g.layers)
                 for layer in range(layout.total_layers))
    return widest * layout.total_layers


class ByteLedger:
    """Per request and per tier, the bytes the ranks report having moved while the request was
    served (``TIER_FIELDS``, and ``pd``: its prefill/decode hand-off), beside what the naive layout
    (``naive_block_bytes``, every rank) would have moved for the same blocks.  A transfer that
    completes after its request (a write-through write) counts in a later request; what is still
    outstanding at the end, in the last (``close``), so the totals are the run's."""

    def __init__(self, naive_block_bytes: int, naive_pd_block_bytes: int | None = None):
        self.naive, self.naive_pd = naive_block_bytes, naive_pd_block_bytes
        self.last = {f: 0 for pair in TIER_FIELDS.values() for f in pair}
        tiers = [*TIER_FIELDS, *(["pd"] if naive_pd_block_bytes is not None else [])]
        self.rows: dict[str, list[tuple[int, int]]] = {t: [] for t in tiers}  # (bytes, naive bytes) per request

    def _deltas(self, stats: dict) -> dict[str, tuple[int, int]]:
        out = {tier: (stats[b] - self.last[b], (stats[n] - self.last[n]) * self.naive)
               for tier, (b, n) in TIER_FIELDS.items()}
        self.last = {f: stats[f] for f in self.last}
        return out

    def add(self, stats: dict, pd: tuple[int, int] = (0, 0)) -> None:
        """After one request, served or skipped: ``stats``, the cumulative ``TierStats`` fields
        (summed over the engines); ``pd``, the (bytes, blocks) its hand-off moved."""
        for tier, row in self._deltas(stats).items():
            self.rows[tier].append(row)
        if "pd" in self.rows:
            self.rows["pd"].append((pd[0], pd[1] * self.naive_pd))

    def close(self, stats: dict) -> None:
        """At the end: what completed after the last request counts in it."""
        for tier, (moved, naive) in self._deltas(stats).items():
            if self.rows[tier]:
                b, n = self.rows[tier][-1]
                self.rows[tier][-1] = (b + moved, n + naive)

    def result(self) -> dict:
        """``bytes_per_request`` and ``naive_bytes_per_request``: per tier (and ``all``, their sum
        per request), the median over requests, the mean and the run's total."""
        def figures(values: list[int]) -> dict:
            return {"median": float(np.median(values)) if values else 0.0,
                    "mean": float(np.mean(values)) if values else 0.0, "total": int(sum(values))}

        out: dict = {"bytes_per_request": {}, "naive_bytes_per_request": {}}
        n = len(next(iter(self.rows.values())))
        for which, key in ((0, "bytes_per_request"), (1, "naive_bytes_per_request")):
            for tier, rows in self.rows.items():
                out[key][tier] = figures([r[which] for r in rows])
            out[key]["all"] = figures([sum(rows[i][which] for rows in self.rows.values()) for i in range(n)])
        return out


def model_result(model: str, layout, tp: int, args, ledger: ByteLedger) -> dict:
    """The JSON line's model keys: the preset, its scale, one block of every group and layer summed
    over the ranks (``bytes_per_block``; ``block_bytes`` too) and the naive layout's
    (``naive_bytes_per_block``), and the ledger's bytes per request."""
    return {"model": model, "model_layers": args.model_layers, "cache_layers": layout.total_layers,
            "model_dim_scale": args.model_dim_scale, "kv_blocks_per_hash": args.kv_blocks_per_hash,
            "layout_block_tokens": layout.block_size, "layout_digest": layout.digest(),
            "bytes_per_block": tp * layout.bytes_per_block(), "naive_bytes_per_block": tp * naive_block_bytes(layout),
            "naive_definition": "every model layer holds the widest layer's block groups uncompressed and whole "
                                "(compress 1, no window); state groups left out; summed over the ranks",
            **ledger.result()}


def summarize(tally: Tally, stats: dict, latencies_ms: list[float], busy_s: float, block_bytes: int, elapsed: float,
              args, bounce_blocks: int, metrics_port: int | None) -> dict:
    """The replay's result: the tally, and what the ranks report having moved (``stats``: the
    ``TierStats`` fields, summed over engines; bytes summed over ranks, a failed task's partial
    moves included)."""
    lat = np.array(latencies_ms) if latencies_ms else np.zeros(1)
    moved = {k: stats[k] for k in ("bytes_d2h", "bytes_h2d", "bytes_to_storage", "bytes_from_storage")}
    n = len(tally.requests)
    return {
        **tally.ratios(),
        **moved,
        # bytes moved over the wall time during which any transfer task was in flight
        "transfer_gbps": sum(moved.values()) / busy_s / 1e9 if busy_s else 0.0, "transfer_busy_s": busy_s,
        "task_p50_ms": float(np.percentile(lat, 50)), "task_p99_ms": float(np.percentile(lat, 99)),
        "tasks": len(latencies_ms), "verified_blocks": tally.verified, "device_hits": tally.device_hits,
        "corrupt_blocks": tally.corrupt, "block_bytes": block_bytes,
        **{k: stats[k] for k in ("swap_out_blocks", "swap_in_blocks", "storage_write_blocks", "storage_read_blocks",
                                 "dropped_blocks", "failed_loads", "quarantined_blocks", "quarantined_slots")},
        "elapsed_s": elapsed, "requests_per_s": n / elapsed if elapsed else 0.0,
        "write_policy": args.write_policy, "write_threshold": args.write_threshold,
        "bounce_blocks": bounce_blocks, "metrics_port": metrics_port,
    }
