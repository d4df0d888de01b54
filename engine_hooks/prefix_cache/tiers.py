"""The prefix cache's vocabulary: the tiers a block comes from, a request's lease on its blocks, and
what moved between the tiers (as the ranks reported it)."""
from __future__ import annotations

from dataclasses import dataclass

TIERS = ("device", "host", "storage", "miss")


class CapacityError(ValueError):
    """A request needs more device blocks than the pool can ever free for it."""


@dataclass
class Lease:
    """One request's blocks: the device block and where its contents came from, per position."""

    hashes: list[str]  # salted with ``cache_salt`` (``transfer_factory.keys.salted_hashes``)
    gpu_blocks: list[int]
    sources: list[str]
    cache_salt: str | None = None  # the tenant's salt (vLLM's name); None: unsalted
    request_id: str | None = None  # the engine's request id, carried by every task made for the lease

    def positions(self, tier: str) -> list[int]:
        return [i for i, s in enumerate(self.sources) if s == tier]


@dataclass
class TierStats:
    """Blocks and bytes that actually moved, as the ranks reported them."""

    swap_out_blocks: int = 0  # device -> host, tasks that succeeded on every rank
    swap_in_blocks: int = 0  # host -> device, likewise
    storage_write_blocks: int = 0  # blocks newly in storage, from the write futures' results
    storage_read_blocks: int = 0  # blocks loaded from storage, from the read futures' results
    failed_loads: int = 0  # swap-in blocks that failed, plus failed storage read tasks
    dropped_blocks: int = 0  # evicted device blocks that did not reach the host tier
    # bytes per direction: sum over ranks of RankResult.bytes_moved (failed tasks' partial moves too)
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    bytes_to_storage: int = 0
    bytes_from_storage: int = 0
    quarantined_blocks: int = 0  # device blocks ever held back for a late task
    quarantined_slots: int = 0  # host slots ever held back for a late task

    def add(self, **counts: int) -> None:
        """Count what moved: ``stats.add(swap_in_blocks=2, bytes_h2d=n)``.  The owners of the
        counters (the cache and its write policy) count through this, never by assignment."""
        for name, n in counts.items():
            if name not in self.__dataclass_fields__:
                raise AttributeError(f"TierStats has no counter {name!r}")
            setattr(self, name, getattr(self, name) + n)
