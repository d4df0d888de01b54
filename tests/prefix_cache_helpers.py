"""Shared pieces of the TieredPrefixCache tests (test_prefix_cache*.py): the cache spec, services
over a file store, a rank stopped for a while, spies on the service's calls, a request run through
the cache, and a service whose reads answer but never release."""
import contextlib
import os
import signal
from concurrent.futures import Future

import numpy as np

from engine_hooks import CacheSpec
from tests.service_helpers import start_service, views

SPEC = CacheSpec(num_layers=2, num_blocks=4, kv_heads=1, block_size=4, head_dim=8)
LATE_TIMEOUT = 1.0  # task timeout of the stalled-rank tests: short, the rank is stopped anyway


def file_service(tmp_path, tp: int):
    """Body of the ``svc`` (tp=1) and ``svc2`` (tp=2) fixtures: a service over a file store in ``tmp_path``."""
    service = start_service(SPEC, tp=tp, num_cpu_blocks=8, storage_backend="file",
                            storage_options={"root": str(tmp_path), "fsync": False})
    yield service
    service.shutdown()


@contextlib.contextmanager
def stopped(svc, rank: int):
    """Rank ``rank``'s CTM SIGSTOPped (alive, answering nothing) for the block; SIGCONT after."""
    pid = svc.pids()[rank]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def spy(monkeypatch, svc, method: str) -> list:
    """Record (gpu block ids, future) of every ``svc.<method>`` call the cache makes."""
    calls = []
    real = getattr(svc, method)

    def wrapper(*args, **kw):
        future = real(*args, **kw)
        gpu = kw.get("gpu_block_ids", args[1] if method in ("read_storage", "write_storage") else args[0])
        calls.append((list(gpu), future))
        return future

    monkeypatch.setattr(svc, method, wrapper)
    return calls


def block_bytes_all_ranks(svc) -> int:
    """Bytes of one block over every rank, kind and layer: what one block's move reports in total."""
    return sum(view.shape[1] for view in views(svc).values())


def assert_accounted(cache) -> dict:
    counts = cache.block_counts()
    assert (counts["free"] + counts["cached"] + counts["pinned"] + counts["quarantined"] + counts["bounce"]
            == cache.num_device_blocks), counts
    assert counts["host_free"] + counts["host_cached"] + counts["host_quarantined"] == cache.num_host_blocks, counts
    return counts


def fill(svc, lease, salt: int) -> dict:
    """'Compute' the lease's blocks: distinct bytes per block; returns hash -> bytes of every view."""
    out = {}
    for i, (h, b) in enumerate(zip(lease.hashes, lease.gpu_blocks)):
        for key, view in views(svc).items():
            view[b] = (salt * 31 + i * 7 + hash(key) % 97) % 251
        out[h] = {key: view[b].copy() for key, view in views(svc).items()}
    return out


def run(cache, svc, hashes, salt, expect=None):
    lease = cache.acquire(hashes)
    if expect is not None:
        for i, s in enumerate(lease.sources):
            if s != "miss":
                for key, view in views(svc).items():
                    assert np.array_equal(view[lease.gpu_blocks[i]], expect[hashes[i]][key]), (i, s)
    content = fill(svc, lease, salt) if all(s == "miss" for s in lease.sources) else None
    cache.commit(lease)
    cache.release(lease)
    return lease, content


class _AnsweredNotReleased:
    """A service whose storage reads answer in time with 0 blocks while a direct backend call of
    theirs still runs (``released`` pending): the case real ranks report with ``released=False``."""

    def __init__(self):
        self.spec = SPEC
        self.num_cpu_blocks = 0
        self.reads = []

    def read_storage(self, keys, gpu_block_ids, start_read_block_idx=0, timeout=None, request_id=None):
        future = Future()
        future.released = Future()
        future.set_result([])
        self.reads.append((list(gpu_block_ids), future))
        return future
