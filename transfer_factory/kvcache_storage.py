"""KVCacheStorage: the one interface every storage backend implements.

A backend stores opaque byte objects under string keys (DESIGN §3.7 builds the keys).
It is batch-first, and every result is a plain int per key, as in Mooncake's store API.

Primitives and their contracts:

``register_buffer(ptr, size)``
    Tell the backend about host memory it will read from or write into (staging buffers,
    or on the CPU platform the device caches themselves).  Registering twice is harmless.
``query(keys) -> int``
    How many leading keys are present: the length of the longest present prefix.
``exists(keys) -> list[int]``
    Per key: 1 present, 0 absent, negative on error.
``batch_get(keys, ptrs, sizes) -> list[int]``
    Copy each object into ``ptrs[i]`` (``sizes[i]`` bytes available).  Per key: bytes read
    (> 0), or a negative code (``NOT_FOUND``, ``CORRUPT``, ``BUFFER_TOO_SMALL``, ...).  A
    damaged object is never reported as read.
``batch_set(keys, ptrs, sizes) -> list[int]``
    Store ``sizes[i]`` bytes from ``ptrs[i]`` under each key.  Per key: 0 stored (also when
    the key already existed), or a negative code.
``batch_get_multi(keys, ptr_lists, size_lists)`` / ``batch_set_multi(...)``
    The same where one object is gathered from / scattered to several buffers (a block's
    layers in per-layer caches).  ``supports_multi_buffer`` says whether the backend does
    this natively; otherwise these fall back to one buffer per object and fail with
    ``INVALID`` when asked for more.
``delete(keys) -> list[int]``, ``clear()``, ``close()``
    Remove keys (0 or a negative code each), remove everything this backend wrote, release
    connections and buffers.  ``close`` is idempotent.

``access`` says how the CTM feeds a backend: ``HOST_STAGED`` backends get bytes through a
registered host buffer; ``DEVICE_DIRECT`` backends (EMS, AttentionStore) read and write the
device caches themselves.  The CTM asks; it never branches on backend names.
``staged_read_piece_bytes`` (0: one call per chunk) is for backends whose reads are CPU copies
with no round trip to pay per call (the file store): the CTM reads a staged chunk in pieces of
about this size and scatters each while it is still in the CPU cache.
``honours_commit_lease`` (False: never) says that ``batch_set[_multi]`` asks the calling thread's
``CommitLease`` (``commit_lease``) just before its commit point and stores nothing when refused:
the CTM can then let a write call outlive its task without an object landing after the answer
(DESIGN §3.8).  A backend that cannot (one opaque SDK call) leaves it False: such a call, or one
that had begun committing, may store its objects after the answer; they hold the snapshot taken
while the task owned its blocks, the answer counts them as not stored, the task's blocks are free
at once, and every drain (pause, sleep, RL clear) waits for the call (``Outcome.still_storing``).
"""
from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

# Per-key result codes.  NOT_FOUND and BUFFER_TOO_SMALL keep Mooncake's values.
OK = 0
NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
CORRUPT = -900
UNAVAILABLE = -901
INVALID = -902
NO_SPACE = -903
TIMEOUT = -904

CODE_NAMES = {
    NOT_FOUND: "not found", BUFFER_TOO_SMALL: "buffer too small", CORRUPT: "corrupt", UNAVAILABLE: "unavailable",
    INVALID: "invalid", NO_SPACE: "no space", TIMEOUT: "timeout",
}


class StorageAccess(enum.Enum):
    HOST_STAGED = "host_staged"
    DEVICE_DIRECT = "device_direct"


class StorageConfigError(ValueError):
    """A backend's configuration is missing or wrong; the message names the key."""


class KVCacheStorage(ABC):
    name: str = "abstract"
    access: StorageAccess = StorageAccess.HOST_STAGED
    supports_multi_buffer: bool = False
    staged_read_piece_bytes: int = 0
    honours_commit_lease: bool = False

    @abstractmethod
    def register_buffer(self, ptr: int, size: int) -> None: ...

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[int]: ...

    def query(self, keys: Sequence[str]) -> int:
        hits = 0
        for present in self.exists(keys):
            if present != 1:
                break
            hits += 1
        return hits

    @abstractmethod
    def batch_get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]: ...

    @abstractmethod
    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]: ...

    def batch_get_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        if any(len(p) != 1 for p in ptr_lists):
            return [INVALID] * len(keys)
        return self.batch_get(keys, [p[0] for p in ptr_lists], [s[0] for s in size_lists])

    def batch_set_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        if any(len(p) != 1 for p in ptr_lists):
            return [INVALID] * len(keys)
        return self.batch_set(keys, [p[0] for p in ptr_lists], [s[0] for s in size_lists])

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> list[int]: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "KVCacheStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_bool(what: str, value: Any) -> bool:
    """A boolean option given as a bool, 0/1 or a word (environment variables are strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise StorageConfigError(f"{what} {value!r} must be a boolean")


def check_batch(keys: Sequence[str], ptrs: Sequence[object], sizes: Sequence[object]) -> None:
    """Refuses batches whose lists differ in length (a caller bug, not a per-key failure)."""
    if not (len(keys) == len(ptrs) == len(sizes)):
        raise ValueError(f"batch of {len(keys)} keys with {len(ptrs)} buffers and {len(sizes)} sizes")


class CommitLease:
    """Lets a backend write call commit (make its objects visible to anyone) only while the task
    that made it still waits for it: DESIGN §3.8, no object is written after the task's result
    left the rank.  The backend calls ``begin()`` just before its commit point and stores nothing
    when it answers False, then ``end()``; the task calls ``revoke()`` before it answers, which
    says whether a commit is under way (begun, not ended): then the call may still store the
    snapshot after the answer, and the rank keeps the task active until it returns.  ``revoke``
    never waits for the backend, so a stalled disk cannot delay an answer."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._revoked = False
        self._committing = False
        self._lock = threading.Lock()

    def begin(self) -> bool:
        """Whether the caller may commit now (the lease is live and its deadline not passed)."""
        with self._lock:
            if self._revoked or time.monotonic() >= self.deadline:
                self._revoked = True
                return False
            self._committing = True
            return True

    def end(self) -> None:
        """The commit begun is over (done or failed); another may begin while the lease lives."""
        with self._lock:
            self._committing = False

    def revoke(self) -> bool:
        """No commit may begin from now on; True when one is under way (it may still land)."""
        with self._lock:
            self._revoked = True
            return self._committing


_lease = threading.local()  # a backend call runs on one thread from start to return


@contextmanager
def commit_lease(lease: CommitLease | None) -> Iterator[None]:
    """Makes ``lease`` the calling thread's for the backend calls made inside."""
    previous = getattr(_lease, "current", None)
    _lease.current = lease
    try:
        yield
    finally:
        _lease.current = previous


def current_commit_lease() -> CommitLease | None:
    """The lease of the backend call running on this thread, or None (no deadline to honour)."""
    return getattr(_lease, "current", None)
