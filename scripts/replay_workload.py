"""The replay's workload: Mooncake-format JSONL traces (``timestamp``, ``input_length``,
``output_length``, ``hash_ids`` of 512-token prefix blocks), a seeded multi-turn workload of the
same format, and the chained block hashes of a request's KV blocks.  (Importers put the repo on
``sys.path``: ``scripts/_common.py`` does it for the scripts.)"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from transfer_factory.keys import chain_hash_ids

HASH_BLOCK_TOKENS = 512


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
