"""The replay's tenants (``replay_trace.py --tenants N``, DESIGN §4.2): every request of the trace is
replayed once per tenant, interleaved (request 1 of tenant 0, of tenant 1, ..., request 2 of tenant 0,
...), each tenant with its own ``cache_salt``.  The prefix cache is handed the trace's block hashes
unchanged for every tenant: only the salt may keep the tenants apart.

What a tenant's blocks hold differs too: the content (``replay_workload.Content``) of tenant ``t``
is derived from ``content_keys``, a per-tenant digest of each block hash, so a block one tenant
computed and another tenant was served has the wrong bytes for it.  A served block whose bytes are
another tenant's is a *cross-tenant hit*, counted per tier (device, host, storage, and P/D for the
blocks a decode instance received), and is recomputed, never used.  Each tenant's ceiling is the
trace's own (its blocks seen before by that tenant), so the replay shows whether each tenant alone
reaches it.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tenant:
    index: int
    count: int  # tenants in the replay

    @property
    def salt(self) -> str:
        return f"tenant-{self.index}"

    def content_keys(self, hashes: list[str]) -> list[str]:
        """The keys this tenant's block contents derive from (not the cache's keys: those are the salt's)."""
        return [hashlib.sha256(f"{self.salt}/{h}".encode()).hexdigest() for h in hashes]

    def others(self) -> list["Tenant"]:
        return [Tenant(i, self.count) for i in range(self.count) if i != self.index]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenants", type=int, default=1,
                   help="replay every request once per tenant, each with its own cache_salt; the JSON line adds "
                        "cross_tenant_hits per tier and each tenant's hit ratio and ceiling")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tenants < 1 or args.tenants > 64:
        parser.error(f"--tenants {args.tenants} must be in 1..64")
    if args.tenants > 1 and args.instances > 1:
        parser.error("--tenants is replayed by one instance or over --pd, not with --instances")


def plan(requests: list, block_hashes: list[list[str]], tenants: int) -> list[tuple]:
    """(request, its block hashes, its tenant or None) in replay order."""
    if tenants <= 1:
        return [(r, h, None) for r, h in zip(requests, block_hashes)]
    return [(r, h, Tenant(t, tenants)) for r, h in zip(requests, block_hashes) for t in range(tenants)]


def cross_tenant(content, tenant: "Tenant | None", hashes: list[str], blocks: list[int], tail=None) -> list[bool]:
    """Per block: whether its bytes are another tenant's (for blocks that failed this tenant's check)."""
    found = [False] * len(blocks)
    if tenant is None or not blocks:
        return found
    for other in tenant.others():
        ok = content.verify(other.content_keys(hashes), blocks, tail=tail)
        found = [f or bool(o) for f, o in zip(found, ok)]
    return found


@dataclass
class TenantTally:
    """Each tenant's blocks, hits and ceiling, and the cross-tenant hits per tier."""

    blocks: collections.Counter = field(default_factory=collections.Counter)
    hits: collections.Counter = field(default_factory=collections.Counter)
    ceiling: collections.Counter = field(default_factory=collections.Counter)
    cross: collections.Counter = field(default_factory=collections.Counter)

    def add(self, tenant: "Tenant | None", sources: list[str], ceiling: int, cross: collections.Counter) -> None:
        if tenant is None:
            return
        self.blocks[tenant.index] += len(sources)
        self.hits[tenant.index] += sum(s != "miss" for s in sources)
        self.ceiling[tenant.index] += ceiling
        self.cross.update(cross)

    def result(self, tenants: int) -> dict:
        if tenants <= 1:
            return {}
        ratio = {t: (self.hits[t] / self.blocks[t] if self.blocks[t] else 0.0) for t in range(tenants)}
        ceiling = {t: (self.ceiling[t] / self.blocks[t] if self.blocks[t] else 0.0) for t in range(tenants)}
        return {"tenants": tenants,
                "cross_tenant_hits": {tier: self.cross[tier] for tier in ("device", "host", "storage", "pd")},
                "tenant_hit_ratios": [round(ratio[t], 6) for t in range(tenants)],
                "tenant_ceilings": [round(ceiling[t], 6) for t in range(tenants)]}


def summary_rows(r: dict) -> list[tuple[str, str]]:
    if r.get("tenants", 1) <= 1:
        return []
    cross = r["cross_tenant_hits"]
    ratios = ", ".join(f"{h:.2%} (ceiling {c:.2%})" for h, c in zip(r["tenant_hit_ratios"], r["tenant_ceilings"]))
    return [("tenants", f"{r['tenants']}, each with its own cache_salt: hit ratio {ratios}"),
            ("  cross-tenant hits", ", ".join(f"{tier} {n}" for tier, n in cross.items()))]
