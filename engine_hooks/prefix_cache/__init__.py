"""The tiered prefix cache on top of the service (``cache.TieredPrefixCache``): its device pool, host
tier, write policies, storage writes in flight and vocabulary (``tiers``)."""
from .cache import TIERS, WRITE_POLICIES, CapacityError, Lease, TierStats, TieredPrefixCache

__all__ = ["TIERS", "WRITE_POLICIES", "CapacityError", "Lease", "TierStats", "TieredPrefixCache"]
