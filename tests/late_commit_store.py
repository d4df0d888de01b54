"""A storage plugin for fault tests: a stalled write that stores its objects after its task answered.

A ``tests.slow_commit_store.SlowCommitStore`` (steered the same way, through ``stall_dir``) whose
``batch_set`` commits whatever the task's ``CommitLease`` says once the stall is over, in one of two
ways (option ``late``):

* ``"committing"``: it takes the lease's commit point (``lease.begin()``) *before* it stalls, as a
  file store whose disk froze in the middle of its append, the lease live when the commit began;
  the CTM's revoke then finds a commit under way;
* ``"unrefusing"``: it does not honour leases at all (``honours_commit_lease`` False), as Mooncake's
  put, one call with no commit point to refuse at.

Loaded by the CTM processes (``CTM_STORAGE_PLUGINS=latecommit=tests.late_commit_store:LateCommitStore``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from tests.slow_commit_store import SlowCommitStore
from transfer_factory.kvcache_storage import TIMEOUT, commit_lease, current_commit_lease

MODES = ("committing", "unrefusing")


class LateCommitStore(SlowCommitStore):
    name = "latecommit"

    def __init__(self, *, namespace: str, rank: int, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        self.late = options.pop("late", "unrefusing")
        if self.late not in MODES:
            raise ValueError(f"latecommit: option late {self.late!r} is not one of {MODES}")
        super().__init__(namespace=namespace, rank=rank, options=options)
        self.honours_commit_lease = self.late == "committing"

    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        lease = current_commit_lease() if self.late == "committing" else None
        if lease is not None and not lease.begin():
            return [TIMEOUT] * len(keys)          # refused before its commit point, as the file store does
        try:
            with commit_lease(None):              # the commit begun above (or never refusable) goes through
                return super().batch_set(keys, ptrs, sizes)
        finally:
            if lease is not None:
                lease.end()
