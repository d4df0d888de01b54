"""Shared pieces of the multi-process tests: a small model, and a byte-level model of the tiers."""
from __future__ import annotations

import os

import numpy as np

from engine_hooks import CacheSpec, CacheTransferService
from ops.shm_ledger import process_state

SMALL = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)
NUM_CPU_BLOCKS = 8


def start_service(spec: CacheSpec = SMALL, tp: int = 2, num_cpu_blocks: int = NUM_CPU_BLOCKS, **kw) -> CacheTransferService:
    return CacheTransferService(spec, tp=tp, num_cpu_blocks=num_cpu_blocks, task_timeout=20.0, **kw).start()


def views(svc: CacheTransferService) -> dict[tuple[int, str, int], np.ndarray]:
    """(rank, kind, layer) -> writable [num_blocks, block_bytes] view of the engine's device cache."""
    out = {}
    for rank, caches in enumerate(svc.caches.tensors):
        for kind, layers in caches.items():
            for layer, tensor in enumerate(layers):
                out[(rank, kind, layer)] = svc.platform.raw_view(tensor)
    return out


def fill_distinct(svc: CacheTransferService, seed: int) -> None:
    """Random bytes everywhere; every rank's shard differs from every other's."""
    rng = np.random.default_rng(seed)
    for view in views(svc).values():
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)


def segments_of(svc_port: int) -> list[str]:
    """Every /dev/shm name the service with this engine_worker_queue_port can leave behind."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ctm.{svc_port}.") or n.endswith(f".{svc_port}"))


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (a zombie waiting to be reaped counts as gone).  A process
    that ends between opening and reading its ``/proc`` entry (ESRCH) is gone too."""
    state = process_state(pid)
    return state is None or state[1] in ("Z", "X")


def block_bytes(svc: CacheTransferService, ids) -> dict:
    """(rank, kind, layer) -> a copy of blocks ``ids`` of that cache."""
    return {k: v[list(ids)].copy() for k, v in views(svc).items()}


def write_random_blocks(svc: CacheTransferService, ids, seed: int) -> dict:
    """The engine writes fresh random bytes into blocks ``ids`` of every cache; returns them."""
    rng = np.random.default_rng(seed)
    for v in views(svc).values():
        v[list(ids)] = rng.integers(0, 256, v[list(ids)].shape, dtype=np.uint8)
    return block_bytes(svc, ids)
