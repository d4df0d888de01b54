"""Per-process state of the pyACL stand-in (tests only): contexts, mappings, streams, call counts.

A process sees device memory only through its *regions*: its own ``acl.rt.malloc`` allocations
(at ``device_base(dev) + file offset``) and the exports it imported (at addresses of its own in
the device's import window), so another process's device pointer is meaningless here, as on
hardware.  A forked child starts with none of this (ACL contexts do not survive a fork).
"""
from __future__ import annotations

import bisect
import functools
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar, Union

from . import _faults
from ._errors import (
    ACL_ERROR_RT_CONTEXT_NULL,
    ACL_ERROR_RT_INVALID_HANDLE,
    ACL_ERROR_RT_STREAM_CONTEXT,
    ACL_ERROR_UNINITIALIZE,
)
from ._shared import Shared, standin_dir

F = TypeVar("F", bound=Callable[..., Any])
STREAM_BASE = 0x5C00_0000_0000  # stream handles: opaque ints, outside the device window


@dataclass
class Region:
    """Device memory this process may name: an allocation (key None) or an import (its key)."""

    start: int
    size: int
    dev: int
    file_off: int
    key: Optional[str] = None

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass
class Copy:
    """One queued copy: addresses and locations (0 host, 1 device) as the caller named them."""

    dst: int
    dst_loc: int
    src: int
    src_loc: int
    count: int


@dataclass
class Stream:
    handle: int
    dev: int
    tasks: list[list[Copy]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Local:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.initialized = False
        self.finalized = False
        self.tls = threading.local()
        self.hosts: dict[int, int] = {}  # malloc_host start -> size
        self._host_starts: list[int] = []
        self.regions: dict[int, Region] = {}
        self._region_starts: list[int] = []
        self.imports: dict[str, Region] = {}
        self.import_next: dict[int, int] = {}  # device -> next free offset in its import window
        self.streams: dict[int, Stream] = {}
        self.default_streams: dict[int, Stream] = {}
        self.next_stream = 1
        self.calls: Counter[str] = Counter()
        self._shared: Optional[Shared] = None

    # -- context -----------------------------------------------------------
    def device(self) -> Optional[int]:
        return getattr(self.tls, "device", None)

    def shared(self) -> Shared:
        root = standin_dir()
        with self.lock:
            if self._shared is None or self._shared.root != root:
                if self._shared is not None:
                    self._shared.close()
                self._shared = Shared(root)
            return self._shared

    # -- device regions ----------------------------------------------------
    def add_region(self, region: Region) -> None:
        with self.lock:
            self.regions[region.start] = region
            bisect.insort(self._region_starts, region.start)

    def remove_region(self, region: Region) -> None:
        with self.lock:
            del self.regions[region.start]
            self._region_starts.remove(region.start)

    def region_at(self, addr: int) -> Optional[Region]:
        with self.lock:
            i = bisect.bisect_right(self._region_starts, addr) - 1
            if i < 0:
                return None
            region = self.regions[self._region_starts[i]]
            return region if addr < region.end else None

    # -- pinned host memory ------------------------------------------------
    def add_host(self, start: int, size: int) -> None:
        with self.lock:
            self.hosts[start] = size
            bisect.insort(self._host_starts, start)

    def remove_host(self, start: int) -> None:
        with self.lock:
            del self.hosts[start]
            self._host_starts.remove(start)

    def host_at(self, addr: int) -> Optional[tuple[int, int]]:
        with self.lock:
            i = bisect.bisect_right(self._host_starts, addr) - 1
            if i < 0:
                return None
            start = self._host_starts[i]
            return (start, self.hosts[start]) if addr < start + self.hosts[start] else None

    # -- streams -----------------------------------------------------------
    def new_stream(self, dev: int) -> Stream:
        with self.lock:
            stream = Stream(STREAM_BASE + self.next_stream * 0x100, dev)
            self.next_stream += 1
            self.streams[stream.handle] = stream
            return stream

    def stream(self, handle: Any, dev: Optional[int]) -> Optional[Stream]:
        """The stream of a handle; 0 is the default stream of ``dev`` (the thread's device)."""
        with self.lock:
            if handle == 0 and not isinstance(handle, bool) and dev is not None:
                return self.default_streams.setdefault(dev, Stream(0, dev))
            return self.streams.get(handle) if isinstance(handle, int) else None

    def queue_stream(self, handle: Any) -> Union[Stream, int]:
        """The stream a copy may be queued on from this thread, or ACL_ERROR_RT_INVALID_HANDLE /
        ACL_ERROR_RT_STREAM_CONTEXT (a stream of another device)."""
        stream = self.stream(handle, self.device())
        if stream is None:
            return ACL_ERROR_RT_INVALID_HANDLE
        if stream.dev != self.device():
            return ACL_ERROR_RT_STREAM_CONTEXT
        return stream


_LOCAL = Local()
_LOCAL_LOCK = threading.Lock()


def local() -> Local:
    """This process's state (fresh after a fork)."""
    global _LOCAL
    if _LOCAL.pid != os.getpid():
        with _LOCAL_LOCK:
            if _LOCAL.pid != os.getpid():
                _LOCAL = Local()
    return _LOCAL


def api(name: str, *, on_error: Callable[[int], Any] = lambda ret: ret, needs_init: bool = True,
        needs_context: bool = True) -> Callable[[F], F]:
    """Count every call of ``name``; then refuse it without ``acl.init`` (ACL_ERROR_UNINITIALIZE), apply
    the ``"fail"`` knob, and refuse it on a thread without a device (ACL_ERROR_RT_CONTEXT_NULL)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            state = local()
            with state.lock:
                state.calls[name] += 1
                nth = state.calls[name]
            if needs_init and not state.initialized:
                return on_error(ACL_ERROR_UNINITIALIZE)
            code = _faults.injected(_faults.load(standin_dir()), name, nth)
            if code:
                if name == "synchronize_stream":
                    stream = state.stream(args[0] if args else kwargs.get("stream"), state.device())
                    if stream is not None:
                        with stream.lock:
                            stream.tasks.clear()
                return on_error(code)
            if needs_context and state.device() is None:
                return on_error(ACL_ERROR_RT_CONTEXT_NULL)
            return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def knobs() -> dict[str, Any]:
    return _faults.load(standin_dir())
