"""Errors an engine sees from the CTM service.  Each names the task and the ranks involved."""
from __future__ import annotations


class CacheServiceError(Exception):
    """Base of every error the service raises or sets on a future."""


class StartupError(CacheServiceError):
    """A rank did not become ready; the message names it and carries the tail of its log."""


class ServiceClosed(CacheServiceError):
    """The service was shut down while the task was pending, or before it was submitted."""


class TaskFailedError(CacheServiceError):
    """One or more ranks ran the task and reported an error."""

    def __init__(self, task_id: str, failures: dict[int, str], loaded: list[int] | None = None,
                 digest_mismatches: int = 0):
        self.task_id = task_id
        self.failures = dict(sorted(failures.items()))
        # A P/D pull whose failed blocks are digest mismatches: the destination blocks loaded on every
        # rank all the same (None: none can be relied on), and the blocks that failed on any rank.
        self.loaded = loaded
        self.digest_mismatches = digest_mismatches
        detail = "; ".join(f"rank {r}: {reason}" for r, reason in self.failures.items())
        super().__init__(f"task {task_id} failed on {detail}")


class TaskTimeoutError(CacheServiceError, TimeoutError):
    def __init__(self, task_id: str, missing: list[int], timeout: float, peer: str | None = None):
        self.task_id = task_id
        self.missing_ranks = sorted(missing)
        self.peer = peer  # the other engine instance of a P/D transfer, which may be what hangs
        with_peer = f" (a transfer with instance {peer!r})" if peer else ""
        super().__init__(f"task {task_id}{with_peer} timed out after {timeout:g}s; no answer from ranks "
                         f"{self.missing_ranks}")


class RankDiedError(CacheServiceError):
    def __init__(self, task_id: str, rank: int, detail: str):
        self.task_id = task_id
        self.rank = rank
        super().__init__(f"task {task_id} failed: rank {rank} {detail}")


class CachesClearedError(CacheServiceError):
    """The KV caches are cleared for a weight update (``kv_cache_status`` is not NORMAL)."""


class CacheUpdateError(CacheServiceError):
    """``clear_caches`` or ``restore_caches`` could not complete: the message names the ranks and why."""
