"""The decode side of the replay's prefill/decode mode (``replay_pd.py``): a decode instance, which
owns the free list of its device blocks, and ``PDStats``, the figures of what reached the decode
instances (the ``pd_*`` keys of the replay's JSON line)."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from engine_hooks import CacheTransferService
from engine_hooks.pd import PrefillDecode
from engine_hooks.prefix_cache import CapacityError
from replay_workload import Content


# ---------------------------------------------------------------------------- decode side
class DecodeInstance:
    """A decode instance: its service, its P/D side, and free lists of its device blocks and (a
    layout with state groups) its request slots, which hold a request's blocks and state only while
    it decodes."""

    def __init__(self, index: int, svc: CacheTransferService, digests: bool = False):
        self.id = f"decode-{index}"
        self.svc, self.side, self.content = svc, PrefillDecode(svc, self.id, digests=digests), Content(svc)
        self.free: collections.deque[int] = collections.deque(range(svc.layout.num_blocks))
        self.free_slots: collections.deque[int] = collections.deque(range(svc.layout.request_slots))
        # blocks (and a state slot) a failed transfer may still write, until released() says not
        self.held: list[tuple[list[int], object, int | None]] = []

    def _reclaim(self) -> None:
        for held in [h for h in self.held if h[1]()]:  # what failed transfers let go of
            self.held.remove(held)
            self._free(held[0], held[2])

    def _free(self, blocks: list[int], slot: int | None) -> None:
        self.free.extend(blocks)
        if slot is not None:
            self.free_slots.append(slot)

    def allocate(self, n: int) -> list[int]:
        self._reclaim()
        if len(self.free) < n:
            raise CapacityError(f"{self.id}: {n} blocks wanted, {len(self.free)} free "
                                f"({sum(len(b) for b, _, _ in self.held)} held by failed transfers)")
        return [self.free.popleft() for _ in range(n)]

    def allocate_slot(self) -> int | None:
        """A request slot for the state groups' state (None: the layout has none)."""
        if not self.svc.layout.request_slots:
            return None
        self._reclaim()
        if not self.free_slots:
            raise CapacityError(f"{self.id}: no free request slot ({len(self.held)} held by failed transfers)")
        return self.free_slots.popleft()

    def give_back(self, blocks: list[int], released=None, slot: int | None = None) -> None:
        """Blocks (and a request slot) back to the free lists, or held until ``released()`` says
        nothing writes them."""
        if released is None or released():
            self._free(blocks, slot)
        else:
            self.held.append((blocks, released, slot))


# ---------------------------------------------------------------------------- figures
@dataclasses.dataclass
class PDStats:
    requests: int = 0  # decoded: every block arrived bit-exact
    blocks: int = 0  # arrived on a decode instance (bit-exact or not)
    bytes: int = 0
    corrupt: int = 0
    failed: int = 0
    stateful: bool = False  # the layout has state groups: a request's state slot moves too
    states: int = 0  # state slots that arrived on a decode instance (bit-exact or not)
    corrupt_states: int = 0
    cross_tenant: int = 0  # blocks that arrived holding another tenant's bytes (replay_tenants)
    digest_mismatches: int = 0  # pulled blocks whose bytes differed from the prefill's digests (failed)
    transfer_ms: list = dataclasses.field(default_factory=list)
    visible_ms: list = dataclasses.field(default_factory=list)
    timeline: list = dataclasses.field(default_factory=list)  # (transfer ms or nan, bytes) per served request

    def result(self) -> dict:
        """The ``pd_*`` keys of the JSON line."""
        lat = np.array(self.transfer_ms) if self.transfer_ms else np.zeros(1)
        busy_s = sum(self.transfer_ms) / 1e3
        vis = self.visible_ms
        state = {"pd_state_slots": self.states, "pd_corrupt_state_slots": self.corrupt_states} if self.stateful else {}
        return {"pd_requests": self.requests, "pd_blocks": self.blocks, **state, "pd_bytes": self.bytes,
                "pd_digest_mismatches": self.digest_mismatches,
                "pd_gbps": self.bytes / busy_s / 1e9 if busy_s else 0.0,
                "pd_transfer_p50_ms": float(np.percentile(lat, 50)),
                "pd_transfer_p99_ms": float(np.percentile(lat, 99)),
                "pd_layer_visible_ms": float(np.percentile(vis, 50)) if vis else None,
                "pd_layer_visible_p99_ms": float(np.percentile(vis, 99)) if vis else None,
                "pd_corrupt_blocks": self.corrupt, "pd_failed_transfers": self.failed}
