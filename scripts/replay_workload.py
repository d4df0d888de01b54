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
from dataclasses import dataclass

import numpy as np

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
    """Deterministic bytes of every block: per kv head, words = index * golden + tag(hash, layer,
    head, kind), where head is the model's (rank * heads per rank + h).  So instances of different
    TP sizes agree on a block's bytes head by head, and with one head per rank (the single-engine
    replay) the head is the rank."""

    def __init__(self, svc):
        self.views = {}
        for rank, caches in enumerate(svc.caches.tensors):
            for kind in KINDS:
                for layer, t in enumerate(caches[kind]):
                    self.views[(rank, kind, layer)] = svc.platform.raw_view(t).view(np.uint64)
        self.heads = svc.spec.kv_heads
        words = next(iter(self.views.values())).shape[1]
        self.base = np.arange(words // self.heads, dtype=np.uint64) * GOLDEN

    def _expected(self, hashes: list[str], rank: int, kind: str, layer: int) -> np.ndarray:
        heads = np.arange(rank * self.heads, (rank + 1) * self.heads, dtype=np.uint64)
        salt = (heads << np.uint64(40)) | np.uint64((KINDS.index(kind) << 32) | (layer << 48))
        tags = np.array([int(h[:16], 16) for h in hashes], dtype=np.uint64)[:, None] ^ salt[None, :]
        return (self.base[None, None, :] + tags[:, :, None]).reshape(len(hashes), -1)

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


@dataclass
class Served:
    """What one request got: per block, the tier that served it ("miss" once computed), and the
    verification counts of the blocks found."""

    sources: list[str]
    verified: int  # transferred into device blocks (from host or storage) and bit-exact
    device_hits: int  # already on device: checked, no bytes moved
    corrupt: int  # found with wrong bytes: recomputed


def serve_request(cache, content: Content, line: int, hashes: list[str], log: logging.Logger) -> Served:
    """One request through an engine's ``TieredPrefixCache``: acquire its prefix, verify every block
    found against its expected bytes (a wrong one is logged and recomputed), compute the misses,
    commit and release (the write policy's writes go out).  Raises ``CapacityError``."""
    lease = cache.acquire(hashes)
    hit_pos = [i for i, s in enumerate(lease.sources) if s != "miss"]
    ok = content.verify([hashes[i] for i in hit_pos], [lease.gpu_blocks[i] for i in hit_pos])
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
    content.write([hashes[i] for i in miss_pos], [lease.gpu_blocks[i] for i in miss_pos])
    cache.commit(lease)
    cache.release(lease)
    return Served(list(lease.sources), verified, device_hits, corrupt)


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
