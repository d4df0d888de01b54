"""The commit leases of one staged mover's write calls (DESIGN §3.8).

Every staged write call runs under a ``CommitLease`` of its task.  A lease is live until the call
returns; two things revoke it: the task, before it answers, when the call outlived the deadline
(``late``), and the mover's close (``revoke_all``: an RL clear, the CTM's exit).  A backend that
honours leases (the file store) commits nothing once its lease is revoked.  A call that had
already begun committing, or whose backend cannot refuse a commit (Mooncake's put is one call),
may still store its objects after the answer: ``late`` hands that call back to the task, which
reports it as ``Outcome.still_storing``.  Such a call reads only its staging buffer, a snapshot
taken on the task's thread while the task owned its device blocks, so the objects it may still
store are the right bytes for their keys; it never touches a device block.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from transfer_factory.kvcache_storage import CommitLease


class WriteLeases:
    def __init__(self, honours_lease: bool, backend_name: str, log: logging.Logger) -> None:
        self._honours_lease = honours_lease
        self._backend_name = backend_name
        self._log = log
        self._live: set[CommitLease] = set()  # of write calls not yet returned: revoked by a close
        self._lock = threading.Lock()

    def track(self, lease: CommitLease, future: Future) -> None:
        """``lease`` is the running call ``future``'s until it returns (or is cancelled)."""
        with self._lock:
            self._live.add(lease)
        future.add_done_callback(lambda _f: self._forget(lease))

    def _forget(self, lease: CommitLease) -> None:
        with self._lock:
            self._live.discard(lease)

    def late(self, future: Future, lease: CommitLease, what: str) -> Future | None:
        """A write call still running at its task's deadline: revoke its lease before the task
        answers.  Returns the call when it may still store objects (it had begun committing, or
        its backend cannot refuse a commit), None when it now stores nothing."""
        committing = lease.revoke()
        if committing or not self._honours_lease:
            self._log.error(
                "storage %s: the late call may still store its objects (%s); they hold the snapshot taken while "
                "the task owned its device blocks, so they are right for their keys.  The task answers now, "
                "counting none of these blocks stored, and its device blocks are free; only the staging buffer "
                "waits for the call (and a drain or RL clear waits for it too)", what,
                "it had begun committing" if committing else f"{self._backend_name} cannot refuse a commit")
            return future
        self._log.warning("storage %s: its lease is revoked; the late call stores nothing", what)
        return None

    def revoke_all(self) -> None:
        """A write call still running commits nothing from now on (a close)."""
        with self._lock:
            leases = list(self._live)
        for lease in leases:
            lease.revoke()
